"""Every setting once: the declared table, and its resolution into values that each name their source.

A setting is a knob a run is given: by flag (and the same key in a recipe), by the profile, or by a rule.
`TABLE` declares each one that is more than a plain flag: its name, its RunConfig field by dotted path if it is a
flag ("schedule.lr"), its profile key, its default or the rule that derives it (which may read settings resolved
before it), its check, and its kind (launcher/config.py: "identity" and "identity-when-set" are hashed into the run
id and may not change on resume; "run" may). The plain flags (a RunConfig field with nothing but a default) are
entries too, derived from RunConfig by `table()`: every flag and every profile key has exactly one entry
(tests/test_settings.py).

    resolve(cfg, profile_name, profile, node) -> Settings
        once per run, in run_plan.identify(): each value and where it came from, one of
        "flag", "recipe", "given" (the Python API), "profile NAME: KEY", "rule: ...", "default", "init-from"
        (the tokenizer of the --init-from directory).
        config.json's "run_sources" holds them all; the start-up lines and --dry-run print them.
    section(profile)          the raw "zerotrain" section: this module is the only reader of it
    check_section(zt, where)  the profile's section against the table (load_profile calls it)

The first that says wins: the flag (or the recipe) | the profile's key | the rule | the default. The
schedule's values (lr, min_lr, warmup_steps, max_steps, schedule, decay_fraction) are resolved before, as a
group, by launcher/hparams.py, whose sources are kept (a rule's prefixed "rule: ").

To add a setting, add ONE `Setting` to TABLE:
    Setting("offload", field="parallel.offload", kind=RUN, choices=OFFLOAD_CHOICES,
            profile_key="zerotrain.offload", check=one_of(OFFLOAD_CHOICES))
- `field="GROUP.NAME"` names the typed RunConfig field it sets (launcher/config.py: written there, with its --help
  text, type, default and kind; so a --flag, a recipe key, a notebook keyword and a line of `zerotrain train
  --help`: regenerate docs/cli.md with `python docs/generate_cli.py`); `type`, `kind`, `field_default` and
  `choices` repeat the field's (tests/test_settings.py checks both ways); its value in the config stays None when
  not given, so the run ids of earlier runs do not change;
- `profile_key`: "zerotrain.KEY" is read from the profile's own section and checked when the profile loads;
- `default`: the value when nothing says; `rule(values, node) -> (value, why) | None` derives it from the
  settings above it (`values`) and the machine (`node`, launcher/node.py; None before it is probed);
- the run reads `plan.settings.NAME`; nothing else reads the profile's section.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Callable

from zerotrain.cli_args import exact_integer
from zerotrain.launcher.config import LEAVES, OFFLOAD_CHOICES, value
from zerotrain.launcher.errors import UsageError
from zerotrain.modeling.sizes import ATTENTION_BACKENDS

IDENTITY, IDENTITY_WHEN_SET, RUN = "identity", "identity-when-set", "run"
GIVEN = ("flag", "recipe", "given")  # the sources of a value the run was handed
INIT_FROM = "init-from"  # taken from the --init-from directory (the tokenizer: launcher/model_spec.py)
SOURCE_WORDS = (*GIVEN, "default", "profile ", "rule: ", INIT_FROM)  # every source starts with one of these

COMM_TIMEOUT_S = 1800.0  # torch's own default for gloo; DeepSpeed's init_distributed would give 10 minutes
HEALTH_DEFAULTS = {"window_s": 60.0, "windows": 3, "straggler_ratio": 1.2, "repeat_s": 1800.0}
DEFAULT_MFU_THRESHOLD = 0.30  # 0.75 x a typical dense bf16 MFU of 0.4, when the profile says nothing


# -- checks: a value -> None, or what is wrong with it ---------------------------------------------------------

def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def positive_int(v):
    return None if not isinstance(v, bool) and isinstance(v, int) and v > 0 else "must be a positive integer"


def nonneg_int(v):
    return None if not isinstance(v, bool) and isinstance(v, int) and v >= 0 else "must be a non-negative integer"


def nonneg_number(v):
    return None if _number(v) and v >= 0 else "must be a non-negative number"


def positive_number(v):
    return None if _number(v) and v > 0 else "must be a positive number"


# torch.distributed's and DeepSpeed's accelerators' backends (deepspeed.comm's init_distributed takes these names)
DIST_BACKENDS = ("nccl", "gloo", "mpi", "ccl", "hccl", "xccl")


def fraction(v):
    return None if _number(v) and 0 < v <= 1 else "must be a number in (0, 1]"


def boolean(v):
    return None if isinstance(v, bool) else "must be true or false"


def one_of(choices: tuple) -> Callable:
    def check(v):
        return None if v in choices else (f"must be {choices[0]} or {choices[1]}" if len(choices) == 2 else
                                          f"must be one of {', '.join(choices)}")
    return check


def seconds(v):
    return None if _number(v) and v >= 0 else "must be a non-negative number of seconds"


def positive_seconds(v):
    return None if _number(v) and v > 0 else "must be a positive number of seconds"


def obj(v):
    return None if isinstance(v, dict) else "must be an object"


def text(v):
    return None if isinstance(v, str) else "must be a string"


def directory_path(v):
    return None if isinstance(v, str) and v else "must be a directory path"


def task_list(v):
    ok = (isinstance(v, str) and v.strip()) or (isinstance(v, list) and v and all(isinstance(x, str) and x for x in v))
    return None if ok else "must be task names, task YAML files or folders (comma-separated, or a list)"


def cadence(v):
    """--eval-tasks-every: N steps, or a count of tokens (50M-tokens)."""
    try:
        parse_every(v)
    except ValueError as e:
        return f"must be N (steps) or COUNT-tokens (e.g. 50M-tokens): {e}"
    return None


_TOKENS = re.compile(r"^(.+?)\s*-?\s*tokens?$", re.IGNORECASE)


def parse_every(value) -> tuple[int, str]:
    """A cadence: N (steps) or COUNT tokens (50M-tokens, "4096 tokens") -> (count, "steps" | "tokens");
    ValueError saying why not."""
    if isinstance(value, bool):
        raise ValueError("not a number")
    if isinstance(value, int):
        n, unit = value, "steps"
    else:
        m = _TOKENS.match(str(value).strip())
        n, unit = (exact_integer(m.group(1), suffixes=True), "tokens") if m else (exact_integer(value), "steps")
    if n <= 0:
        raise ValueError("must be positive")
    return n, unit


def health_check(v):
    """(A problem starting with "." names a key inside the object.)"""
    if not isinstance(v, dict) or set(v) - set(HEALTH_DEFAULTS):
        return f"must be an object with keys among {', '.join(sorted(HEALTH_DEFAULTS))}"
    for key, x in v.items():
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 or (key == "windows" and x != int(x)) \
                or (key == "straggler_ratio" and x <= 1):
            return (f".{key} must be a positive number" + (" (a whole count)" if key == "windows" else
                    " above 1" if key == "straggler_ratio" else ""))
    return None


def env_check(v):
    """zerotrain.env: {"set": {NAME: text or number}, "pass": [NAME, ...]} (components/launching/hostfile.py reads
    it for a launch; checked here too, so a dry run and `zerotrain train` refuse what a launch would)."""
    if not isinstance(v, dict) or set(v) - {"set", "pass"}:
        return "must be an object with 'set' and/or 'pass'"
    values, names = v.get("set", {}), v.get("pass", [])
    if not isinstance(values, dict) or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool)
                                               for x in values.values()):
        return ".set must map names to strings or numbers"
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ".pass must be a list of variable names"
    return None


def hardware_check(v):
    if not isinstance(v, dict):
        return "must be an object"
    mem = v.get("device_memory_gib")
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem <= 0):
        return ".device_memory_gib must be a positive number"
    for key, what in (("host_memory_gib", "a node's RAM, GiB"), ("host_link_gb_s", "each GPU's link to the host, GB/s"),
                      ("interconnect_gb_s", "GPU to GPU within a node, GB/s per direction"),
                      ("internode_gb_s", "per GPU between nodes, GB/s per direction")):
        x = v.get(key)
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0):
            return f".{key} ({what}) must be a positive number"
    ctx = v.get("context_gib")
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, (int, float)) or not 0 < ctx < 64):
        return ".context_gib (the CUDA context, cuBLAS and NCCL buffers per GPU process) must be in (0, 64) GiB"
    return None


# -- rules: (values resolved so far, node) -> (value, why) or None (nothing said: the default) -------------------

def hang_timeout_rule(values: dict, node) -> tuple[None, str]:
    """None: the watchdog decides per phase as the run goes (components/observe/watchdog.py timeout_for)."""
    return None, "the larger of 600 s and 5x the slowest phase so far (start-up: at least 1800 s)"


def comm_timeout_rule(values: dict, node) -> tuple[float, str]:
    """Longer than the hang watchdog's on purpose: on gloo, where a blocked collective only raises "timed
    out" once this expires, the watchdog fires first and says where every rank was (components/watchdog.py);
    this is the backstop when the watchdog is off. NCCL: docs/hangs.md."""
    return max(COMM_TIMEOUT_S, 2.0 * (values.get("hang_timeout") or 0.0)), "max(1800 s, 2 x hang_timeout)"


def mfu_threshold_rule(values: dict, node):
    if values.get("expected_mfu") is not None:
        return 0.75 * float(values["expected_mfu"]), "0.75 x expected_mfu"
    return None


# -- the table -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    name: str
    help: str = ""  # for a profile-only key, what it is for (a flag's --help is its RunConfig field's)
    field: str | None = None  # a --flag and recipe key: its RunConfig field by dotted path ("schedule.lr")
    type: str = "str | None"  # the RunConfig field's annotation (tests/test_settings.py checks they agree)
    kind: str = RUN  # identity, identity-when-set (hashed once set), run (may change on resume)
    profile_key: str | None = None  # "zerotrain.KEY" (the profile's own section), or a DeepSpeed path
    default: object = None  # the value when nothing says
    field_default: object = None  # a flag's RunConfig default (None: unset, so that a recipe applies)
    rule: Callable | None = None  # (values, node) -> (value, why) or None
    check: Callable | None = None  # value -> None or what is wrong ("must be ...")
    choices: tuple | None = None
    group: str | None = None  # "hparams": resolved by launcher/hparams.py as one group
    note: bool = False  # documentation in the profile (a free text), not a setting the run reads

    @property
    def flag(self) -> bool:
        """A --flag, a recipe key and a notebook keyword: a RunConfig field (launcher/config.py)."""
        return self.field is not None

    @property
    def identity(self) -> bool:
        return self.kind != RUN

    @property
    def resumable(self) -> bool:
        """May change on resume (a "run" setting); identity settings changed on resume are drift."""
        return self.kind == RUN

    @property
    def zt_key(self) -> str | None:
        """The key in the profile's zerotrain section, or None."""
        if self.profile_key and self.profile_key.startswith("zerotrain."):
            return self.profile_key[len("zerotrain."):]
        return None


