"""The run's plan: everything decided before any process touches disk or builds a model.

    identify(cfg) -> RunIdentity           cheap: the profile, the settings (launcher/settings.py, each
                                           with its source), the model, the run id and directory; what
                                           pre-flight and `zerotrain launch` need
    plan(identity, world, rank) -> RunPlan  the profile resolved into the exact DeepSpeed config for this
                                           world, the data, the machine (launcher/node.py), the attention
                                           kernel, where to resume (and on which world size), the golden
                                           check: frozen
    plan_run(cfg, world, rank)             plan(identify(cfg), world, rank)

The Trainer (zerotrain.launcher.trainer) is built from a RunPlan; `--dry-run` prints one.
"""
from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.format.packing import check_packing
from zerotrain.dataio.format.pieces import default_piece_len
from zerotrain.dataio.pipeline.commands import describe_data
from zerotrain.dataio.pipeline.loader import bos_differs, dataloader_settings, load_data, missing_bos, open_data
from zerotrain.dataio.pipeline.reshard import check_documents
from zerotrain.dataio.sources.holdout import holdout_rows, mix_rows
from zerotrain.dataio.sources.tokenizer import load_tokenizer
from zerotrain.launcher import model_spec
from zerotrain.launcher.components import determinism, manifest
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.components.checkpoints.run_lock import refuse_if_live
from zerotrain.launcher.components.launching.ports import free_port
from zerotrain.launcher.components.observe.golden import GoldenCheck
from zerotrain.launcher.components.guards import Budget
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.schedule import Schedule
from zerotrain.launcher.components.tasks import check_best_by, forward_positions, need_lm_eval, split_specs
from zerotrain.launcher.config import RunConfig, value, with_values
from zerotrain.launcher.config_resolve import config_warnings, identity_hash
from zerotrain.launcher.config_resolve import drift as config_drift
from zerotrain.launcher.errors import StopRun, UsageError
from zerotrain.launcher.rank_ends import report_exit
from zerotrain.launcher.hparams import (check_repeats, describe_hparams, describe_length, resolve_hparams,
                                        run_end, run_tokens, size_in_tokens, token_budget)
from zerotrain.launcher.node import Node
from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.offload.ops import check_offload_here
from zerotrain.launcher.optimizers import describe_implementation
from zerotrain.launcher.planning import (EvalCost, describe_cost, eval_cost, every_steps, fit_check, offload_lines,
                                        run_loss_chunk)
from zerotrain.launcher.profiles import (check_devices, check_with_deepspeed, describe_precision, detect_profile,
                                        load_profile)
from zerotrain.launcher.resize.layout import resize_layout
from zerotrain.launcher.resolution import resolve, tokens_per_step
from zerotrain.launcher.settings import BY_NAME, GIVEN, Settings, describe_settings, parse_every, with_schedule
from zerotrain.launcher.settings import resolve as resolve_settings
from zerotrain.modeling.sizes import ModelArgs, flops_per_token, mlp_tiles


def single_process_env() -> None:
    """Plain `python launcher/train.py` or a notebook: become rank 0 of a world of 1."""
    if "RANK" in os.environ:
        return
    port = free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@dataclass(frozen=True)
