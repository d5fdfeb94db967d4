"""The run configuration: a tree of typed dataclasses, one per concern, filled from defaults < profile < recipe JSON
< command line. A leaf: it imports no code that resolves it (launcher/config_resolve.py validates it, resolves
the values it leaves open and hashes it into the run id).

    RunConfig
      model        ModelConfig       the preset, a size rule, --init-from, and the architecture's options
      data         DataConfig        the mix, its tokenizer, packing and pieces, how shards are checked
      schedule     ScheduleConfig    the batch, the run's length, the optimizer and the learning-rate schedule
      checkpoints  CheckpointConfig  when to save, what to keep, the mirror, what to resume from
      parallel     ParallelConfig    the profile, sequence parallelism, offload, checkpointing, kernels
      eval         EvalConfig        the validation loss, lm-evaluation-harness tasks, early stopping
      budget       BudgetConfig      hours and dollars
      observe      ObserveConfig     sinks, W&B, the profiler, golden steps, spikes, hangs, the fit check
      run          RunSetup          where the run is written, its name, its seed, --dry-run
      sources      where each value came from (not a setting)

Every field carries metadata (litgpt / torchtitan habit): its `--help` text and its `kind`:
- "identity": defines the training; hashed into the run id; changing it on resume is drift;
- "identity-when-set": the same, but left out of the hash while unset (fields added after 0.1,
  so the run ids of earlier runs, and so their resumes, stay valid);
- "run": how long, where, how often, how watched (steps, cadence, logging, budgets, mirror):
  may change on resume and never changes the run id.

The edges stay flat: each field has one flat name, unique over the tree (its own name, or `flat=` where the
group already says it: model.preset is `model`, data.path is `data`, schedule.shape is `schedule`). That name is
the `--flag` (dashes; `--seq_len` is accepted too: zerotrain/cli_args.py), the recipe key (dashes or
underscores; unknown keys are refused, never ignored), the notebook keyword, the key in config.json's "run" and
"run_sources", and what the run id hashes, so the ids of earlier runs do not change. `LEAVES` is that mapping,
written once; `RunConfig.from_flat` and `RunConfig.to_dict` are its two directions. `FLAG_ORDER` keeps the order
`--help`, config.json and the settings line have always had. The declared settings (launcher/settings.py TABLE:
lr and the schedule, activation checkpointing, attention, compile, the hang timeout, ...) name their field here by
dotted path ("schedule.lr"); the table adds their profile key, rule and check. The schedule's values a run leaves
open (lr, min_lr, warmup_steps; None here) come from the profile or the model (launcher/hparams.py, which records
where each came from in `sources`). The batch triple is resolved later, against the profile and the world size.
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.cli_args import TOKEN_COUNT_FORMS, token_count
from zerotrain.errors import UsageError
from zerotrain.modeling.sizes import ATTENTION_BACKENDS
from zerotrain.reading import read_json_object

RECIPE_DIR = resource_dir("zerotrain.recipes")

IDENTITY, IDENTITY_WHEN_SET, RUN = "identity", "identity-when-set", "run"
# The counts of tokens: a flag, a recipe value or a keyword may be written 11e9, 11B, 500M, 2T or 4096
# (zerotrain/cli_args.py token_count); validation makes each an int, so the rest of the run sees ints only.
TOKEN_COUNTS = ("global_batch_tokens", "eval_tokens", "total_tokens", "warmup_tokens")
OFFLOAD_CHOICES = ("none", "optimizer", "all")  # --offload / zerotrain.offload


def opt(default, help: str, kind: str = IDENTITY, choices: tuple | None = None, flat: str | None = None):
    """A setting's field: its default, --help text, kind, choices, and its flat name where it is not the field's."""
    return field(default=default, metadata={"help": help, "kind": kind, "choices": choices, "flat": flat})


@dataclass
class ModelConfig:
    """The model: a preset, a size rule, or a checkpoint to start from, and its architecture's options."""

    preset: str | None = opt(None, "a named preset (zerotrain.modeling.model.PRESETS); default debug when no other "
                                   "way to pick the model is given (--depth, --scaling-rule, --init-from)",
                             flat="model")
    depth: int | None = opt(None, "the depth rule: dim = depth x aspect ratio", IDENTITY_WHEN_SET)
    aspect_ratio: int | None = opt(None, "with --depth (default 64)", IDENTITY_WHEN_SET)
    head_dim: int | None = opt(None, "with --depth (default 128)", IDENTITY_WHEN_SET)
    scaling_rule: str | None = opt(None, "a rule in --rules-file, with --heads", IDENTITY_WHEN_SET)
    heads: int | None = opt(None, "with --scaling-rule", IDENTITY_WHEN_SET)
    rules_file: str | None = opt(None, "scaling rules YAML (default modeling/scaling_rules.yaml)", IDENTITY_WHEN_SET)
    init_from: str | None = opt(None, "a Hugging Face Llama or Qwen3 directory (safetensors), or a hub model "
                                      "ORG/NAME[@REVISION] found through the Hugging Face cache, to start from; "
                                      "without --tokenizer, its tokenizer.json is the run's (none: the byte "
                                      "tokenizer, when the model's vocabulary is its)", IDENTITY_WHEN_SET)
    qk_norm: bool | None = opt(None, "RMSNorm on queries and keys (default off)", IDENTITY_WHEN_SET)
    rope_theta: float | None = opt(None, "RoPE base (default: the model's, 10000, or the --init-from config's); with "
                                         "--init-from, a new base for context extension. Part of the run id once "
                                         "set: a resume with another value is refused", IDENTITY_WHEN_SET)