TABLE: tuple[Setting, ...] = (
    # the schedule (launcher/hparams.py resolves these as a group: flag > recipe > rule/profile > default)
    Setting("lr", field="schedule.lr", type="float | None", kind=IDENTITY, profile_key="optimizer.params.lr",
            check=nonneg_number, group="hparams"),
    Setting("min_lr", field="schedule.min_lr", type="float | None", kind=IDENTITY,
            profile_key="scheduler.params.cos_min_ratio", check=nonneg_number, group="hparams"),
    Setting("warmup_steps", field="schedule.warmup_steps",
            type="int | None", kind=IDENTITY, profile_key="scheduler.params.warmup_num_steps", default=20,
            check=nonneg_int, group="hparams"),
    Setting("warmup_tokens", field="schedule.warmup_tokens", type="int | None", kind=IDENTITY_WHEN_SET,
            check=positive_int, group="hparams"),
    Setting("max_steps", field="schedule.max_steps",
            type="int", kind=RUN, profile_key="scheduler.params.total_num_steps", default=100, field_default=100,
            check=positive_int, group="hparams"),
    Setting("total_tokens", field="schedule.total_tokens", type="int | None",
            kind=RUN, check=positive_int, group="hparams"),
    Setting("schedule", field="schedule.shape", kind=IDENTITY_WHEN_SET, choices=("cosine", "wsd"), default="cosine",
            check=one_of(("cosine", "wsd")), group="hparams"),
    Setting("decay_fraction", field="schedule.decay_fraction", type="float | None", kind=IDENTITY_WHEN_SET,
            default=0.2, check=nonneg_number, group="hparams"),
    # the data read over the run (launcher/hparams.py check_repeats)
    Setting("max_epochs", field="data.max_epochs", type="float | None",
            kind=RUN, profile_key="zerotrain.max_epochs", check=positive_number),
    # the model's execution
    Setting("activation_checkpointing", field="parallel.activation_checkpointing",
            type="bool | None", kind=IDENTITY, profile_key="zerotrain.activation_checkpointing", default=False,
            check=boolean),
    Setting("attention", field="parallel.attention", kind=RUN, choices=ATTENTION_BACKENDS,
            profile_key="zerotrain.attention", default="auto", check=one_of(ATTENTION_BACKENDS)),
    Setting("deterministic", field="parallel.deterministic", type="bool | None", kind=RUN,
            profile_key="zerotrain.deterministic", default=False, check=boolean),
    Setting("sequence_parallel", field="parallel.sequence_parallel", type="int | None",
            kind=RUN, profile_key="zerotrain.sequence_parallel", default=1, check=positive_int),
    Setting("tiled_mlp", field="parallel.tiled_mlp",
            type="bool | None", kind=IDENTITY_WHEN_SET, profile_key="zerotrain.tiled_mlp", default=False,
            check=boolean),
    Setting("compile", field="parallel.compile",
            type="bool | None", kind=IDENTITY_WHEN_SET, profile_key="zerotrain.compile", default=False,
            check=boolean),
    Setting("compile_backend", "torch.compile's backend (default: the accelerator's)",
            profile_key="zerotrain.compile_backend", check=text),
    # where ZeRO's state lives (launcher/offload/: keys.py apply_offload, ops.py)
    Setting("offload", field="parallel.offload", kind=RUN,
            choices=OFFLOAD_CHOICES, profile_key="zerotrain.offload", check=one_of(OFFLOAD_CHOICES)),
    Setting("nvme_path", field="parallel.nvme_path", kind=RUN,
            profile_key="zerotrain.nvme_path", check=directory_path),
    # checkpoints kept (components/checkpoints/checkpointer.py)
    Setting("keep_best", field="checkpoints.keep_best", type="int", kind=RUN, default=1,
            field_default=1, check=positive_int),
    # lm-evaluation-harness tasks scored in the loop (components/tasks/, docs/evaluation.md)
    Setting("eval_tasks", field="eval.eval_tasks", kind=RUN, profile_key="zerotrain.eval_tasks", check=task_list),
    Setting("eval_tasks_every", field="eval.eval_tasks_every", kind=RUN,
            profile_key="zerotrain.eval_tasks_every", check=cadence),
    Setting("eval_limit", field="eval.eval_limit", type="int | None",
            kind=RUN, profile_key="zerotrain.eval_limit", check=positive_int),
    Setting("best_by", field="eval.best_by", kind=RUN, check=text),
    # hangs and the process group
    Setting("hang_timeout", field="observe.hang_timeout", type="float | None", kind=RUN,
            profile_key="zerotrain.hang_timeout", rule=hang_timeout_rule, check=seconds),
    Setting("comm_timeout_s", "seconds one collective may wait before the backend fails it",
            profile_key="zerotrain.comm_timeout_s", rule=comm_timeout_rule, check=positive_seconds),
    Setting("dist_backend", "the process group's backend (default: the accelerator's: nccl on CUDA, gloo on CPU)",
            profile_key="zerotrain.dist_backend", check=one_of(DIST_BACKENDS)),
    # speed: the planner's assumption, pre-flight's threshold, the health check
    Setting("peak_flops_per_device", "peak FLOP/s of one device, for MFU",
            profile_key="zerotrain.peak_flops_per_device", check=positive_number),
    Setting("expected_mfu", "the MFU the planner assumes", profile_key="zerotrain.expected_mfu", check=fraction),
    Setting("mfu_threshold", "the MFU below which pre-flight v3 fails and the health check warns",
            profile_key="zerotrain.mfu_threshold", rule=mfu_threshold_rule, default=DEFAULT_MFU_THRESHOLD,
            check=fraction),
    Setting("health", "the health check's windows (components/observe/health.py)", profile_key="zerotrain.health",
            default=HEALTH_DEFAULTS, check=health_check),
    # the data loader, the hardware, the launch's environment
    Setting("dataloader", "workers, prefetch_factor, pin_memory, persistent_workers (dataio/pipeline/loader.py)",
            profile_key="zerotrain.dataloader"),
    Setting("hardware", "what the profile was written for: accelerator, devices_per_node, nodes, memory, names",
            profile_key="zerotrain.hardware", default={}, check=hardware_check),
    Setting("env", "environment variables a launch sets and passes (components/hostfile.py)",
            profile_key="zerotrain.env", default={}, check=env_check),
    # free text in a profile, read by people
    Setting("profile_description", profile_key="zerotrain.description", note=True, check=text),
    Setting("peak_flops_note", profile_key="zerotrain.peak_flops_note", note=True, check=text),
    Setting("mfu_note", profile_key="zerotrain.mfu_note", note=True, check=text),
)
BY_NAME = {s.name: s for s in TABLE}
FLAGS = tuple(s for s in TABLE if s.flag)  # the declared settings that are RunConfig fields
BY_ZT_KEY = {s.zt_key: s for s in TABLE if s.zt_key}