class RunPlan:
    """The resolved run: config, profile, DeepSpeed dict, data, model, run directory, resume point."""
    cfg: RunConfig
    world: int
    rank: int
    profile_name: str
    profile_why: str | None
    ds_config: dict
    settings: object  # zerotrain.launcher.settings.Settings: every setting's value and source
    data: object  # zerotrain.dataio.pipeline.loader.Data, loaded and checked
    eval_rows: dict | None  # per source, the packed rows every evaluation runs (dataio/sources/holdout.py)
    loader_settings: dict
    tokenizer: object
    model_args: object
    model_label: str
    init_from: str | None
    run_dir: Path
    resume_from: Path | None
    resume_meta: dict | None = None
    checkpoints_seen: tuple[Path, ...] = ()  # the complete checkpoints the plan saw (checked again under the lock)
    warnings: tuple[str, ...] = ()
    golden: object | None = None  # --golden: a zerotrain.launcher.components.observe.golden.GoldenCheck
    node: Node | None = None  # the machine (a dry run: the profile's hardware)
    budget: Budget | None = None  # --max-hours, --total-tokens, --budget-usd: the one the run counts against
    resume_line: str = ""  # whether a resume on this hardware is bit-identical, for the start-up line and dry run
    loss_chunk_tokens: int | None = None  # the chunked loss's chunk on this device (planner.run_loss_chunk)
    sequence_parallel: int = 1  # ranks sharing each row (--sequence-parallel): ranks [g*N, (g+1)*N) are group g
    eval_tasks: object | None = None  # --eval-tasks: components/tasks/lm.py Tasks, loaded with their data
    eval_tasks_every: int = 0  # steps between task scores (0: only at the end)
    best_higher: bool | None = None  # --best-by: whether higher is better (None: no --best-by, the val loss)

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: each SP group of N ranks reads one loader's rows (world / N)."""
        return self.world // self.sequence_parallel

    @property
    def batch_shape(self) -> str:
        """'micro x accum x row groups' for the start-up and dry-run lines (a row group: N ranks sharing rows)."""
        ds = self.ds_config
        return (f"{ds['train_micro_batch_size_per_gpu']} x {ds['gradient_accumulation_steps']} x {self.data_world}"
                + (f" (rows shared by {self.sequence_parallel} ranks)" if self.sequence_parallel > 1 else ""))

    @property
    def data_rank(self) -> int:
        """This rank's loader: its SP group's (DeepSpeed's parallel_state_sp puts ranks g*N..g*N+N-1 in group g)."""
        return self.rank // self.sequence_parallel
    offload_lines: tuple[str, ...] = ()  # host memory and host-link traffic with offload (planner.offload_lines)
    stage_line: str = ""  # the ZeRO stage, where it is not the profile's (profiles.one_device_stage)

    @property
    def attention(self) -> str:
        """The attention kernel the model runs (`attention_kernel`)."""
        return self.settings.attention

    @property
    def attention_why(self) -> str:
        """How it was chosen, for the start-up line."""
        return self.settings.given_words("attention")

    @property
    def deterministic(self) -> bool:
        """--deterministic, else the profile's (components/determinism.py)."""
        return bool(self.settings.deterministic)

    @property
    def finished(self) -> bool:
        """The checkpoint it resumes from is at --max-steps: the run is over (started again by a restart or a
        requeue after its last save); `run` says so and exits 0 without building anything."""
        return self.resume_meta is not None and self.resume_meta["step"] == self.cfg.schedule.max_steps

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.ds_config, self.cfg.data.seq_len)

    @property
    def resumed_at(self) -> tuple[int, int]:
        """(step, tokens trained) of the checkpoint the run resumes from; (0, 0) for a new run."""
        return (self.resume_meta["step"], self.resume_meta["tokens_seen"]) if self.resume_meta else (0, 0)

    @property
    def run_tokens(self) -> int:
        """Tokens the whole run trains, earlier launches included (launcher/hparams.py run_end)."""
        return run_tokens(self.cfg, self.tokens_per_step, *self.resumed_at)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def mirror_ckpt_dir(self) -> Path | None:
        mirror = self.cfg.checkpoints.mirror
        return Path(mirror) / self.run_dir.name / "checkpoints" if mirror else None


@dataclass(frozen=True)
class RunIdentity:
    """What names a run, cheap to find (no data read, no checkpoint opened, no machine asked beyond
    --profile auto's detection): the profile, the settings, the model, the run id and directory."""
    cfg: RunConfig  # its schedule resolved (launcher/hparams.py): the run id hashes what the run trains with
    profile_name: str
    profile_why: str | None  # --profile auto: what was detected
    profile: dict
    settings: Settings
    tokenizer: object
    model_args: object
    model_label: str
    init_from: str | None
    run_dir: Path


def identify(cfg: RunConfig) -> RunIdentity:
    """The run's identity: pre-flight, `zerotrain launch` (where restarts are recorded) and plan() start
    here. Raises UsageError."""
    why = None
    profile_spec = cfg.parallel.profile
    if profile_spec == "auto":
        profile_spec, why = detect_profile()
    profile_name, profile = load_profile(profile_spec)
    cfg = resolve_hparams(cfg, profile_name, profile)  # lr, schedule: flag > recipe > profile > rule (hparams.py)
    tokenizer = load_tokenizer(cfg.data.tokenizer)  # its vocabulary size is part of the model's label
    cfg = without_spelled_defaults(cfg, profile_name, profile, tokenizer.vocab_size)
    settings = resolve_settings(cfg, profile_name, profile)  # every other setting, each with its source
    model_args, model_label, init_from = model_spec.resolve(cfg, tokenizer.vocab_size)
    run_dir = Path(cfg.run.out) / run_id_of(cfg, model_label, profile_name)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir}: exists and is not a directory")
    return RunIdentity(cfg, profile_name, why, profile, settings, tokenizer, model_args, model_label, init_from,
                       run_dir)