@dataclass
class DataConfig:
    """The data: the mix, its tokenizer, how rows are packed and checked."""

    path: str | None = opt(None, "(required: here or in the --config recipe) a mix JSON file (docs/data.md) or a "
                                 "prepared shard directory", flat="data")
    tokenizer: str = opt("bytes", "bytes, or a Hugging Face tokenizer directory / tokenizer.json, or a hub name "
                                  "ORG/NAME[@REVISION] (default: --init-from's, else bytes)")
    swap_tokenizer: bool | None = opt(None, "with --init-from and a --tokenizer whose vocabulary is not the model's: "
                                            "train on it anyway (refused without this flag)", RUN)
    seq_len: int = opt(256, "tokens per packed row")
    packing: str | None = opt(None, "best-fit (default) or greedy; see dataio/format/packing.py", IDENTITY_WHEN_SET,
                              choices=("best-fit", "greedy"))
    piece_len: int | None = opt(None, "cut documents longer than this into pieces (dataio; default derived from "
                                      "--seq-len)", IDENTITY_WHEN_SET)
    log_data_every_steps: int = opt(100, "log the realised token share per source every N steps (0: never)", RUN)
    verify_data: str | None = opt(None, "prepared shards at start-up: quick (default: manifest, sizes, headers and "
                                        "offsets every start; sha256 once per node, remembered by file identity) or "
                                        "full (every byte hashed by every rank, every start)", RUN,
                                  choices=("quick", "full"))
    max_epochs: float | None = opt(None, "refuse a run that reads any source more than E times (default: the "
                                         "profile's zerotrain.max_epochs, else no limit; above 4 a warning)", RUN)


@dataclass
class ScheduleConfig:
    """The batch, the run's length, the optimizer and its learning-rate schedule (launcher/hparams.py resolves what
    is left open)."""

    micro_batch: int | None = opt(None, "rows per rank per forward (default: the profile's)")
    grad_accum: int | None = opt(None, "micro-batches per optimizer step (default: the profile's, or derived from "
                                       "--global-batch-tokens)")
    global_batch_tokens: int | None = opt(None, "tokens per optimizer step over all ranks")
    lr: float | None = opt(None, "peak learning rate (default: the scaling rule's law, else the profile's "
                                 "optimizer.params.lr, else the optimizer's own, else a per-size rule; the start-up "
                                 "line says which)")
    min_lr: float | None = opt(None, "learning rate at the end of the decay (default: the profile scheduler's "
                                     "cos_min_ratio x lr, else lr / 10)")
    warmup_steps: int | None = opt(None, "linear warmup steps (default: from --warmup-tokens, else the profile "
                                         "scheduler's, else max(20, 1% of --max-steps): Pythia's warmup)")
    warmup_tokens: int | None = opt(None, "linear warmup over N training tokens, rounded up to whole steps (instead "
                                          "of --warmup-steps)", IDENTITY_WHEN_SET)
    max_steps: int = opt(100, "optimizer steps of the whole run (default: from --total-tokens, else the profile "
                              "scheduler's, else 100); may grow on resume (see --schedule)", RUN)
    total_tokens: int | None = opt(None, "training tokens of the whole run: without --max-steps it sets the run's "
                                         "length (steps = N / tokens per step, rounded up; the schedule spans them); "
                                         "with --max-steps, a budget: stop (after saving) at the last step within N "
                                         "tokens", RUN)
    shape: str | None = opt(None, "after warmup, cosine (default): decay to --min-lr at --max-steps; wsd "
                                  "(warmup-stable-decay): hold the peak, then decay linearly over the last "
                                  "--decay-fraction of the steps. A wsd run resumed in its stable phase with a "
                                  "larger --max-steps re-plans its decay; a cosine one keeps its length",
                            IDENTITY_WHEN_SET, choices=("cosine", "wsd"), flat="schedule")
    decay_fraction: float | None = opt(None, "with --schedule wsd: the fraction of --max-steps spent decaying "
                                             "(default 0.2)", IDENTITY_WHEN_SET)
    optimizer: str | None = opt(None, "adamw (default: the profile's), muon, lion, adamw-decaying-wd, ademamix, or "
                                      "module.path:ClassName (docs/optimizers.md)", IDENTITY_WHEN_SET)
    optimizer_args: dict | None = opt(None, "the optimizer's hyper-parameters as a JSON object, e.g. "
                                            '\'{"weight_decay": 0.0}\'', IDENTITY_WHEN_SET)


