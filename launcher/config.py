"""The run configuration: one typed dataclass, filled from defaults < profile < recipe JSON < command line.

Every field carries metadata (litgpt / torchtitan habit): its `--help` text and its `kind`:
- "identity": defines the training; hashed into the run id; changing it on resume is drift;
- "identity-when-set": the same, but left out of the hash while unset (fields added after 0.1,
  so the run ids of earlier runs, and so their resumes, stay valid);
- "run": how long, where, how often, how watched (steps, cadence, logging, budgets, mirror):
  may change on resume and never changes the run id.
`--help` is generated from this table. The fields of the declared settings (those with a profile key or a
rule: lr and the schedule, activation checkpointing, attention, compile, the hang timeout, ...) are generated
from launcher/settings.py's TABLE, which resolves every setting once, with its source (plan_run). Flag names use dashes (`--seq-len`; `--seq_len` is accepted too:
zerotrain/cli_args.py), recipe keys may use dashes or underscores. Unknown recipe keys are refused, never ignored. The schedule's values a run
leaves open (lr, min_lr, warmup_steps; None here) come from the profile or the model (launcher/hparams.py, which
records where each came from in `sources`). The batch triple is resolved later, against the profile and the
world size (zerotrain.launcher.profiles.resolve_batch).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.cli_args import TOKEN_COUNT_FORMS, Parser, exact_integer, token_count
from zerotrain.launcher import model_spec, settings
from zerotrain.launcher.ends import exit_status_help
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.hparams import check_schedule, hashed_warmup, is_resolved, resolve_hparams
from zerotrain.launcher.optimizers import check_optimizer
from zerotrain.launcher.profiles import profile_from_accelerate
from zerotrain.reading import read_json_object

RECIPE_DIR = resource_dir("zerotrain.recipes")

IDENTITY, IDENTITY_WHEN_SET, RUN = settings.IDENTITY, settings.IDENTITY_WHEN_SET, settings.RUN
# The counts of tokens: a flag, a recipe value or a keyword may be written 11e9, 11B, 500M, 2T or 4096
# (zerotrain/cli_args.py token_count); validate() makes each an int, so the rest of the run sees ints only.
TOKEN_COUNTS = ("global_batch_tokens", "eval_tokens", "total_tokens", "warmup_tokens")
SOURCES = "sources"  # RunConfig.sources: where each value came from; not a flag, not hashed, not in config.json's "run"


def opt(default, help: str, kind: str = IDENTITY, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "kind": kind, "choices": choices})


@dataclass
class RunConfig:
    profile: str = opt("cpu", "hardware profile: a name in ds_configs/, a JSON path, or auto")
    model: str | None = opt(None, "a named preset (zerotrain.modeling.model.PRESETS); default debug when no other way to"
                                  " pick the model is given (--depth, --scaling-rule, --init-from)")
    data: str | None = opt(None, "(required: here or in the --config recipe) a mix JSON file (docs/data.md) or a"
                                 " prepared shard directory")
    tokenizer: str = opt("bytes", "bytes, or a Hugging Face tokenizer directory / tokenizer.json, or a hub name"
                                  " ORG/NAME[@REVISION] (default: --init-from's, else bytes)")
    seq_len: int = opt(256, "tokens per packed row")
    micro_batch: int | None = opt(None, "rows per rank per forward (default: the profile's)")
    grad_accum: int | None = opt(None, "micro-batches per optimizer step (default: the profile's, or derived"
                                       " from --global-batch-tokens)")
    global_batch_tokens: int | None = opt(None, "tokens per optimizer step over all ranks")
    seed: int = opt(1337, "seed of the model init and the data order")
    out: str = opt("runs", "directory holding run directories", RUN)
    run_id: str | None = opt(None, "run directory name (default: derived from the config, so the same command"
                                   " resumes)", RUN)
    save_every_steps: int = opt(0, "save a checkpoint every N steps (0: only at the end)", RUN)
    resume: str = opt("auto", "auto (newest verified checkpoint of the run, local then mirror), never, or a"
                              " checkpoint path", RUN)
    log_data_every_steps: int = opt(100, "log the realised token share per source every N steps (0: never)", RUN)
    packing: str | None = opt(None, "best-fit (default) or greedy; see dataio/format/packing.py", IDENTITY_WHEN_SET,
                              ("best-fit", "greedy"))
    depth: int | None = opt(None, "the depth rule: dim = depth x aspect ratio", IDENTITY_WHEN_SET)
    aspect_ratio: int | None = opt(None, "with --depth (default 64)", IDENTITY_WHEN_SET)
    head_dim: int | None = opt(None, "with --depth (default 128)", IDENTITY_WHEN_SET)
    scaling_rule: str | None = opt(None, "a rule in --rules-file, with --heads", IDENTITY_WHEN_SET)
    heads: int | None = opt(None, "with --scaling-rule", IDENTITY_WHEN_SET)
    rules_file: str | None = opt(None, "scaling rules YAML (default modeling/scaling_rules.yaml)", IDENTITY_WHEN_SET)
    init_from: str | None = opt(None, "a Hugging Face Llama or Qwen3 directory (safetensors), or a hub model"
                                      " ORG/NAME[@REVISION] found through the Hugging Face cache, to start from; without"
                                      " --tokenizer, its tokenizer.json is the run's (none: the byte tokenizer, when"
                                      " the model's vocabulary is its)", IDENTITY_WHEN_SET)
    swap_tokenizer: bool | None = opt(None, "with --init-from and a --tokenizer whose vocabulary is not the model's:"
                                            " train on it anyway (refused without this flag)", RUN)
    qk_norm: bool | None = opt(None, "RMSNorm on queries and keys (default off)", IDENTITY_WHEN_SET)
    rope_theta: float | None = opt(None, "RoPE base (default: the model's, 10000, or the --init-from config's); with"
                                         " --init-from, a new base for context extension. Part of the run id once"
                                         " set: a resume with another value is refused", IDENTITY_WHEN_SET)
    # --- long runs (docs/long-runs.md) ---
    save_every_hours: float | None = opt(None, "also save every H hours of wall clock (whichever comes first)", RUN)
    keep_last: int = opt(0, "keep the newest K complete checkpoints (0: all); never the --keep-best ones", RUN)
    mirror: str | None = opt(None, "copy each checkpoint in the background to DIR/RUN_ID/checkpoints/", RUN)
    eval_every_steps: int = opt(0, "evaluate every N steps (0: never); needs --eval-tokens or --eval-data", RUN)
    eval_tokens: int | None = opt(None, "tokens per evaluation; without --eval-data they are held out of the"
                                        " training mix (deterministic from the seed)", IDENTITY_WHEN_SET)
    eval_data: str | None = opt(None, "a mix file to evaluate on instead of a held-out slice", RUN)
    early_stop_patience: int | None = opt(None, "stop after P evaluations without a new best", RUN)
    max_hours: float | None = opt(None, "stop (after saving) at the last step that fits in H hours, over resumes",
                                  RUN)
    budget_usd: float | None = opt(None, "stop (after saving) before spending B dollars; needs --gpu-hour-usd", RUN)
    gpu_hour_usd: float | None = opt(None, "price of one GPU-hour; cost = price x world size x hours", RUN)
    on_spike: str = opt("warn", "on a loss spike: warn, stop (exit 3) or rollback to the last good checkpoint",
                        RUN, ("warn", "stop", "rollback"))
    piece_len: int | None = opt(None, "cut documents longer than this into pieces (dataio; default derived from"
                                      " --seq-len)", IDENTITY_WHEN_SET)
    # --- observability (launcher/components/observe/metrics.py) ---
    log: str | None = opt(None, "metrics sinks besides metrics.jsonl, comma-separated: tensorboard"
                                " (RUN_DIR/tensorboard/), wandb (offline unless an API key is set)", RUN)
    wandb_project: str | None = opt(None, "with --log wandb: the W&B project (default: $WANDB_PROJECT, else"
                                          " zerotrain)", RUN)
    wandb_entity: str | None = opt(None, "with --log wandb: the W&B entity (default: $WANDB_ENTITY, else your"
                                         " default entity)", RUN)
    wandb_group: str | None = opt(None, "with --log wandb: the W&B group (default: $WANDB_RUN_GROUP)", RUN)
    wandb_name: str | None = opt(None, "with --log wandb: the W&B display name (default: $WANDB_NAME, else the run"
                                       " id; the W&B run id is $WANDB_RUN_ID, else the run id)", RUN)
    # --- optimizers (launcher/optimizers.py) ---
    optimizer: str | None = opt(None, "adamw (default: the profile's), muon, lion, adamw-decaying-wd, ademamix, or"
                                      " module.path:ClassName (docs/optimizers.md)", IDENTITY_WHEN_SET)
    optimizer_args: dict | None = opt(None, "the optimizer's hyper-parameters as a JSON object, e.g."
                                            " '{\"weight_decay\": 0.0}'", IDENTITY_WHEN_SET)
    # --- the planner's fit check (launcher/planning) ---
    fit_check: bool | None = opt(None, "refuse, before building anything, a config the planner says cannot fit in"
                                       " this device's memory (default on; --no-fit-check to try anyway)", RUN)
    # --- recipes (--config) and --dry-run ---
    dry_run: bool | None = opt(None, "resolve everything (profile, batch, model, data, plan) against the world"
                                     " size, print it and exit 0 without building or writing anything", RUN)
    description: str | None = opt(None, "free text; recipes use it to say what they are for", RUN)
    # --- pre-flight golden steps (launcher/commands/preflight/) ---
    golden: str | None = opt(None, "a golden.json from `zerotrain preflight --stage v3`: warn when tokens/s or peak"
                                   " memory at its golden steps is more than 10% off (another config is refused)", RUN)
    golden_strict: bool | None = opt(None, "with --golden: stop (checkpoint saved, exit 8) instead of warning", RUN)
    # --- start-up speed ---
    verify_data: str | None = opt(None, "prepared shards at start-up: quick (default: manifest, sizes, headers and"
                                        " offsets every start; sha256 once per node, remembered by file identity) or"
                                        " full (every byte hashed by every rank, every start)", RUN,
                                  ("quick", "full"))
    torch_profile: str | None = opt(None, "START:COUNT: torch.profiler over COUNT steps from step START; rank 0"
                                          " writes RUN/torch_profile/summary.txt (the kernels that took the"
                                          " device's time, the host syncs) and trace.json", RUN)
    # The declared settings' flags (lr and the schedule, activation checkpointing, attention, compile, the hang
    # timeout, ...): one entry each in launcher/settings.py TABLE, generated here.
    for _s in settings.FLAGS:
        __annotations__[_s.name] = _s.type
        locals()[_s.name] = opt(_s.field_default, _s.help, _s.kind, _s.choices)
    del _s

    # Not a setting: where each value came from ("flag", "recipe", "given"; launcher/hparams.py adds the
    # resolved ones), for the start-up line. Filled by resolve_config / config_from.
    sources: dict | None = field(default=None, compare=False, repr=False, metadata={"help": "", "kind": SOURCES})

    @classmethod
    def kind(cls, name: str) -> str:
        return cls.__dataclass_fields__[name].metadata["kind"]

    def validate(self) -> None:
        for name in TOKEN_COUNTS:  # "11B" from a recipe, 11e9 (a float) from JSON or a keyword: the flag's parser
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                try:
                    setattr(self, name, exact_integer(v, suffixes=True))
                except ValueError as e:
                    raise UsageError(f"{flag(name)} {v!r}: {e}") from None
        if self.data is None:
            raise UsageError("--data: a mix file is required (its format: docs/data.md)")
        for name in ("seq_len", "micro_batch", "grad_accum", "global_batch_tokens", "eval_tokens",
                     "early_stop_patience", "piece_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise UsageError(f"{flag(name)}: must be a positive integer, got {v!r}")
        for name in ("save_every_steps", "seed", "log_data_every_steps", "keep_last", "eval_every_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{flag(name)}: must be a non-negative integer, got {v!r}")
        # the declared settings' own checks (lr and the schedule, attention, the hang timeout, ...; None: unset)
        settings.check_flags(self, flag)
        for name in ("save_every_hours", "max_hours", "budget_usd", "gpu_hour_usd"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise UsageError(f"{flag(name)}: must be a positive number, got {v!r}")
        if self.lr is not None and self.min_lr is not None:  # else checked once resolved (launcher/hparams.py)
            check_schedule(self)
        if self.warmup_tokens is not None and self.warmup_steps is not None:
            raise UsageError("--warmup-tokens and --warmup-steps: give one, the other is derived")
        if self.grad_accum is not None and self.global_batch_tokens is not None:
            raise UsageError("--grad-accum and --global-batch-tokens: give one, the other is derived")
        if self.resume not in ("auto", "never") and not Path(self.resume).exists():
            raise UsageError(f"--resume {self.resume}: no such checkpoint (use auto, never or a checkpoint path)")
        if self.run_id is not None and (not self.run_id or "/" in self.run_id or self.run_id.startswith(".")):
            raise UsageError(f"--run-id {self.run_id!r}: must be a plain directory name")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise UsageError(f"--out {self.out}: exists and is not a directory")
        if self.budget_usd is not None and self.gpu_hour_usd is None:
            raise UsageError(f"--budget-usd {self.budget_usd}: needs --gpu-hour-usd (the price of one GPU-hour)")
        if self.eval_every_steps and self.eval_tokens is None and self.eval_data is None:
            raise UsageError(f"--eval-every-steps {self.eval_every_steps}: no eval data; give --eval-tokens T"
                             " (held out of the training mix) or --eval-data MIX.json")
        if self.early_stop_patience is not None and not self.eval_every_steps:
            raise UsageError(f"--early-stop-patience {self.early_stop_patience}: needs --eval-every-steps")
        if self.eval_data is not None and not Path(self.eval_data).exists():
            raise UsageError(f"--eval-data {self.eval_data}: no such file or directory")
        if self.on_spike not in ("warn", "stop", "rollback"):
            raise UsageError(f"--on-spike {self.on_spike!r}: must be warn, stop or rollback")
        if self.fit_check is not None and not isinstance(self.fit_check, bool):  # the planner's fit check
            raise UsageError(f"--fit-check: must be true or false, got {self.fit_check!r}")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise UsageError(f"--deterministic: must be true or false, got {self.deterministic!r}")
        if self.verify_data not in (None, "quick", "full"):
            raise UsageError(f"--verify-data: must be quick or full, got {self.verify_data!r}")
        if self.golden_strict is not None and not isinstance(self.golden_strict, bool):  # pre-flight's golden steps
            raise UsageError(f"--golden-strict: must be true or false, got {self.golden_strict!r}")
        if self.golden_strict and self.golden is None:
            raise UsageError("--golden-strict: needs --golden PATH (a golden.json from `zerotrain preflight --stage v3`)")
        if self.mirror is not None and Path(self.mirror).exists() and not Path(self.mirror).is_dir():
            raise UsageError(f"--mirror {self.mirror}: exists and is not a directory")
        if self.nvme_path is not None:
            check_nvme_dir(self.nvme_path, "--nvme-path")
        if self.torch_profile is not None:
            try:
                torch_profile_window(self.torch_profile)
            except ValueError as e:
                raise UsageError(f"--torch-profile: {e}") from None
        self._resolve_tokenizer()
        # normalised, so `adamw` keeps the default's id
        self.optimizer, self.optimizer_args = check_optimizer(self.optimizer, self.optimizer_args)
        if "wandb" in parse_sinks(self.log) and self.run_id and any(c in WANDB_RESERVED for c in self.run_id):
            raise UsageError(f"--run-id {self.run_id!r}: --log wandb uses it as the W&B run id, which cannot"
                             f" contain any of {WANDB_RESERVED}")

    def _resolve_tokenizer(self) -> None:
        """With --init-from, the model's own tokenizer unless --tokenizer is given (launcher/model_spec.py)."""
        if self.swap_tokenizer is not None and not isinstance(self.swap_tokenizer, bool):
            raise UsageError(f"--swap-tokenizer: must be true or false, got {self.swap_tokenizer!r}")
        given = self._tokenizer_given()
        if self.swap_tokenizer and (self.init_from is None or given is None):
            raise UsageError("--swap-tokenizer: only with --init-from DIR and --tokenizer T (the tokenizer replacing"
                             " the model's)")
        if self.init_from is None:
            return
        self.tokenizer, _ = model_spec.init_from_tokenizer(self.init_from, given, bool(self.swap_tokenizer))
        if given is None and self.sources is not None:
            self.sources["tokenizer"] = settings.INIT_FROM

    def _tokenizer_given(self) -> str | None:
        """--tokenizer as given (flag, recipe, keyword), or None when it was left to its default."""
        if self.sources is not None:
            return self.tokenizer if self.sources.get("tokenizer") in settings.GIVEN else None
        return self.tokenizer if self.tokenizer != "bytes" else None

    def warnings(self) -> list[str]:
        out = []
        if self.swap_tokenizer and self.init_from is not None:
            _, swapped = model_spec.init_from_tokenizer(self.init_from, self._tokenizer_given(), True)
            out += [swapped] if swapped else []
        if self.warmup_steps is not None and self.warmup_steps >= self.max_steps:
            out.append(f"--warmup-steps {self.warmup_steps} >= --max-steps {self.max_steps}: the learning rate never"
                       " reaches its peak and never decays")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("sources")
        return d

    def identity(self, partial: bool = False) -> dict:
        """What defines the training (not how long, where, or how it is watched): hashed, and drift-checked.

        The values hashed are those the run trains with: lr, min_lr and warmup_steps left open are resolved
        first (launcher/hparams.py), against this config's profile. A `--profile auto` config cannot be
        before the rank detects its profile; `partial` (drift checks made before that) leaves them out.
        """
        cfg = self
        if not is_resolved(self):
            if self.profile != "auto":
                cfg = resolve_hparams(self)
            elif not partial:
                raise RuntimeError("RunConfig.identity: --profile auto is resolved on the rank (plan_run) first")
        d = {}
        for f in fields(cfg):
            v = hashed_warmup(cfg) if f.name == "warmup_steps" else getattr(cfg, f.name)
            kind = f.metadata["kind"]
            if kind in (RUN, SOURCES) or (kind == IDENTITY_WHEN_SET and v is None) or (v is None and partial) \
                    or (f.name == "warmup_steps" and v is None):  # from --warmup-tokens: that is hashed
                continue
            d[f.name] = v
        if d.get("model") is None:  # no default value (so a conflict can be seen), but "debug" for the hash
            d["model"] = "debug"
        if self.eval_data is not None:  # with --eval-data nothing is held out: eval_tokens does not train
            d.pop("eval_tokens", None)
        return d

    def identity_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]

    def drift(self, saved_run: dict, saved_sources: dict | None = None, resolved: dict | None = None) -> list[str]:
        """Identity fields that differ from a saved config.json's "run" section (its "run_sources": where each
        resolved value came from), as 'key old -> new'. `resolved`: this run's values of fields it leaves unset
        (run_plan.SPELLED_DEFAULTS); the saved run's value given equal to one of them is not drift."""
        old = RunConfig(**{k: v for k, v in saved_run.items() if k in self.__dataclass_fields__ and k != SOURCES},
                        sources=saved_sources).identity()
        new = self.identity(partial=True)
        if not is_resolved(self):  # --profile auto before detection: the rank checks these once resolved
            old = {k: v for k, v in old.items() if k in new or k not in ("lr", "min_lr", "warmup_steps")}
        resolved = resolved or {}
        return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
                and not (new.get(k) is None and k in resolved and old.get(k) == resolved[k])]