# Identity settings hashed once given whose value without a flag is resolved (from the profile, a default, the
# model): the same value given (--no-tiled-mlp, --no-compile, --no-qk-norm, --rope-theta 10000 where each is what
# the run has anyway) is not another run: it is left unset, so the run id and the drift check see no change.
SPELLED_DEFAULTS = ("tiled_mlp", "compile", "qk_norm", "rope_theta")


def resolved_value(name: str, settings: Settings, model_args) -> object:
    """What a run has for a SPELLED_DEFAULTS name: the resolved setting, else the model's own value."""
    return settings.values[name] if name in BY_NAME else getattr(model_args, name)


def without_spelled_defaults(cfg: RunConfig, profile_name: str, profile: dict, vocab_size: int) -> RunConfig:
    """`cfg` with each SPELLED_DEFAULTS value that equals what the run resolves without it left unset."""
    given = {k: value(cfg, k) for k in SPELLED_DEFAULTS if value(cfg, k) is not None}
    if not given:
        return cfg
    bare = with_values(cfg, {k: None for k in given})
    settings, model_args = resolve_settings(bare, profile_name, profile), model_spec.resolve(bare, vocab_size)[0]
    same = [k for k, v in given.items() if resolved_value(k, settings, model_args) == v]
    if not same:
        return cfg
    return with_values(cfg, {k: None for k in same},
                       sources={k: v for k, v in (cfg.sources or {}).items() if k not in same})


def run_id_of(cfg: RunConfig, model_label: str, profile_name: str) -> str:
    """The run id: --run-id, else the model, the profile and the hash of the config's identity fields."""
    return cfg.run.run_id or f"{model_label}-{profile_slug(profile_name)}-{identity_hash(cfg)}"


def profile_slug(profile_name: str) -> str:
    """A profile name as a run id holds it: `auto:NVIDIA GeForce RTX 4090` -> `auto-nvidia-geforce-rtx-4090` (no
    colon or space in a directory name); a shipped profile's name is already one."""
    return re.sub(r"[^a-z0-9._-]+", "-", profile_name.lower()).strip("-") if ":" in profile_name else profile_name


def plan_run(cfg: RunConfig, world: int, rank: int = 0) -> RunPlan:
    """Everything decided before any process touches disk or builds a model. Raises UsageError/DataError."""
    return plan(identify(cfg), world, rank)