def table() -> tuple[Setting, ...]:
    """Every setting: the declared ones, then each other RunConfig field (a plain flag) as its own entry."""
    plain = tuple(Setting(leaf.name, leaf.help, field=leaf.path, type=leaf.type, kind=leaf.kind,
                          field_default=leaf.default, default=leaf.default, choices=leaf.choices)
                  for leaf in LEAVES.values() if leaf.name not in BY_NAME)
    return TABLE + plain


# -- the profile's own section: read here only ----------------------------------------------------------------

def section(profile: dict) -> dict:
    """The profile's "zerotrain" section ({} when it has none)."""
    return profile.get("zerotrain", {})


def profile_value(profile: dict, name: str, default=None):
    """The raw value the profile gives a setting's key (None: not given). For callers that hold a profile
    but no resolved run: the launcher (hardware, env), auto-detection (hardware)."""
    key = BY_NAME[name].zt_key
    return section(profile).get(key, default)


def check_section(zt, where: str) -> None:
    """UsageError (one line) for a value of the profile's section a setting's check refuses."""
    if not isinstance(zt, dict):
        raise UsageError(f"{where}: the zerotrain section must be an object")
    for key, v in zt.items():
        s = BY_ZT_KEY.get(key)
        if s is None:  # a misspelt key would otherwise be ignored, and the run would use the default silently
            close = difflib.get_close_matches(key, BY_ZT_KEY, n=1)
            hint = f"did you mean zerotrain.{close[0]}?" if close else "the keys: " + ", ".join(sorted(BY_ZT_KEY))
            raise UsageError(f"{where}: zerotrain.{key} is not a setting ({hint})")
        if s.check is None or v is None:
            continue
        problem = s.check(v)
        if problem:
            if problem.startswith("."):  # a key inside the object: its value shown, not the whole object's
                v = v.get(problem[1:].split(" ", 1)[0], v) if isinstance(v, dict) else v
            raise UsageError(f"{where}: zerotrain.{key}{'' if problem.startswith('.') else ' '}{problem}, got {v!r}")