def check_nvme_dir(path: str, where: str) -> None:
    """An offload directory must exist, be a directory and take a file (a probe, removed; root passes any mode bit)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{where} {path}: no such directory")
    if not p.is_dir():
        raise UsageError(f"{where} {path}: not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".zerotrain-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"{where} {path}: not writable ({e.strerror or e})") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Every RunConfig field that is a setting (a flag and a recipe key): all but `sources`.
SETTINGS = tuple(f.name for f in fields(RunConfig) if f.metadata["kind"] != SOURCES)


def _arg_type(f):
    if f.name in TOKEN_COUNTS:
        return token_count
    t = f.type if isinstance(f.type, str) else f.type.__name__
    return int if "int" in t else float if "float" in t else str


def add_train_flags(p) -> None:
    """The driver's flags, generated from RunConfig (help, choices and defaults from each field), plus
    --config, onto a parser or an argument group (`zerotrain plan` lists them after its own)."""
    p.add_argument("--config", help="recipe JSON with the same keys as the flags; flags override it")
    for f in fields(RunConfig):
        if f.name not in SETTINGS:
            continue
        help_text = f.metadata["help"].replace("%", "%%")
        if f.name in TOKEN_COUNTS:
            help_text += f"; written {TOKEN_COUNT_FORMS} (exact integers)"
        if f.default is not None and "default" not in help_text:
            help_text += f" (default: {f.default})"  # argparse's own default stays None: unset, so a recipe applies
        help_text += {IDENTITY: "", IDENTITY_WHEN_SET: "", RUN: " [may change on resume]"}[f.metadata["kind"]]
        choices = f.metadata.get("choices")
        if "bool" in str(f.type):
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:  # choices are checked by validate(), with the same message for a flag and a recipe key
            p.add_argument(flag(f.name), type=_arg_type(f), default=None, dest=f.name, help=help_text,
                           metavar="{" + ",".join(choices) + "}" if choices else None)
    # Injected by the deepspeed launcher (and older torch launchers); the env var is what we use.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def build_parser() -> Parser:
    p = Parser(prog="zerotrain train", description="Train a decoder-only LM with DeepSpeed.",
               epilog=exit_status_help("train") + " Every --dashed-flag is also accepted as --underscored_flag.")
    add_train_flags(p)
    return p


def recipe_file(spec: str) -> Path:
    """A recipe file: a path, or the name of a shipped recipe (`zerotrain.recipes`, e.g. cpu-debug)."""
    p = Path(spec)
    if p.is_file():
        return p
    shipped = RECIPE_DIR / f"{spec}.json"
    if "/" not in spec and not spec.endswith(".json") and shipped.is_file():
        return shipped
    known = ", ".join(sorted(q.stem for q in RECIPE_DIR.glob("*.json")))
    raise UsageError(f"recipe {spec}: no such file (shipped recipes: {known})")


def load_recipe(path: str) -> dict:
    p = recipe_file(path)
    raw = read_json_object(p, f"recipe {path}")
    known = set(SETTINGS)
    recipe = {}
    for k, v in raw.items():
        key = k.replace("-", "_")
        if key not in known:
            raise UsageError(f"recipe {path}: unknown key {k!r}")
        recipe[key] = v
    return resolve_recipe_paths(recipe, p)


RECIPE_PATH_KEYS = ("data", "tokenizer", "init_from", "golden", "profile")  # the inputs a recipe may name by path


def resolve_recipe_paths(recipe: dict, recipe_path: Path) -> dict:
    """A recipe's relative input paths (RECIPE_PATH_KEYS; never --out or --mirror, which are where the run writes),
    resolved so that a recipe works from any directory:

    - a recipe given by path (any file outside the package's recipes): relative to that file's directory first,
      then to the working directory (as given);
    - a shipped recipe (`--config cpu-debug`, or its file in the package): relative to the working directory first
      (a checkout, or the user's own file of that name), then to the installed package: `dataio/mixes/demo.json`
      is zerotrain.dataio's `mixes/demo.json` (zerotrain.resource_dir, the same for a wheel and an editable install).

    A value found nowhere (a hub name, `bytes`, a profile name, a file not written yet) is left as it is, for the
    setting's own check to judge. Absolute paths are left as they are."""
    shipped = recipe_path.resolve().parent == RECIPE_DIR.resolve()
    out = dict(recipe)
    for key in RECIPE_PATH_KEYS:
        value = recipe.get(key)
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        candidates = [Path(value), _in_package(value)] if shipped else [recipe_path.parent / value, Path(value)]
        found = next((c for c in candidates if c is not None and c.exists()), None)
        if found is not None and found != Path(value):
            out[key] = str(found)
    return out


def _in_package(relative: str) -> Path | None:
    """`dataio/mixes/demo.json` as a file of the installed package (its first folder is a zerotrain subpackage:
    dataio, ds_configs, recipes, launcher, modeling), or None."""
    first, *rest = Path(relative).parts
    if first not in ("dataio", "ds_configs", "recipes", "launcher", "modeling") or not rest:
        return None
    return resource_dir(f"zerotrain.{first}", *rest)


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
    cfg = RunConfig(**values, sources=sources)
    cfg.validate()
    return resolve_hparams(cfg) if cfg.profile != "auto" else cfg


ALTERNATIVES = (("warmup_steps", "warmup_tokens"),)  # one of each pair; a flag replaces the recipe's other one


def over_recipe(recipe: dict, flags: dict) -> dict:
    """The recipe's values the flags leave standing: all but those a flag overrides, or whose alternative a flag
    gives (`--warmup-tokens` on a recipe with warmup_steps)."""
    dropped = {b if a in flags else a for a, b in ALTERNATIVES if (a in flags) != (b in flags)}
    return {k: v for k, v in recipe.items() if k not in flags and k not in dropped}


def resolve_config(argv: list[str] | None) -> RunConfig:
    ns = build_parser().parse_args(argv)
    flags = {name: getattr(ns, name) for name in SETTINGS if getattr(ns, name) is not None}
    values = over_recipe(load_recipe(ns.config), flags) if ns.config else {}
    sources = {k: "recipe" for k in values}
    return config_from({**values, **flags}, {**sources, **{k: "flag" for k in flags}})


SINKS = ("jsonl", "tensorboard", "wandb")


SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # sink -> the package it imports


WANDB_RESERVED = ":;,#?/'"  # characters W&B refuses in a run id (wandb_settings.validate_run_id)


def parse_sinks(spec: str | None) -> list[str]:
    """`--log a,b` as sink names, jsonl always first. UsageError (one line) for an unknown name or a
    sink whose package is not installed, so a typo is caught before anything is built."""
    if isinstance(spec, (list, tuple)) and all(isinstance(s, str) for s in spec):  # a recipe may give a list
        spec = ",".join(spec)
    if spec is not None and not isinstance(spec, str):
        raise UsageError(f"--log {spec!r}: expected sink names separated by commas, e.g. tensorboard,wandb")
    names = [s.strip() for s in (spec or "").split(",") if s.strip()]
    for name in names:
        if name not in SINKS:
            raise UsageError(f"--log {spec}: unknown sink {name!r} (choose from {', '.join(SINKS)})")
        package = SINK_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise UsageError(f"--log {name}: the {package} package is not installed (pip install {package})")
    return ["jsonl"] + [n for n in dict.fromkeys(names) if n != "jsonl"]


def torch_profile_window(text: str) -> tuple[int, int]:
    """'START:COUNT' -> (START, COUNT), both positive; ValueError (one line) otherwise."""
    start, _, count = str(text).partition(":")
    try:
        window = int(start), int(count)
    except ValueError:
        raise ValueError(f"must be START:COUNT (two positive integers, e.g. 12:3), got {text!r}") from None
    if min(window) <= 0:
        raise ValueError(f"must be START:COUNT (two positive integers, e.g. 12:3), got {text!r}")
    return window