def plan(ident: RunIdentity, world: int, rank: int = 0) -> RunPlan:
    """The identified run against its data, this machine (or, on a dry run, the profile's) and its
    checkpoints: the DeepSpeed dict for this world size, the data read and checked, the attention kernel,
    the fit check, where to resume from, drift, the golden check."""
    cfg, profile_name, profile, settings = ident.cfg, ident.profile_name, ident.profile, ident.settings
    tokenizer, model_args, run_dir = ident.tokenizer, ident.model_args, ident.run_dir
    run_id = run_dir.name
    node = _machine(cfg, settings)
    here = () if cfg.run.dry_run else (node.device, node.count)
    device_warnings = check_devices(profile_name, profile, world, *here, detect=detect_profile)
    # the batch, the schedule sized in tokens, every setting and the DeepSpeed dict: as `zerotrain plan` has them
    resolved = resolve(cfg, profile_name, profile, world, node, model_args, settings=settings,
                       started_stage=_started_stage(run_dir))
    cfg, settings, ds_config, stage_line = resolved.cfg, resolved.settings, resolved.ds_config, resolved.stage_line
    check_with_deepspeed(ds_config, f"profile {profile_name}")  # its refusals at plan time, a dry run's too
    sp, data_world = resolved.sequence_parallel, resolved.data_world  # the data and loader states count row groups
    # a mix file or a prepared shard directory; "download": true hub sources fetched (not by a dry run)
    data = open_data(cfg.data.path, tokenizer, fetch=not cfg.run.dry_run)
    loader_settings = dataloader_settings(settings.dataloader, f"profile {profile_name}")
    loader_settings["packing"] = check_packing(cfg.data.packing or "best-fit", data.specs)  # SFT needs best-fit
    check_offload_here(ds_config, model_args, world, dry_run=cfg.run.dry_run)
    # host memory and traffic on the profile's hardware; a dry run refuses what its host cannot hold (a real
    # run: fit_check, against the RAM available now)
    host_lines = offload_lines(model_args, ds_config, settings.values, world, cfg.data.seq_len, settings.attention,
                               refuse=cfg.run.dry_run and cfg.observe.fit_check is not False)
    if cfg.observe.fit_check is not False and not cfg.run.dry_run:  # refuse what cannot fit before anything is written
        fit_check(cfg, model_args, ds_config, settings.values, world, attention=settings.attention)

    if cfg.checkpoints.mirror is not None:
        checkpoint.check_mirror(cfg.checkpoints.mirror, run_dir, run_id)
    ckpt_dir = run_dir / "checkpoints"
    mirror_ckpt = Path(cfg.checkpoints.mirror) / run_id / "checkpoints" if cfg.checkpoints.mirror else None
    resume_from = _resume_point(cfg, run_dir, ckpt_dir, mirror_ckpt, rank)
    checkpoints_seen = tuple(checkpoint.complete_checkpoints(ckpt_dir))  # checked again under the lock (Trainer)
    saved_file, meta = run_dir / "config.json", None
    saved = json.loads(saved_file.read_text()) if saved_file.is_file() else None
    saved_run = saved["run"] if saved is not None else None
    if resume_from is not None:
        cfg, ds_config, meta = _resume_layout(cfg, ds_config, resume_from, world, sp, data_world, data,
                                              loader_settings, run_dir, (ckpt_dir, mirror_ckpt), saved_run)
    if saved_run is not None and resume_from is not None and resume_from.parent in (ckpt_dir, mirror_ckpt):
        model_args = resumed_model(model_args, saved.get("model"), run_dir, ident.init_from)
        drift = config_drift(cfg, saved_run, saved.get("run_sources"),
                             {k: resolved_value(k, settings, model_args) for k in SPELLED_DEFAULTS},
                             layout_free=meta["world_size"] != world)
        drift += data_drift(saved, [s.__dict__ for s in data.specs], getattr(tokenizer, "sha256", None))
        if drift:
            raise UsageError(f"config drift against {run_dir / 'config.json'}: " + ", ".join(drift)
                             + "; start a new --run-id instead")
    golden = None
    if cfg.observe.golden:  # --golden: a golden file of another config or world size is refused here
        golden = GoldenCheck.load(cfg.observe.golden, cfg, world)
    Budget(cfg.budget.max_hours, cfg.schedule.total_tokens, cfg.budget.budget_usd, cfg.budget.gpu_hour_usd,
           world).check_tokens_per_step(
        tokens_per_step(ds_config, cfg.data.seq_len))  # --total-tokens as given, even when it sets the length
    # the budget the run counts against: --total-tokens only when it does not set the length (hparams.py)
    budget = Budget(cfg.budget.max_hours, token_budget(cfg), cfg.budget.budget_usd, cfg.budget.gpu_hour_usd, world)
    data, eval_rows, eval_warnings = _load_plan_data(cfg, data, tokenizer, data_world, loader_settings["workers"],
                                                     saved_run)
    if meta is not None and meta.get("documents") is not None:  # what the checkpoint's loaders split, before
        check_documents(data, meta["documents"], f"checkpoint {resume_from}")  # anything is written or converted
    tasks, tasks_every, best_higher = load_eval_tasks(cfg, settings, tokens_per_step(ds_config, cfg.data.seq_len))
    resumed = (meta["step"], meta["tokens_seen"]) if meta else (0, 0)
    repeats = check_repeats(data, run_tokens(cfg, tokens_per_step(ds_config, cfg.data.seq_len), *resumed),
                            settings.max_epochs, settings.sources["max_epochs"])
    settings = with_schedule(settings, cfg)  # the schedule's values and sources final (a resumed run's kept)
    return RunPlan(cfg=cfg, world=world, rank=rank, profile_name=profile_name, profile_why=ident.profile_why,
                   ds_config=ds_config, settings=settings, data=data, eval_rows=eval_rows,
                   loader_settings=loader_settings, tokenizer=tokenizer, model_args=model_args,
                   model_label=ident.model_label, init_from=ident.init_from, run_dir=run_dir,
                   resume_from=resume_from, resume_meta=meta, checkpoints_seen=checkpoints_seen,
                   warnings=(*device_warnings, *config_warnings(cfg), *repeats, *missing_bos(data), *eval_warnings,
                             *model_spec.context_warnings(cfg, model_args, ident.init_from)),
                   golden=golden, node=node, budget=budget,
                   resume_line=determinism.describe_resume(node.device, bool(settings.deterministic)),
                   loss_chunk_tokens=run_loss_chunk(model_args, ds_config, cfg.data.seq_len,
                                                    bool(settings.activation_checkpointing), settings.attention,
                                                    node.device, sp, bool(settings.tiled_mlp)),
                   sequence_parallel=sp, offload_lines=tuple(host_lines), stage_line=stage_line,
                   eval_tasks=tasks, eval_tasks_every=tasks_every, best_higher=best_higher)