@dataclass
class CheckpointConfig:
    """Checkpoints: when they are saved, which are kept, where they are copied, which one a run resumes from."""

    save_every_steps: int = opt(0, "save a checkpoint every N steps (0: only at the end)", RUN)
    save_every_hours: float | None = opt(None, "also save every H hours of wall clock (whichever comes first)", RUN)
    keep_last: int = opt(0, "keep the newest K complete checkpoints (0: all); never the --keep-best ones", RUN)
    keep_best: int = opt(1, "keep the K checkpoints of lowest validation loss, or best --best-by score "
                            "(checkpoints/best.json lists them, best first); --keep-last never removes them", RUN)
    mirror: str | None = opt(None, "copy each checkpoint in the background to DIR/RUN_ID/checkpoints/", RUN)
    resume: str = opt("auto", "auto (newest verified checkpoint of the run, local then mirror), never, or a "
                              "checkpoint path", RUN)


@dataclass
class ParallelConfig:
    """The devices: the hardware profile, how work and ZeRO state are spread, and the kernels that run."""

    profile: str = opt("cpu", "hardware profile: a name in ds_configs/, a JSON path, or auto")
    sequence_parallel: int | None = opt(None, "Ulysses sequence parallelism: N ranks share every row (each computes "
                                              "T/N of its positions; an all-to-all around attention), data "
                                              "parallelism over world/N. N must divide the world, the attention "
                                              "heads and --seq-len; kv heads must divide by N or divide it. The same "
                                              "math: not part of the run id. Default: the profile's "
                                              "zerotrain.sequence_parallel, else 1", RUN)
    offload: str | None = opt(None, "move ZeRO state to host memory (or NVMe with --nvme-path): optimizer (its "
                                    "states and fp32 master weights, with DeepSpeed's CPU Adam) or all (the "
                                    "parameters too; ZeRO-3 only); none: neither. Default: the profile's "
                                    "zerotrain.offload, else its DeepSpeed offload keys. Moves state, not the math: "
                                    "not part of the run id", RUN, choices=OFFLOAD_CHOICES)
    nvme_path: str | None = opt(None, "with --offload: swap the offloaded state to files in DIR (an NVMe mount) "
                                      "instead of host memory; default: the profile's zerotrain.nvme_path", RUN)
    activation_checkpointing: bool | None = opt(None, "recompute activations in backward (default: the profile's)")
    tiled_mlp: bool | None = opt(None, "compute every MLP over tiles of positions and recompute it in backward "
                                       "(DeepSpeed's TiledMLP, ceil(positions per rank / dim) tiles), so its "
                                       "ffn-wide activations are never held for a whole row: for long rows, with "
                                       "--sequence-parallel or without. The same math to rounding (the weights' "
                                       "gradients are summed tile by tile): part of the run id once given. Default: "
                                       "the profile's zerotrain.tiled_mlp, else off", IDENTITY_WHEN_SET)
    compile: bool | None = opt(None, "torch.compile every transformer block in place (regional: one graph per block "
                                     "shape, fusing norms, RoPE, SwiGLU and residual adds; parameter names "
                                     "unchanged). Default: the profile's zerotrain.compile (on in the GPU profiles), "
                                     "else off", IDENTITY_WHEN_SET)
    attention: str | None = opt(None, "attention kernel: auto (varlen on CUDA in bf16/fp16, else sdpa), sdpa, flex "
                                      "or varlen (CUDA, bf16/fp16); default: the profile's zerotrain.attention, else "
                                      "auto. The same math whichever runs: not part of the run id", RUN,
                                choices=ATTENTION_BACKENDS)
    deterministic: bool | None = opt(None, "deterministic kernels: torch.use_deterministic_algorithms (flash and "
                                           "varlen attention take their deterministic backward) and a fixed cuBLAS "
                                           "workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8); slower on a GPU (no effect "
                                           "on a CPU, whose kernels are deterministic). A GPU resume is "
                                           "bit-identical only with it. Default: the profile's "
                                           "zerotrain.deterministic, else off", RUN)