def check_flags(cfg, flag: Callable[[str], str]) -> None:
    """UsageError (one line) for a declared flag's value its check refuses (None: not given)."""
    for s in FLAGS:
        v = value(cfg, s.name)
        if v is None or s.check is None:
            continue
        problem = s.check(v)
        if problem:
            extra = " (0: off)" if s.name == "hang_timeout" else ""
            raise UsageError(f"{flag(s.name)}: {problem}{extra}, got {v!r}")


# -- resolution ------------------------------------------------------------------------------------------------

class Settings:
    """The resolved settings: `settings.NAME` is the value, `settings.sources[NAME]` where it came from."""

    def __init__(self, values: dict, sources: dict):
        object.__setattr__(self, "values", dict(values))
        object.__setattr__(self, "sources", dict(sources))

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Settings are resolved once: frozen")

    def replace(self, name: str, value, source: str) -> "Settings":
        """A copy with one value decided later (the attention kernel, once the machine is known)."""
        return Settings({**self.values, name: value}, {**self.sources, name: source})

    def given_words(self, name: str) -> str:
        """How a value was chosen, for a start-up line: '--attention sdpa', 'profile cpu: zerotrain.attention
        flex', or a rule's own words."""
        source, value = self.sources[name], self.values[name]
        if source in GIVEN:
            return f"--{name.replace('_', '-')} {value}"
        if source.startswith("rule: "):
            return source[len("rule: "):]
        return f"{source} {value}"