def data_drift(saved: dict, sources: list[dict], tokenizer_sha256: str | None) -> list[str]:
    """What changed in the data since the run began, behind the same flags (the flags' drift is `config_drift`'s):
    the mix file's sources as config.json's "sources" recorded them (a weight, a field, a template, a source
    added or removed: the loader's state and the token stream are the old mix's), and the tokenizer's content
    (its tokenizer.json's sha256: another file at the same path). A record without either (an older run) is
    not compared. Not the data files' content: hashing every source at each resume costs too much."""
    out = []
    before = {s.get("name"): dict(s) for s in saved.get("sources") or []}
    sources = json.loads(json.dumps(sources))  # as config.json holds them: a list of files a list, not a tuple
    now = {s.get("name"): s for s in sources}
    for spec in (*before.values(), *now.values()):  # a downloaded hub source: its commit, not this node's cache path
        if spec.get("hub") and spec.get("hf"):
            spec["hf"] = Path(spec["hf"]).name
    if before and list(before) != list(now):
        out.append(f"mix sources {list(before)} -> {list(now)}")
    for name in (n for n in now if n in before):
        # a key the record lacks (written before the key existed) meant its default then
        old, new = {**SPEC_DEFAULTS, **before[name]}, now[name]
        out += [f"mix source {name!r} {k} {old[k]!r} -> {new[k]!r}" for k in old if k in new and old[k] != new[k]]
    recorded = saved.get("tokenizer_sha256")
    if recorded and tokenizer_sha256 and recorded != tokenizer_sha256:
        out.append(f"tokenizer content (its tokenizer.json's sha256) {recorded[:12]}... -> {tokenizer_sha256[:12]}...")
    return out


SPEC_DEFAULTS = {f.name: f.default for f in fields(SourceSpec) if f.default is not MISSING}

# what a checkpoint's weights do not depend on: the positions a run trains at, the initial weights' spread
NOT_IN_WEIGHTS = ("max_seq_len", "init_std")


def resumed_model(model_args: ModelArgs, saved: dict | None, run_dir: Path, init_from: str | None) -> ModelArgs:
    """The model a run resumes: the one its checkpoints hold, which config.json's "model" recorded (`saved`).
    The flags give it again, except where --init-from's config.json changed since (a norm's epsilon, the RoPE
    base: a model that loads and computes something else; another shape: DeepSpeed's load fails), which is
    refused naming the fields. A run an older zerotrain started from a checkpoint whose vocabulary it padded to a
    multiple of 64 resumes with its padded rows (they are in its checkpoints)."""
    if not saved:
        return model_args
    try:
        then = ModelArgs(**saved)
    except (TypeError, ValueError):
        return model_args  # not a record this version wrote: the flags' drift check speaks for the run
    now = model_args.to_dict()
    differ = [k for k, v in then.to_dict().items() if now.get(k) != v and k not in (*NOT_IN_WEIGHTS, "vocab_multiple_of")]
    if not differ:
        return model_args
    if differ == ["vocab_size"] and then.vocab_size == ModelArgs(vocab_size=model_args.vocab_size).vocab_size:
        return replace(model_args, vocab_size=then.vocab_size, vocab_multiple_of=then.vocab_multiple_of)
    source = f"--init-from {init_from}" if init_from else "the model flags"
    changes = ", ".join(f"{k} {getattr(then, k)!r} -> {now[k]!r}" for k in differ)
    raise UsageError(f"{source}: not the model {run_dir / 'config.json'} records, which its checkpoints hold ({changes});"
                     " restore it, or start a new --run-id")