@dataclass
class EvalConfig:
    """Evaluation: the validation loss, lm-evaluation-harness tasks, early stopping."""

    eval_every_steps: int = opt(0, "evaluate every N steps (0: never); needs --eval-tokens or --eval-data", RUN)
    eval_tokens: int | None = opt(None, "tokens per evaluation; without --eval-data they are held out of the "
                                        "training mix (deterministic from the seed)", IDENTITY_WHEN_SET)
    eval_data: str | None = opt(None, "a mix file to evaluate on instead of a held-out slice", RUN)
    early_stop_patience: int | None = opt(None, "stop after P evaluations without a new best", RUN)
    eval_tasks: str | None = opt(None, "lm-evaluation-harness tasks scored with the live model on every rank: task "
                                       "names, task YAML files or folders, comma-separated (needs pip install "
                                       "'zerotrain[eval]'); scored every --eval-tasks-every and at the end. Default: "
                                       "the profile's zerotrain.eval_tasks, else none", RUN)
    eval_tasks_every: str | None = opt(None, "with --eval-tasks: score every N steps, or every COUNT-tokens (e.g. "
                                             "50M-tokens, rounded up to whole steps). Default: the profile's "
                                             "zerotrain.eval_tasks_every, else --eval-every-steps, else only at the "
                                             "end", RUN)
    eval_limit: int | None = opt(None, "with --eval-tasks: the first N examples of each task (lm-eval's --limit). "
                                       "Default: the profile's zerotrain.eval_limit, else every example", RUN)
    best_by: str | None = opt(None, "with --eval-tasks: TASK/METRIC (e.g. zerotrain_tiny_choice/acc) chooses the "
                                    "--keep-best checkpoints and best.json instead of the validation loss (higher is "
                                    "better where lm-eval's task says so); `zerotrain export --best` follows it", RUN)


@dataclass
class BudgetConfig:
    """Budgets: the wall clock and the money a run may spend before it stops (after saving)."""

    max_hours: float | None = opt(None, "stop (after saving) at the last step that fits in H hours, over resumes", RUN)
    budget_usd: float | None = opt(None, "stop (after saving) before spending B dollars; needs --gpu-hour-usd", RUN)
    gpu_hour_usd: float | None = opt(None, "price of one GPU-hour; cost = price x world size x hours", RUN)


@dataclass
class ObserveConfig:
    """Watching the run: metrics sinks, W&B, the profiler, golden steps, spikes, hangs, the fit check."""

    log: str | None = opt(None, "metrics sinks besides metrics.jsonl, comma-separated: tensorboard "
                                "(RUN_DIR/tensorboard/), wandb (offline unless an API key is set)", RUN)
    wandb_project: str | None = opt(None, "with --log wandb: the W&B project (default: $WANDB_PROJECT, else "
                                          "zerotrain)", RUN)
    wandb_entity: str | None = opt(None, "with --log wandb: the W&B entity (default: $WANDB_ENTITY, else your "
                                         "default entity)", RUN)
    wandb_group: str | None = opt(None, "with --log wandb: the W&B group (default: $WANDB_RUN_GROUP)", RUN)
    wandb_name: str | None = opt(None, "with --log wandb: the W&B display name (default: $WANDB_NAME, else the run "
                                       "id; the W&B run id is $WANDB_RUN_ID, else the run id)", RUN)
    torch_profile: str | None = opt(None, "START:COUNT: torch.profiler over COUNT steps from step START; rank 0 "
                                          "writes RUN/torch_profile/summary.txt (the kernels that took the device's "
                                          "time, where the device waited for the host, the host syncs) and "
                                          "trace.json", RUN)
    golden: str | None = opt(None, "a golden.json from `zerotrain preflight --stage v3`: warn when tokens/s or peak "
                                   "memory at its golden steps is more than 10% off (another config is refused)", RUN)
    golden_strict: bool | None = opt(None, "with --golden: stop (checkpoint saved, exit 8) instead of warning", RUN)
    on_spike: str = opt("warn", "on a loss spike: warn, stop (exit 3) or rollback to the last good checkpoint", RUN,
                        choices=("warn", "stop", "rollback"))
    hang_timeout: float | None = opt(None, "seconds a rank may stay in one phase (data, compute, the step's "
                                           "collective, eval, save, ...) before its watchdog dumps every rank's "
                                           "stacks to RUN_DIR/hangs/ and exits 11 (hung); 0: off. Default: the "
                                           "profile's zerotrain.hang_timeout, else the larger of 600 s and 5x the "
                                           "slowest phase so far (start-up and the first step: at least 1800 s)", RUN)
    fit_check: bool | None = opt(None, "refuse, before building anything, a config the planner says cannot fit in "
                                       "this device's memory (default on; --no-fit-check to try anyway)", RUN)