def hparams_source(source: str) -> str:
    """launcher/hparams.py's words for a source, in the table's: a derived value is a "rule: "."""
    if source in (*GIVEN, "default", INIT_FROM) or source.startswith("profile ") or source.startswith("rule"):
        return source if not source.startswith("rule ") else "rule: " + source
    return "rule: " + source


def given(cfg, s: Setting) -> str | None:
    """Where a flag's value came from ("flag", "recipe", "given"), or None when it was not given. Without
    recorded sources (a RunConfig built directly) a value differing from the field's default counts as given."""
    if cfg.sources is not None:
        return cfg.sources[s.name] if cfg.sources.get(s.name) in GIVEN else None
    v = value(cfg, s.name)
    return "given" if v is not None and v != s.field_default else None


def resolve(cfg, profile_name: str, profile: dict, node=None) -> Settings:
    """Every setting's value and source, in table order (see the module docstring). `cfg` has its schedule
    resolved (launcher/hparams.py) and its given values' sources in `cfg.sources`; None: the profile's
    settings alone (nothing given by flag: `zerotrain plan`, a benchmark)."""
    given_sources = (cfg.sources or {}) if cfg is not None else {}
    zt = section(profile)
    values, sources = {}, {}
    for s in (table() if cfg is not None else TABLE):
        if s.note:
            continue
        v = value(cfg, s.name) if s.flag and cfg is not None else None
        if s.group == "hparams" and cfg is None:
            continue
        if s.group == "hparams":
            values[s.name], sources[s.name] = schedule_entry(s, v, given_sources)
        elif s.flag and cfg is not None and v is not None and (v != s.field_default or s.name in given_sources):
            # given, or resolved before into the config (launcher/hparams.py), each with its source
            values[s.name], sources[s.name] = v, hparams_source(given_sources.get(s.name, "given"))
        elif s.zt_key and zt.get(s.zt_key) is not None:
            v = zt[s.zt_key]
            values[s.name], sources[s.name] = ({**s.default, **v} if isinstance(s.default, dict) else v,
                                               f"profile {profile_name}: {s.profile_key}")
        elif s.rule is not None and (ruled := s.rule(values, node)) is not None:
            values[s.name], sources[s.name] = ruled[0], f"rule: {ruled[1]}"
        else:
            values[s.name], sources[s.name] = (dict(s.default) if isinstance(s.default, dict) else s.default,
                                               "default")
    return Settings(values, sources)