def load_eval_tasks(cfg: RunConfig, settings: Settings, tokens_per_step: int):
    """--eval-tasks loaded with their data (components/tasks/lm.py), here, before anything is built: a task
    that cannot load, generates text, or a --best-by it lacks is refused in one line (a dry run too). Returns
    (tasks or None, the cadence in steps, --best-by's higher-is-better or None)."""
    if not settings.eval_tasks:
        for name in ("eval_tasks_every", "eval_limit", "best_by"):
            if getattr(settings, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(settings, name)}: needs --eval-tasks")
        return None, 0, None
    need_lm_eval()
    from zerotrain.launcher.components.tasks.lm import load_tasks  # lm_eval: the optional extra

    tasks = load_tasks(split_specs(settings.eval_tasks))
    every = settings.eval_tasks_every
    steps = every_steps(parse_every(every), tokens_per_step) if every is not None else cfg.eval.eval_every_steps
    higher = check_best_by(settings.best_by, tasks.higher) if settings.best_by else None
    return tasks, steps, higher


def describe_eval_tasks(plan: RunPlan) -> list[str]:
    """The start-up / --dry-run line of --eval-tasks."""
    if plan.eval_tasks is None:
        return []
    s = plan.settings
    when = f"every {plan.eval_tasks_every} steps and at the end" if plan.eval_tasks_every else "at the end"
    limit = f", the first {s.eval_limit} examples of each" if s.eval_limit else ""
    best = (f"; --best-by {s.best_by} ({'higher' if plan.best_higher else 'lower'} is better) chooses best.json"
            if s.best_by else "")
    return [f"eval tasks: {', '.join(plan.eval_tasks.names)} (lm-evaluation-harness, every rank){limit}, {when}"
            f" (its own phase, eval_tasks){best}", describe_cost(eval_tasks_cost(plan), s.expected_mfu)]


def eval_tasks_cost(plan: RunPlan) -> EvalCost:
    """--eval-tasks' cost over this launch's steps (planning/evaluation.py), from the loaded tasks' rows."""
    from zerotrain.launcher.components.tasks.lm import row_lengths  # lm_eval: checked when the tasks loaded

    args, s = plan.model_args, plan.settings
    lengths = row_lengths(plan.eval_tasks, plan.tokenizer, args.max_seq_len, s.eval_limit)
    positions = forward_positions(lengths, plan.data_world, plan.ds_config["train_micro_batch_size_per_gpu"],
                                  plan.sequence_parallel)
    start = plan.resumed_at[0]
    end = run_end(plan.cfg, plan.tokens_per_step, *plan.resumed_at)[0]
    return eval_cost(start, end, plan.eval_tasks_every, len(lengths), positions,
                     flops_per_token(args, args.max_seq_len) / 3, s.peak_flops_per_device, s.expected_mfu)


def _started_stage(run_dir: Path) -> int | None:
    """The ZeRO stage the run's first launch chose (its saved ds_config.json), or None for a new run."""
    saved = run_dir / "ds_config.json"
    if not saved.is_file():
        return None
    try:
        return (json.loads(saved.read_text()).get("zero_optimization") or {}).get("stage")
    except (OSError, ValueError):
        return None


