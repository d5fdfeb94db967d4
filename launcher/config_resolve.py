"""A run's config validated, its open schedule values resolved, and hashed into the run id: the code above the
leaf launcher/config.py that reads the profile, the optimizer registry, the model spec and the settings table.

    config_from(values, sources) -> RunConfig   the Python API and the flags' end: flat names in, a validated tree out
    resolve_config(argv) -> RunConfig           the command line (and its --config recipe)
    build_parser()                              `zerotrain train --help`
    validate(cfg), config_warnings(cfg)         the checks (one line each, exit 2) and the warnings
    identity(cfg), identity_hash(cfg)           what defines the training, by flat name, and its 8-hex hash (run ids)
    drift(cfg, saved_run, ...)                  identity values that differ from a saved config.json's "run"
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from zerotrain.cli_args import Parser, exact_integer
from zerotrain.launcher import model_spec, settings
from zerotrain.launcher.config import (IDENTITY_WHEN_SET, LEAVES, RUN, SETTINGS, TOKEN_COUNTS, WANDB_RESERVED,
                                       RunConfig, add_train_flags, check_nvme_dir, flag, load_recipe, over_recipe,
                                       parse_sinks, set_value, torch_profile_window, value)
from zerotrain.launcher.ends import exit_status_help
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.hparams import check_schedule, hashed_warmup, is_resolved, resolve_hparams
from zerotrain.launcher.optimizers import check_optimizer
from zerotrain.launcher.profiles import profile_from_accelerate


def validate(cfg: RunConfig) -> None:
    """UsageError (one line) for a value the run cannot take; normalises what it accepts (token counts to ints,
    the optimizer's name, the tokenizer of --init-from) in place."""
    for name in TOKEN_COUNTS:  # "11B" from a recipe, 11e9 (a float) from JSON or a keyword: the flag's parser
        v = value(cfg, name)
        if v is not None and not isinstance(v, bool):
            try:
                set_value(cfg, name, exact_integer(v, suffixes=True))
            except ValueError as e:
                raise UsageError(f"{flag(name)} {v!r}: {e}") from None
    if cfg.data.path is None:
        raise UsageError("--data: a mix file is required (its format: docs/data.md)")
    for name in ("seq_len", "micro_batch", "grad_accum", "global_batch_tokens", "eval_tokens",
                 "early_stop_patience", "piece_len"):
        v = value(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise UsageError(f"{flag(name)}: must be a positive integer, got {v!r}")
    for name in ("save_every_steps", "seed", "log_data_every_steps", "keep_last", "eval_every_steps"):
        v = value(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UsageError(f"{flag(name)}: must be a non-negative integer, got {v!r}")
    # the declared settings' own checks (lr and the schedule, attention, the hang timeout, ...; None: unset)
    settings.check_flags(cfg, flag)
    for name in ("save_every_hours", "max_hours", "budget_usd", "gpu_hour_usd"):
        v = value(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
            raise UsageError(f"{flag(name)}: must be a positive number, got {v!r}")
    if cfg.schedule.lr is not None and cfg.schedule.min_lr is not None:  # else checked once resolved (hparams.py)
        check_schedule(cfg)
    if cfg.schedule.warmup_tokens is not None and cfg.schedule.warmup_steps is not None:
        raise UsageError("--warmup-tokens and --warmup-steps: give one, the other is derived")
    if cfg.schedule.grad_accum is not None and cfg.schedule.global_batch_tokens is not None:
        raise UsageError("--grad-accum and --global-batch-tokens: give one, the other is derived")
    if cfg.checkpoints.resume not in ("auto", "never") and not Path(cfg.checkpoints.resume).exists():
        raise UsageError(f"--resume {cfg.checkpoints.resume}: no such checkpoint (use auto, never or a checkpoint"
                         " path)")
    if cfg.run.run_id is not None and (not cfg.run.run_id or "/" in cfg.run.run_id or cfg.run.run_id.startswith(".")):
        raise UsageError(f"--run-id {cfg.run.run_id!r}: must be a plain directory name")
    if Path(cfg.run.out).exists() and not Path(cfg.run.out).is_dir():
        raise UsageError(f"--out {cfg.run.out}: exists and is not a directory")
    if cfg.budget.budget_usd is not None and cfg.budget.gpu_hour_usd is None:
        raise UsageError(f"--budget-usd {cfg.budget.budget_usd}: needs --gpu-hour-usd (the price of one GPU-hour)")
    if cfg.eval.eval_every_steps and cfg.eval.eval_tokens is None and cfg.eval.eval_data is None:
        raise UsageError(f"--eval-every-steps {cfg.eval.eval_every_steps}: no eval data; give --eval-tokens T"
                         " (held out of the training mix) or --eval-data MIX.json")
    if cfg.eval.early_stop_patience is not None and not cfg.eval.eval_every_steps:
        raise UsageError(f"--early-stop-patience {cfg.eval.early_stop_patience}: needs --eval-every-steps")
    if cfg.eval.eval_data is not None and not Path(cfg.eval.eval_data).exists():
        raise UsageError(f"--eval-data {cfg.eval.eval_data}: no such file or directory")
    if cfg.observe.on_spike not in ("warn", "stop", "rollback"):
        raise UsageError(f"--on-spike {cfg.observe.on_spike!r}: must be warn, stop or rollback")
    if cfg.observe.fit_check is not None and not isinstance(cfg.observe.fit_check, bool):  # the planner's fit check
        raise UsageError(f"--fit-check: must be true or false, got {cfg.observe.fit_check!r}")
    if cfg.parallel.deterministic is not None and not isinstance(cfg.parallel.deterministic, bool):
        raise UsageError(f"--deterministic: must be true or false, got {cfg.parallel.deterministic!r}")
    if cfg.data.verify_data not in (None, "quick", "full"):
        raise UsageError(f"--verify-data: must be quick or full, got {cfg.data.verify_data!r}")
    if cfg.observe.golden_strict is not None and not isinstance(cfg.observe.golden_strict, bool):  # golden steps
        raise UsageError(f"--golden-strict: must be true or false, got {cfg.observe.golden_strict!r}")
    if cfg.observe.golden_strict and cfg.observe.golden is None:
        raise UsageError("--golden-strict: needs --golden PATH (a golden.json from `zerotrain preflight --stage v3`)")
    mirror = cfg.checkpoints.mirror
    if mirror is not None and Path(mirror).exists() and not Path(mirror).is_dir():
        raise UsageError(f"--mirror {cfg.checkpoints.mirror}: exists and is not a directory")
    if cfg.parallel.nvme_path is not None:
        check_nvme_dir(cfg.parallel.nvme_path, "--nvme-path")
    if cfg.observe.torch_profile is not None:
        try:
            torch_profile_window(cfg.observe.torch_profile)
        except ValueError as e:
            raise UsageError(f"--torch-profile: {e}") from None
    _resolve_tokenizer(cfg)
    # normalised, so `adamw` keeps the default's id
    cfg.schedule.optimizer, cfg.schedule.optimizer_args = check_optimizer(cfg.schedule.optimizer,
                                                                          cfg.schedule.optimizer_args)
    if "wandb" in parse_sinks(cfg.observe.log) and cfg.run.run_id and any(c in WANDB_RESERVED for c in cfg.run.run_id):
        raise UsageError(f"--run-id {cfg.run.run_id!r}: --log wandb uses it as the W&B run id, which cannot"
                         f" contain any of {WANDB_RESERVED}")


def _resolve_tokenizer(cfg: RunConfig) -> None:
    """With --init-from, the model's own tokenizer unless --tokenizer is given (launcher/model_spec.py)."""
    if cfg.data.swap_tokenizer is not None and not isinstance(cfg.data.swap_tokenizer, bool):
        raise UsageError(f"--swap-tokenizer: must be true or false, got {cfg.data.swap_tokenizer!r}")
    given = _tokenizer_given(cfg)
    if cfg.data.swap_tokenizer and (cfg.model.init_from is None or given is None):
        raise UsageError("--swap-tokenizer: only with --init-from DIR and --tokenizer T (the tokenizer replacing"
                         " the model's)")
    if cfg.model.init_from is None:
        return
    cfg.data.tokenizer, _ = model_spec.init_from_tokenizer(cfg.model.init_from, given, bool(cfg.data.swap_tokenizer))
    if given is None and cfg.sources is not None:
        cfg.sources["tokenizer"] = settings.INIT_FROM


def _tokenizer_given(cfg: RunConfig) -> str | None:
    """--tokenizer as given (flag, recipe, keyword), or None when it was left to its default."""
    if cfg.sources is not None:
        return cfg.data.tokenizer if cfg.sources.get("tokenizer") in settings.GIVEN else None
    return cfg.data.tokenizer if cfg.data.tokenizer != "bytes" else None


def config_warnings(cfg: RunConfig) -> list[str]:
    out = []
    if cfg.data.swap_tokenizer and cfg.model.init_from is not None:
        _, swapped = model_spec.init_from_tokenizer(cfg.model.init_from, _tokenizer_given(cfg), True)
        out += [swapped] if swapped else []
    if cfg.schedule.warmup_steps is not None and cfg.schedule.warmup_steps >= cfg.schedule.max_steps:
        out.append(f"--warmup-steps {cfg.schedule.warmup_steps} >= --max-steps {cfg.schedule.max_steps}: the learning"
                   " rate never"
                   " reaches its peak and never decays")
    if cfg.eval.eval_data is not None and cfg.data.path is not None \
            and Path(cfg.eval.eval_data).resolve() == Path(cfg.data.path).resolve():
        out.append(f"--eval-data {cfg.eval.eval_data} is the training data itself: val_loss measures documents the run"
                   " trains on (leave --eval-data out to hold documents out of training instead)")
    return out


def identity(cfg: RunConfig, partial: bool = False) -> dict:
    """What defines the training (not how long, where, or how it is watched): hashed, and drift-checked.

    The values hashed are those the run trains with: lr, min_lr and warmup_steps left open are resolved
    first (launcher/hparams.py), against this config's profile. A `--profile auto` config cannot be
    before the rank detects its profile; `partial` (drift checks made before that) leaves them out.
    """
    given = cfg
    if not is_resolved(cfg):
        if cfg.parallel.profile != "auto":
            cfg = resolve_hparams(cfg)
        elif not partial:
            raise RuntimeError("RunConfig.identity: --profile auto is resolved on the rank (plan_run) first")
    d = {}
    for name, leaf in LEAVES.items():
        v = hashed_warmup(cfg) if name == "warmup_steps" else value(cfg, name)
        if leaf.kind == RUN or (leaf.kind == IDENTITY_WHEN_SET and v is None) or (v is None and partial) \
                or (name == "warmup_steps" and v is None):  # from --warmup-tokens: that is hashed
            continue
        d[name] = v
    if d.get("model") is None:  # no default value (so a conflict can be seen), but "debug" for the hash
        d["model"] = "debug"
    if given.eval.eval_data is not None:  # with --eval-data nothing is held out: eval_tokens does not train
        d.pop("eval_tokens", None)
    return d


def identity_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:8]


def drift(cfg: RunConfig, saved_run: dict, saved_sources: dict | None = None,
          resolved: dict | None = None, layout_free: bool = False) -> list[str]:
    """Identity fields that differ from a saved config.json's "run" section (its "run_sources": where each
    resolved value came from), as 'key old -> new'. `resolved`: this run's values of fields it leaves unset
    (run_plan.SPELLED_DEFAULTS); the saved run's value given equal to one of them is not drift. `layout_free`: a
    resume on another world size, which keeps the checkpoint's global batch whatever the micro-batch and the
    accumulation (launcher/resize/layout.py): those two may change."""
    old = identity(RunConfig.from_flat({k: v for k, v in saved_run.items() if k in LEAVES}, sources=saved_sources))
    new = identity(cfg, partial=True)
    if not is_resolved(cfg):  # --profile auto before detection: the rank checks these once resolved
        old = {k: v for k, v in old.items() if k in new or k not in ("lr", "min_lr", "warmup_steps")}
    resolved = resolved or {}
    free = ("micro_batch", "grad_accum") if layout_free else ()
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
            and not (new.get(k) is None and k in resolved and old.get(k) == resolved[k]) and k not in free]


def build_parser() -> Parser:
    p = Parser(prog="zerotrain train", description="Train a decoder-only LM with DeepSpeed.",
               epilog=exit_status_help("train") + " Every --dashed-flag is also accepted as --underscored_flag.")
    add_train_flags(p)
    return p


def config_from(values: dict, sources: dict | None = None) -> RunConfig:
    """A validated RunConfig from keyword values (the Python API: same names and checks as the flags).

    `sources`: where each value came from ("flag", "recipe"; default "given"). The values left open are
    resolved against the profile and the model (launcher/hparams.py); under `--profile auto` that happens
    on the rank, after detection (run_plan.plan_run).
    """
    unknown = sorted(set(values) - set(SETTINGS))
    if unknown:
        raise UsageError(f"unknown setting {unknown[0]!r} (see `zerotrain train --help`)")
    sources = {**{k: "given" for k in values}, **(sources or {})}
    values = {**values, **profile_from_accelerate(values)}  # under accelerate, its deepspeed_config_file is the profile
    cfg = RunConfig.from_flat(values, sources=sources)
    validate(cfg)
    return resolve_hparams(cfg) if cfg.parallel.profile != "auto" else cfg


def resolve_config(argv: list[str] | None) -> RunConfig:
    ns = build_parser().parse_args(argv)
    flags = {name: getattr(ns, name) for name in SETTINGS if getattr(ns, name) is not None}
    values = over_recipe(load_recipe(ns.config), flags) if ns.config else {}
    sources = {k: "recipe" for k in values}
    return config_from({**values, **flags}, {**sources, **{k: "flag" for k in flags}})