def schedule_entry(s: Setting, value, given_sources: dict) -> tuple[object, str]:
    """(value, source) of a schedule setting (launcher/hparams.py's group) as the config holds it."""
    return (value if not (s.name == "schedule" and value is None) else "cosine",
            hparams_source(given_sources.get(s.name, "default")))


def with_schedule(settings: Settings, cfg) -> Settings:
    """The settings with the schedule's entries `cfg`'s: once the schedule is sized in tokens at the run's world or
    kept by a resume (launcher/hparams.py size_in_tokens), after everything else was resolved once."""
    values, sources = dict(settings.values), dict(settings.sources)
    for s in table():
        if s.group == "hparams":
            values[s.name], sources[s.name] = schedule_entry(s, value(cfg, s.name) if s.flag else None,
                                                             cfg.sources or {})
    return Settings(values, sources)


def describe_settings(settings: Settings) -> str:
    """The start-up (and --dry-run) line of the declared settings a profile or a rule decided (the schedule
    and the attention kernel have lines of their own; objects are left to `config.json`'s run_sources)."""
    parts = [f"{s.name.replace('_', '-')} {settings.values[s.name]:g} ({settings.sources[s.name]})"
             if isinstance(settings.values[s.name], float) else
             f"{s.name.replace('_', '-')} {settings.values[s.name]} ({settings.sources[s.name]})"
             for s in TABLE if not s.note and s.group is None and s.name != "attention"
             and settings.sources[s.name] != "default" and not isinstance(settings.values[s.name], dict)]
    return "settings: " + (", ".join(parts) or "the defaults")


def comm_timeout_s(zt: dict, hang_timeout: float | None = None) -> float:
    """The process group's timeout from a profile section and a hang timeout, as `resolve` decides it."""
    given = zt.get("comm_timeout_s")
    return float(given) if given else comm_timeout_rule({"hang_timeout": hang_timeout}, None)[0]


def compile_at_stage(settings: Settings, ds_config: dict) -> Settings:
    """A profile's zerotrain.compile does not compile at ZeRO-3: DeepSpeed's parameter hooks around every
    submodule break each block's graph between its linears (so little fuses) and recompile once per module past
    dynamo's limit (counted on the CPU: 16 graphs for the 4-layer debug model). --compile given still compiles
    (the same math: tests/test_gpu_speed.py)."""
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if settings.compile and stage == 3 and settings.sources["compile"] not in GIVEN:
        return settings.replace("compile", False, "rule: not at ZeRO-3 (its parameter hooks break every block's"
                                                  " graph); --compile compiles anyway")
    return settings