def _resume_layout(cfg: RunConfig, ds_config: dict, resume_from: Path, world: int, sp: int, data_world: int,
                   data, loader_settings: dict, run_dir: Path, own_dirs: tuple, saved_run: dict | None):
    """A resume against its checkpoint: the layout it may change (world size, --sequence-parallel), the run's
    length counted from its tokens, the loader's workers, NVMe state. Returns (cfg, ds_config, meta); UsageError
    (one line) for what cannot be resumed."""
    meta = checkpoint.read_meta(resume_from)
    ds_config = resize_layout(ds_config, resume_from, meta, world, sp, data_world, data, run_dir / "ds_config.json",
                              micro_given=cfg.sources.get("micro_batch") in GIVEN)
    # --total-tokens counts from the checkpoint's tokens (this world's tokens per step may differ), a rule's
    # warmup stays the one the run started with
    cfg = size_in_tokens(cfg, tokens_per_step(ds_config, cfg.data.seq_len), (meta["step"], meta["tokens_seen"]),
                         saved_run if resume_from.parent in own_dirs else None)
    if meta.get("loader_workers", 0) != loader_settings["workers"]:
        raise UsageError(f"checkpoint {resume_from}: its data loader ran {meta.get('loader_workers', 0)} worker(s)"
                         f" per rank, this profile has {loader_settings['workers']}; the document order depends"
                         " on it (set zerotrain.dataloader.workers back)")
    offload.check_resume(ds_config, resume_from)
    if meta["step"] > cfg.schedule.max_steps:
        raise UsageError(f"checkpoint {resume_from}: already at step {meta['step']} > --max-steps"
                         f" {cfg.schedule.max_steps} ({cfg.sources.get('max_steps', 'given')})")
    return cfg, ds_config, meta


def finished_again(plan: RunPlan) -> StopRun:
    """A run started again once it reached --max-steps (a restart or a requeue after its last save; the README's
    "run the same command again"): nothing is built or trained; rank 0 records this launch in manifest.json
    as finished at that step (so `zerotrain runs` shows the run's true end) and says so; every rank exits 0."""
    step = plan.resume_meta["step"]
    stop = StopRun("finished", f"run {plan.run_dir.name} is finished: checkpoint {plan.resume_from} is at --max-steps"
                               f" {step}; nothing to train (a larger --max-steps extends it)")
    if plan.rank == 0:
        manifest.write_or_extend(plan.run_dir, run_id=plan.run_dir.name, config_hash=identity_hash(plan.cfg),
                                 profile=plan.profile_name, seed=plan.cfg.run.seed, world_size=plan.world,
                                 hosts=[socket.gethostname()], resumed_from=str(plan.resume_from),
                                 test_hooks=dict(TestHooks.from_env().variables))
        manifest.record_end(plan.run_dir, stop, step)
        report_exit(stop.exit_code)
        print(stop.message, flush=True)
    return stop


def describe(plan: RunPlan, schedule: bool = True) -> list[str]:
    """The run as the start-up lines and --dry-run both print it: where each hyper-parameter came from, the lr
    schedule (`schedule`: not when resuming, which says its own), the attention kernel, the precision, the
    optimizer's implementation on this machine (a dry run: the profile's), the settings that a profile or
    a rule decided, the warnings, and the data."""
    cfg, ds = plan.cfg, plan.ds_config
    lines = [*model_spec.describe_init_from(cfg.model.init_from),  # a hub model: its commit, from the cache or fetched
             describe_hparams(cfg),  # each value and where it came from (launcher/hparams.py)
             describe_length(cfg, plan.tokens_per_step, *plan.resumed_at)]
    if schedule:
        s = cfg.schedule
        lines.append(Schedule(s.lr, s.min_lr, s.warmup_steps, s.max_steps, s.shape or "cosine",
                              cfg.schedule.decay_fraction).describe(cfg.schedule.lr))
    lines += [*([f"profile auto: {plan.profile_why}"] if plan.profile_why else []),  # what --profile auto saw and took
              f"attention: {plan.attention} ({plan.attention_why})",
              describe_precision(ds),
              *([f"zero: {plan.stage_line}"] if plan.stage_line else []),
              *describe_tiled_mlp(plan),
              plan.resume_line,  # bit-identical or not, on this hardware with these settings
              describe_implementation(cfg, ds, plan.node.device),  # what steps, built or not
              *offload.describe(ds),  # what is offloaded where, and the DeepSpeed ops JIT-built for it
              *plan.offload_lines,  # the host memory it takes and the traffic over the host link
              describe_settings(plan.settings),
              *describe_eval_tasks(plan),
              *(f"zerotrain: warning: {w}" for w in plan.warnings)]
    return lines + describe_data(plan.data, plan.run_tokens)