@dataclass
class RunSetup:
    """The run itself: where it is written, its name, its seed, and whether it only plans."""

    out: str = opt("runs", "directory holding run directories", RUN)
    run_id: str | None = opt(None, "run directory name (default: derived from the config, so the same command "
                                   "resumes)", RUN)
    seed: int = opt(1337, "seed of the model init and the data order")
    dry_run: bool | None = opt(None, "resolve everything (profile, batch, model, data, plan) against the world size, "
                                     "print it and exit 0 without building or writing anything", RUN)
    description: str | None = opt(None, "free text; recipes use it to say what they are for", RUN)


@dataclass
class RunConfig:
    """A run's settings, one group per concern (the module docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    run: RunSetup = field(default_factory=RunSetup)
    # Not a setting: where each value came from, by flat name ("flag", "recipe", "given"; launcher/hparams.py
    # adds the resolved ones), for the start-up line and config.json's "run_sources".
    sources: dict | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_flat(cls, values: dict, sources: dict | None = None) -> RunConfig:
        """A config from flat names (flags, recipe keys, keywords, config.json's "run"); KeyError for an unknown one."""
        groups: dict[str, dict] = {}
        for name, value in values.items():
            leaf = LEAVES[name]
            groups.setdefault(leaf.group, {})[leaf.attr] = value
        return cls(**{g: GROUP_TYPES[g](**kw) for g, kw in groups.items()}, sources=sources)

    def to_dict(self) -> dict:
        """Every setting by flat name, in FLAG_ORDER (config.json's "run")."""
        return {name: value(self, name) for name in LEAVES}


@dataclass(frozen=True)
class Leaf:
    """One setting's place in the tree: its flat name, its group and its field there."""

    name: str
    group: str
    attr: str
    field: Field

    @property
    def path(self) -> str:
        return f"{self.group}.{self.attr}"

    @property
    def kind(self) -> str:
        return self.field.metadata["kind"]

    @property
    def help(self) -> str:
        return self.field.metadata["help"]

    @property
    def choices(self) -> tuple | None:
        return self.field.metadata["choices"]

    @property
    def default(self):
        return self.field.default

    @property
    def type(self) -> str:
        return str(self.field.type)


GROUP_TYPES = {g.name: g.default_factory for g in fields(RunConfig) if g.name != "sources"}
# The order of `--help`, config.json's "run" and the settings line, as every release before the tree wrote them.
FLAG_ORDER = (
    "profile", "model", "data", "tokenizer", "seq_len", "micro_batch", "grad_accum", "global_batch_tokens", "seed",
    "out", "run_id", "save_every_steps", "resume", "log_data_every_steps", "packing", "depth", "aspect_ratio",
    "head_dim", "scaling_rule", "heads", "rules_file", "init_from", "swap_tokenizer", "qk_norm", "rope_theta",
    "save_every_hours", "keep_last", "mirror", "eval_every_steps", "eval_tokens", "eval_data", "early_stop_patience",
    "max_hours", "budget_usd", "gpu_hour_usd", "on_spike", "piece_len", "log", "wandb_project", "wandb_entity",
    "wandb_group", "wandb_name", "optimizer", "optimizer_args", "fit_check", "dry_run", "description", "golden",
    "golden_strict", "verify_data", "torch_profile", "lr", "min_lr", "warmup_steps", "warmup_tokens", "max_steps",
    "total_tokens", "schedule", "decay_fraction", "max_epochs", "activation_checkpointing", "attention",
    "deterministic", "sequence_parallel", "tiled_mlp", "compile", "offload", "nvme_path", "keep_best", "eval_tasks",
    "eval_tasks_every", "eval_limit", "best_by", "hang_timeout",
)


def _leaves() -> dict[str, Leaf]:
    found = {}
    for group, cls in GROUP_TYPES.items():
        for f in fields(cls):
            name = f.metadata["flat"] or f.name
            if name in found:
                raise TypeError(f"RunConfig: two fields have the flat name {name!r}")
            found[name] = Leaf(name, group, f.name, f)
    if set(found) != set(FLAG_ORDER):
        raise TypeError(f"RunConfig: FLAG_ORDER does not list {sorted(set(found) ^ set(FLAG_ORDER))}")
    return {name: found[name] for name in FLAG_ORDER}


LEAVES: dict[str, Leaf] = _leaves()  # flat name -> its place in the tree
BY_PATH: dict[str, Leaf] = {leaf.path: leaf for leaf in LEAVES.values()}  # "schedule.lr" -> its leaf
SETTINGS = tuple(LEAVES)  # every setting's flat name (a flag and a recipe key)


def value(cfg: RunConfig, name: str):
    """The value of the setting with this flat name (for the flat edges: flags, recipes, config.json, the hash)."""
    leaf = LEAVES[name]
    return getattr(getattr(cfg, leaf.group), leaf.attr)


def set_value(cfg: RunConfig, name: str, v) -> None:
    leaf = LEAVES[name]
    setattr(getattr(cfg, leaf.group), leaf.attr, v)


def with_values(cfg: RunConfig, values: dict, **top) -> RunConfig:
    """A copy with the settings named (flat names) replaced, and `top` (sources) too; cfg is left as it is."""
    groups = {g: getattr(cfg, g) for g in GROUP_TYPES}
    changes: dict[str, dict] = {}
    for name, v in values.items():
        leaf = LEAVES[name]
        changes.setdefault(leaf.group, {})[leaf.attr] = v
    return replace(cfg, **{g: replace(groups[g], **kw) for g, kw in changes.items()}, **top)


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


def _arg_type(leaf: Leaf):
    if leaf.name in TOKEN_COUNTS:
        return token_count
    t = leaf.type
    return int if "int" in t else float if "float" in t else str


def add_train_flags(p) -> None:
    """The driver's flags, one per leaf of RunConfig (help, choices and defaults from each field), plus
    --config, onto a parser or an argument group (`zerotrain plan` lists them after its own)."""
    p.add_argument("--config", help="recipe JSON with the same keys as the flags; flags override it")
    for leaf in LEAVES.values():
        help_text = leaf.help.replace("%", "%%")
        if leaf.name in TOKEN_COUNTS:
            help_text += f"; written {TOKEN_COUNT_FORMS} (exact integers)"
        if leaf.default is not None and "default" not in help_text:
            help_text += f" (default: {leaf.default})"  # argparse's own default stays None: unset, so a recipe applies
        help_text += {IDENTITY: "", IDENTITY_WHEN_SET: "", RUN: " [may change on resume]"}[leaf.kind]
        choices = leaf.choices
        if "bool" in leaf.type:
            p.add_argument(flag(leaf.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:  # choices are checked by validation, with the same message for a flag and a recipe key
            p.add_argument(flag(leaf.name), type=_arg_type(leaf), default=None, dest=leaf.name, help=help_text,
                           metavar="{" + ",".join(choices) + "}" if choices else None)
    # Injected by the deepspeed launcher (and older torch launchers); the env var is what we use.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


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


ALTERNATIVES = (("warmup_steps", "warmup_tokens"),)  # one of each pair; a flag replaces the recipe's other one


def over_recipe(recipe: dict, flags: dict) -> dict:
    """The recipe's values the flags leave standing: all but those a flag overrides, or whose alternative a flag
    gives (`--warmup-tokens` on a recipe with warmup_steps)."""
    dropped = {b if a in flags else a for a, b in ALTERNATIVES if (a in flags) != (b in flags)}
    return {k: v for k, v in recipe.items() if k not in flags and k not in dropped}


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