def describe_tiled_mlp(plan: RunPlan) -> list[str]:
    """--tiled-mlp: how many tiles each MLP runs (sizes.mlp_tiles, the rule the model applies to its rows)."""
    if not plan.settings.tiled_mlp:
        return []
    positions = plan.cfg.data.seq_len // plan.sequence_parallel
    tiles = mlp_tiles(positions, plan.model_args.dim)
    return [f"tiled MLP: {tiles} tile(s) of up to {-(-positions // tiles)} of this rank's {positions} positions"
            f" (DeepSpeed's TiledMLP: ceil({positions} / dim {plan.model_args.dim}); recomputed in backward)"]


def _machine(cfg: RunConfig, settings) -> Node:
    """The machine, asked once; a dry run plans for the profile's, unless the profile names none (then this one's,
    which the real run would use: a dry run must not describe another run than `zerotrain train` makes here)."""
    if cfg.run.dry_run and (settings.hardware or {}).get("accelerator"):
        return Node.of_profile(settings.hardware)
    return Node.here()


def _resume_point(cfg: RunConfig, run_dir: Path, ckpt_dir: Path, mirror_ckpt: Path | None, rank: int) -> Path | None:
    """The checkpoint --resume names (verified), or None; --resume never refuses a run holding checkpoints. A run
    directory another live process holds is refused first: that run rotates the checkpoints a resume would use."""
    if not cfg.run.dry_run:
        refuse_if_live(run_dir)
    if cfg.checkpoints.resume == "auto":
        return checkpoint.find_resume(ckpt_dir, mirror_ckpt, say=say_rank0(rank))
    if cfg.checkpoints.resume == "never":
        if checkpoint.complete_checkpoints(ckpt_dir):
            raise UsageError(f"--resume never: {run_dir} already holds checkpoints; pick another --run-id")
        return None
    resume_from = Path(cfg.checkpoints.resume)
    if not (resume_from / checkpoint.MARKER).is_file():
        raise UsageError(f"--resume {cfg.checkpoints.resume}: not a complete zerotrain checkpoint"
                         f" (no {checkpoint.MARKER})")
    problem = checkpoint.verify(resume_from)
    if problem:
        raise UsageError(f"--resume {cfg.checkpoints.resume}: {problem}")
    return resume_from


def _load_plan_data(cfg: RunConfig, data, tokenizer, world: int, workers: int, saved_run: dict | None):
    """Reads every source / verifies every shard, cuts pieces, holds out eval documents: bad data stops
    here, identically on every rank. Returns (data, eval rows or None, warnings)."""
    piece_len = cfg.data.piece_len or default_piece_len(cfg.data.seq_len)
    if saved_run is not None and "piece_len" not in saved_run:
        piece_len = cfg.data.piece_len  # a run started before pieces existed: keep its documents whole, as it had them
    holdout = (cfg.run.seed, cfg.eval.eval_tokens) if cfg.eval.eval_tokens and cfg.eval.eval_data is None else None
    # seq_len = the bound SFT records must fit (their "overflow" policy applies beyond it)
    data = load_data(data, piece_len, world, workers, holdout, seq_len=cfg.data.seq_len,
                     verify=cfg.data.verify_data or "quick")
    if not cfg.eval.eval_every_steps:
        return data, None, []
    warnings = []
    if cfg.eval.eval_data is not None:
        eval_data = load_data(open_data(cfg.eval.eval_data, tokenizer, fetch=not cfg.run.dry_run),
                              seq_len=cfg.data.seq_len)
        eval_rows = mix_rows(eval_data, cfg.data.seq_len, cfg.eval.eval_tokens or EVAL_TOKENS_DEFAULT)
        warnings = bos_differs(data, eval_data, cfg.eval.eval_data)
    else:
        eval_rows = holdout_rows(data.eval_stores, data.specs, tokenizer, cfg.data.seq_len)
    if not eval_rows and not (cfg.run.dry_run and any(s.download and s.streamed for s in data.specs)):
        # (a dry run leaves "download": true sources not cached yet as hub names: the run holds them out)
        raise UsageError(f"--eval-every-steps {cfg.eval.eval_every_steps}: no eval data (every source is streamed);"
                         " give --eval-data MIX.json")
    return data, eval_rows, warnings


EVAL_TOKENS_DEFAULT = 65536  # --eval-data without --eval-tokens: tokens per evaluation


def say_rank0(rank: int):
    return (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
