"""The optimizer registry: `--optimizer NAME [--optimizer-args JSON]`, one table and three calls.

    name               where the update rule comes from
    adamw (default)    DeepSpeed's AdamW from the profile's "optimizer" section, exactly as before
    muon               DeepSpeed's native Muon (MuonWithAuxAdam): 2-D weights get Muon at --lr,
                       embeddings, head and norms get AdamW at `adam_lr`
    lion               DeepSpeed's Lion kernels (FusedLion on CUDA; DeepSpeedCPULion on a CPU
                       accelerator, JIT-built once) as a client optimizer, with sign(0) = 0 put back
                       (both kernels move never-updated elements by a full step; client_optimizers.py)
    adamw-decaying-wd  launcher/client_optimizers.py (plain PyTorch)
    ademamix           launcher/client_optimizers.py (plain PyTorch)
    module.path:Class  a user's torch.optim.Optimizer subclass, arguments from --optimizer-args

Where it is used, in order:
- `check_optimizer(name, args)` from config_resolve.validate(): names, imports, argument names and
  values, as one-line UsageErrors before anything is written. Normalises `args` to a dict and
  `adamw` without arguments to None, so spelling the default out keeps the default's run id.
- `resolve_ds_optimizer(ds, cfg, where)` from zerotrain.launcher.profiles.resolve_ds_config (plan time):
  writes the exact "optimizer" section (or removes it for a client optimizer and sets
  `zero_allow_untested_optimizer`), and refuses a ZeRO stage the optimizer does not support.
- `prepare_optimizer(cfg, ds_config, model)` in components/engine.build_engine, then after
  `deepspeed.initialize`, `check_engine(cfg, engine, model, ds_compat.muon_optimizer_class)`: the built engine really uses the rule.

Every entry was checked under each ZeRO stage it lists, with 2 ranks (tests/test_optimizers.py,
tests/helpers/optim_harness.py): the loss falls, and 3 steps from a fixed state move every parameter
as a plain-PyTorch reference implementation of the rule does.

DeepSpeed's Muon and its known failures (both absent from the 0.19.8 we verified, refused below it):
under `zero.Init` every ZeRO-3 parameter looks 1-D, so no matrix was tagged for Muon and all of them
silently trained with AdamW (DeepSpeed PR #8438; 0.19.8 tags by `ds_shape`); at stage 0 the Muon
half applied a plain SGD step (PR #8442). `check_engine` re-derives the tagging from the real
shapes after every build, so a DeepSpeed that regresses stops the run with one line instead.

client_optimizers (torch at its top) and DeepSpeed are imported only by the functions that build an
optimizer: the config layer, and `zerotrain plan` / `params` through it, never load torch.
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass
from importlib.metadata import version
from typing import Callable

from packaging.version import Version

from zerotrain import ds_attributes
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.node import Node

DEFAULT = "adamw"
MUON_MIN_DEEPSPEED = "0.19.8"  # the release verified here; see the module docstring for what was wrong before
ALL_STAGES = (0, 1, 2, 3)


# ------------------------------------------------------------------------------------------------
# Hyper-parameter checks: each returns the value (normalised) or raises ValueError(what is expected)
# ------------------------------------------------------------------------------------------------

def _number(v, lo=0.0, lo_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (lo_open and v == lo):
        raise ValueError(f"a number {'>' if lo_open else '>='} {lo:g}")
    return float(v)


def nonneg(v):
    return _number(v)


def positive(v):
    return _number(v, lo_open=True)


def fraction(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ValueError("a number in [0, 1)")
    return float(v)


def steps_or_null(v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError("a positive integer or null")
    return v


def betas(n: int):
    def check(v):
        if not isinstance(v, (list, tuple)) or len(v) != n or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1 for b in v):
            raise ValueError(f"a list of {n} numbers in [0, 1)")
        return [float(b) for b in v]
    return check


def choice(*options):
    def check(v):
        if v not in options:
            raise ValueError(" or ".join(repr(o) for o in options))
        return v
    return check


def boolean(v):
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    name: str
    origin: str  # where the rule comes from (docs/optimizers.md table)
    hparams: dict  # name -> (default, check); None defaults are derived (see `notes`)
    state_bytes: str  # optimizer state per parameter, fp32 (docs/optimizers.md table; measured by the harness)
    configure: Callable  # (ds, hparams, cfg) -> ds: the exact DeepSpeed dict for this optimizer
    client: Callable | None = None  # (params, hparams, cfg) -> torch optimizer, when configure drops "optimizer"
    lr: float | None = None  # default peak lr when neither --lr nor a law gives one (None: launcher/hparams.py)
    stages: tuple = ALL_STAGES
    notes: str = ""
    open_args: bool = False  # a user class taking **kwargs: any argument name is passed on
    # fp32 bytes of optimizer state per parameter, (on 2-D block matrices, on the rest): the planner's figure
    # (launcher/planning); None: not known, and the planner refuses to guess (`state_bytes_per_param`)
    state_per_param: tuple[float, float] | None = None

    def defaults(self) -> dict:
        return {k: d for k, (d, _) in self.hparams.items()}


ADAMW_FALLBACK = {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}  # the shipped profiles' values


def _adamw_configure(ds, hp, cfg):
    section = ds.get("optimizer") or {}
    if str(section.get("type", "")).lower() != "adamw":  # a profile naming another type: --optimizer adamw means AdamW
        section = {"type": "AdamW", "params": dict(ADAMW_FALLBACK)}
    given = {k: v for k, v in hp.items() if v is not None}  # None: the profile's value
    params = {**section.get("params", {}), **given, "lr": cfg.schedule.lr}
    if params.get("torch_adam") is False:  # DeepSpeed's FusedAdam / CPU Adam take no `fused` (TypeError)
        params.pop("fused", None)
    ds = {**ds, "optimizer": {**section, "params": params}}
    return ds if "torch_adam" in given else _cpu_adam_when_offloaded(ds)


NO_BUILD_ADAMW = {"torch_adam": True, "fused": True}  # the shipped profiles' AdamW: torch.optim.AdamW(fused=True)


def offloads_optimizer(ds: dict) -> bool:
    device = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return device in ("cpu", "nvme")


def _cpu_adam_when_offloaded(ds: dict) -> dict:
    """A profile's AdamW says torch_adam (every shipped one does: nothing to compile); with the optimizer
    offloaded to the host, DeepSpeed's own CPU Adam is the one ZeRO-Offload is built around (AVX kernels over
    the fp32 partitions in host memory), but DeepSpeed 0.19's get_optimizer_configuration tests torch_adam
    first and would run torch's AdamW there instead. So torch_adam and fused are dropped under offload (unless
    --optimizer-args gives torch_adam), and DeepSpeed builds DeepSpeedCPUAdam (a C++ op: `implementation`)."""
    section = ds.get("optimizer") or {}
    if not offloads_optimizer(ds) or str(section.get("type", "")).lower() not in ("adam", "adamw"):
        return ds
    params = {k: v for k, v in section.get("params", {}).items() if k not in NO_BUILD_ADAMW}
    return {**ds, "optimizer": {**section, "params": params}}


def _muon_configure(ds, hp, cfg):
    params = {"lr": cfg.schedule.lr, "muon_lr": cfg.schedule.lr, **hp,
              # The AdamW half as torch.optim.AdamW: what ran in the verification (no FusedAdam JIT
              # build, no silent fallback to Muon's inline Adam where FusedAdam is unavailable).
              "torch_adam": True}
    zero = dict(ds.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    if stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed 0.19 refuses Muon with ZeRO-3's reduce-scatter
    ds = {**ds, "optimizer": {"type": "Muon", "params": params}, "zero_optimization": zero}
    if stage >= 1 and ds.get("gradient_clipping"):
        # ZeRO-1/2/3 orthogonalize before the global norm is taken, so DeepSpeed 0.19 clips the
        # Muon *update* (norm ~ sqrt(sum of min(rows, cols)), a property of the model's shape), which
        # divides every Muon step by that norm: lr 0.02 became 0.02/55 on the debug model (measured,
        # tests/helpers/optim_harness.py; DeepSpeed issue #8439). Newton-Schulz discards the gradient's
        # scale anyway; the AdamW half trains unclipped. Off, and said at start-up (describe()).
        ds["gradient_clipping"] = 0.0
    return ds


def _lion_client(params, hp, cfg):
    from zerotrain.launcher.client_optimizers import sign_zero_safe

    if Node.here().device == "cpu":
        # FusedLion is a CUDA kernel ("not implemented on CPU backend"): DeepSpeed's CPU Lion, the
        # one ZeRO-Offload uses (a C++ op, JIT-built once into ~/.cache/torch_extensions).
        from deepspeed.ops.lion import DeepSpeedCPULion as kernel
    else:
        from deepspeed.ops.lion import FusedLion as kernel
    return sign_zero_safe(kernel)(params, lr=cfg.schedule.lr, **hp)


def _client_configure(ds, hp, cfg):
    ds = {k: v for k, v in ds.items() if k != "optimizer"}  # DeepSpeed refuses a config optimizer and a client one
    # DeepSpeed's ZeRO refuses optimizers it has not tested unless told; ours are elementwise (see
    # launcher/client_optimizers.py), which is all ZeRO's flat partitions need.
    return {**ds, "zero_allow_untested_optimizer": True}


def _decaying_wd_client(params, hp, cfg):
    from zerotrain.launcher.client_optimizers import AdamWDecayingWD

    timescale = hp["wd_timescale"] if hp["wd_timescale"] is not None else max(1, cfg.schedule.max_steps // 10)
    return AdamWDecayingWD(params, lr=cfg.schedule.lr, **{**hp, "wd_timescale": timescale})


def _ademamix_client(params, hp, cfg):
    from zerotrain.launcher.client_optimizers import AdEMAMix

    warmup = hp["warmup_steps"] if hp["warmup_steps"] is not None else cfg.schedule.max_steps
    return AdEMAMix(params, lr=cfg.schedule.lr, **{**hp, "warmup_steps": warmup})


ADAMW = Spec("adamw", "DeepSpeed (torch AdamW or FusedAdam, as the profile says)",
             {"betas": (None, betas(2)), "eps": (None, positive), "weight_decay": (None, nonneg),
              "torch_adam": (None, boolean)},
             "8 (exp_avg, exp_avg_sq)", _adamw_configure, state_per_param=(8, 8),
             notes="defaults: the profile's optimizer section (every shipped profile: betas 0.9/0.95, eps 1e-8,"
                   " weight_decay 0.1)")

REGISTRY: dict[str, Spec] = {s.name: s for s in (
    ADAMW,
    Spec("muon", "DeepSpeed (MuonWithAuxAdam): Muon on 2-D weights, AdamW on embeddings, head and norms",
         {"momentum": (0.95, fraction), "weight_decay": (0.0, nonneg), "adam_lr": (3e-3, positive),
          "betas": ((0.9, 0.95), betas(2)), "eps": (1e-8, positive), "ns_method": ("gram", choice("gram", "standard"))},
         "4 on matrices (momentum), 8 on the rest (AdamW)", _muon_configure, lr=0.02, state_per_param=(4, 8),
         notes="--lr is the Muon (matrix) lr, adam_lr the AdamW half's peak; the schedule scales both;"
               " weight_decay is decoupled and shared by both halves"),
    Spec("lion", "DeepSpeed's kernels (FusedLion on CUDA, DeepSpeedCPULion on a CPU), sign(0) = 0 restored",
         {"betas": ((0.9, 0.99), betas(2)), "weight_decay": (0.0, nonneg)},
         "4 (exp_avg); 8 with DeepSpeedCPULion, which also allocates an unused exp_avg_sq", _client_configure,
         client=_lion_client, lr=3e-4, state_per_param=(4, 4),
         notes="lr default 3e-4: Lion's sign update wants about 1/10 of AdamW's (Chen et al. 2023)"),
    Spec("adamw-decaying-wd", "zerotrain (launcher/client_optimizers.py), plain PyTorch",
         {"betas": ((0.9, 0.95), betas(2)), "eps": (1e-8, positive), "weight_decay": (3e-4, nonneg),
          "wd_timescale": (None, steps_or_null)},
         "8 (exp_avg, exp_avg_sq)", _client_configure, client=_decaying_wd_client, state_per_param=(8, 8),
         notes="decay per step = weight_decay x (lr_t / peak lr) / (1 + t / wd_timescale), independent of the"
               " peak lr; wd_timescale default --max-steps / 10"),
    Spec("ademamix", "zerotrain (launcher/client_optimizers.py), plain PyTorch; Pagliardini et al. 2024",
         {"betas": ((0.9, 0.999, 0.9999), betas(3)), "alpha": (5.0, nonneg), "warmup_steps": (None, steps_or_null),
          "eps": (1e-8, positive), "weight_decay": (0.1, nonneg)},
         "12 (fast EMA, slow EMA, exp_avg_sq)", _client_configure, client=_ademamix_client, state_per_param=(12, 12),
         notes="alpha and beta3 warm up over warmup_steps (default --max-steps), as in the paper"),
)}

USER_CLASS_HELP = "module.path:ClassName"
# The client optimizers whose kernel is one DeepSpeed steps offloaded state with (DeepSpeedCPULion on a CPU).
CPU_CLIENTS = ("lion",)


def known() -> str:
    return ", ".join(REGISTRY) + f", or {USER_CLASS_HELP}"


def is_user_class(name: str | None) -> bool:
    return name is not None and ":" in name


# ------------------------------------------------------------------------------------------------
# Resolving a name and its arguments
# ------------------------------------------------------------------------------------------------

def load_class(name: str):
    """The class named by `module.path:ClassName` (the working directory is searched last)."""
    import torch

    module_name, _, cls_name = name.partition(":")
    where = f"--optimizer {name}"
    if not module_name or not cls_name.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        raise UsageError(f"{where}: expected {USER_CLASS_HELP}")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # `python launcher/train.py` puts launcher/ first on sys.path, not the directory the
            # user runs from, where their module usually is.
            if os.getcwd() in sys.path or e.name != module_name.split(".")[0]:
                raise
            sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is their one-line error
        first = (str(e).splitlines() or [""])[0]
        raise UsageError(f"{where}: cannot import {module_name} ({type(e).__name__}: {first})") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UsageError(f"{where}: {module_name} has no {cls_name}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UsageError(f"{where}: {module_name}.{cls_name} is not a torch.optim.Optimizer subclass")
    return cls


def _user_spec(name: str) -> Spec:
    cls = load_class(name)
    sig = inspect.signature(cls.__init__)
    named = [p for p in list(sig.parameters.values())[2:]  # self, params
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    if not open_kwargs and "lr" not in {p.name for p in named}:
        raise UsageError(f"--optimizer {name}: {cls.__name__}.__init__ takes no lr (the schedule sets each param"
                         " group's lr)")
    hparams = {p.name: (None if p.default is p.empty else p.default, lambda v: v) for p in named if p.name != "lr"}

    def client(params, hp, cfg):
        return cls(params, lr=cfg.schedule.lr, **hp)

    return Spec(name, f"user class {cls.__module__}.{cls.__qualname__}", hparams, "the class's", _client_configure,
                client=client, stages=tuple(getattr(cls, "zero_stages", ALL_STAGES)), open_args=open_kwargs,
                state_per_param=_declared_state(cls))


def _declared_state(cls) -> tuple[float, float] | None:
    """A user class's `state_bytes_per_param` (fp32 bytes of state per parameter, as the registry's), if it says."""
    declared = getattr(cls, "state_bytes_per_param", None)
    if isinstance(declared, bool) or not isinstance(declared, (int, float)) or declared < 0:
        return None
    return (declared, declared)


def parse_args(args) -> dict:
    """--optimizer-args as a dict: a JSON object (string from the command line, object from a recipe)."""
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise UsageError(f"--optimizer-args: not valid JSON ({e.msg} at column {e.colno}); expected an object"
                             " such as '{\"weight_decay\": 0.0}'") from None
    if not isinstance(args, dict):
        raise UsageError(f"--optimizer-args: expected a JSON object such as '{{\"weight_decay\": 0.0}}', got"
                         f" {json.dumps(args)}")
    return args


def resolve(name: str | None, args=None) -> tuple[Spec, dict]:
    """(spec, hyper-parameters with defaults filled in) for --optimizer / --optimizer-args."""
    name = name or DEFAULT
    args = parse_args(args)
    if is_user_class(name):
        spec = _user_spec(name)
    elif name in REGISTRY:
        spec = REGISTRY[name]
    else:
        raise UsageError(f"--optimizer {name}: unknown optimizer; known: {known()}")
    if "lr" in args:
        raise UsageError("--optimizer-args: 'lr' is set by --lr (or a scaling rule's law), not here")
    hp = {} if is_user_class(name) else spec.defaults()
    for key, value in args.items():
        if key not in spec.hparams and not spec.open_args:
            raise UsageError(f"--optimizer-args: {spec.name} takes no argument {key!r} (known: "
                             f"{', '.join(sorted(spec.hparams)) or 'none'})")
        check = spec.hparams.get(key, (None, lambda v: v))[1]
        try:
            hp[key] = check(value)
        except ValueError as e:
            raise UsageError(f"--optimizer-args: {spec.name} {key} must be {e}, got {json.dumps(value)}") from None
    if not is_user_class(name):
        hp = {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()}
    return spec, hp


def check_optimizer(name, args) -> tuple[str | None, dict | None]:
    """Validate --optimizer / --optimizer-args (one-line UsageError); return them normalised.

    The default spelled out (`adamw` without arguments) becomes None, so its run id and drift check
    are the default's.
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise UsageError(f"--optimizer: expected a name ({known()}), got {name!r}")
    resolve(name, args)
    args = parse_args(args) or None
    if name == DEFAULT and args is None:
        name = None
    return name, args


def state_bytes_per_param(name: str | None, matrices: int = 0, total: int = 0) -> float:
    """Bytes of optimizer state per parameter (fp32; Adam's 8) for a model of `total` parameters, `matrices` of them
    in 2-D block weights (Muon's split; unused by an optimizer that keeps the same state on every parameter): the
    registry's figure, the one the planner uses. An optimizer that does not say (a user class without
    `state_bytes_per_param`) is refused (UsageError, one line) rather than guessed."""
    spec, _ = resolve(name)
    if spec.state_per_param is None:
        raise UsageError(f"--optimizer {spec.name}: the planner needs its optimizer state per parameter; give the class"
                         " a `state_bytes_per_param` attribute (fp32 bytes, AdamW's is 8)")
    on_matrices, on_rest = spec.state_per_param
    if on_matrices == on_rest:
        return on_rest
    if not total:
        raise ValueError(f"state_bytes_per_param: {spec.name}'s state differs on matrices; give the model's counts")
    return (on_matrices * matrices + on_rest * (total - matrices)) / total


def default_lr(name: str | None) -> float | None:
    """The optimizer's own default peak lr, or None: then the profile's lr or the per-size rule
    (zerotrain.launcher.hparams)."""
    spec = REGISTRY.get(name or DEFAULT)
    return spec.lr if spec is not None else None


def law_names(name: str | None) -> list[str]:
    """Keys a scaling rule's per-optimizer lr law may use for this optimizer, most specific first.

    A user's class `pkg.mod:ADana` finds its law under `pkg.mod:ADana` or under `adana`.
    """
    name = name or DEFAULT
    if is_user_class(name):
        return [name, name.partition(":")[2].lower()]
    return [name]


# ------------------------------------------------------------------------------------------------
# Plan time and engine time
# ------------------------------------------------------------------------------------------------

def resolve_ds_optimizer(ds: dict, cfg, where: str) -> dict:
    """The DeepSpeed dict with this run's optimizer in it (called by profiles.resolve_ds_config)."""
    name, args = cfg.schedule.optimizer, cfg.schedule.optimizer_args
    if name is None and not args:  # the default: exactly what the driver did before the registry
        ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
        ds["optimizer"].setdefault("params", {})["lr"] = cfg.schedule.lr
        return _cpu_adam_when_offloaded(ds)
    spec, hp = resolve(name, args)
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage not in spec.stages:
        raise UsageError(f"--optimizer {spec.name}: not supported under ZeRO stage {stage} ({where}); supported"
                         f" stages: {', '.join(map(str, spec.stages))}")
    if spec.name == "muon":
        _check_deepspeed_for_muon()
    if spec.client is not None and spec.name not in CPU_CLIENTS and offloads_optimizer(ds):
        # DeepSpeed 0.19 (engine.py _configure_basic_optimizer) refuses any other client optimizer under
        # ZeRO-Offload with a ZeRORuntimeException once the engine is built, after the run directory exists.
        # Refused, not swapped for DeepSpeed's CPU Adam: that would train with another update rule than the
        # one asked for (this one's weight decay, or its EMAs), silently.
        raise UsageError(f"--optimizer {spec.name}: a client optimizer cannot step the offloaded optimizer state"
                         f" (--offload optimizer/all, or the {where.removeprefix('profile ')} profile's offload):"
                         " DeepSpeed steps it with its own CPU Adam or CPU Lion only; use --optimizer adamw or"
                         " lion with the offload, or --offload none")
    return spec.configure(ds, hp, cfg)


def _check_deepspeed_for_muon() -> None:
    have = version("deepspeed")
    if Version(have) < Version(MUON_MIN_DEEPSPEED):
        raise UsageError(f"--optimizer muon: needs DeepSpeed >= {MUON_MIN_DEEPSPEED} (the release verified here;"
                         f" earlier ones train ZeRO-3 matrices with AdamW, PR #8438, and stage 0 with SGD, PR #8442);"
                         f" this is {have}")


def prepare_optimizer(cfg, ds_config: dict, model):
    """(ds_config, client optimizer or None, model_parameters) for deepspeed.initialize.

    `ds_config` is the plan's (resolve_ds_optimizer already made it exact) and comes back as it is.
    A config without an "optimizer" section means a client optimizer, built here on the model's
    parameters (under ZeRO-3 the partitioned ones; DeepSpeed swaps in its fp32 partitions).
    """
    params = model.parameters()
    if "optimizer" in ds_config:
        return ds_config, None, params
    spec, hp = resolve(cfg.schedule.optimizer, cfg.schedule.optimizer_args)
    return ds_config, spec.client(list(params), hp, cfg), model.parameters()


def layer_is_muon(name: str, p) -> bool:
    """Whether a parameter should get Muon: a matrix by its real shape (ZeRO-3: `ds_shape`), not
    an embedding or the head (DeepSpeed's own name test, repeated so it is checked independently)."""
    shape = ds_attributes.full_shape(p)
    return len(shape) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def check_engine(cfg, engine, model, muon_class=None) -> None:
    """After deepspeed.initialize: refuse (one line) an engine that would train with another rule.
    `muon_class`: a callable returning DeepSpeed's Muon class (components.ds_compat.muon_optimizer_class:
    its module path is DeepSpeed-internal, so it is named there, in the layer above this one)."""
    if cfg.schedule.optimizer != "muon":
        return
    MuonWithAuxAdam = muon_class()
    basic = ds_attributes.basic_optimizer(engine)
    wrong = [n for n, p in model.named_parameters() if bool(getattr(p, "use_muon", False)) != layer_is_muon(n, p)]
    problem = None
    if not isinstance(basic, MuonWithAuxAdam):
        problem = f"the engine's optimizer is {type(basic).__name__}, not DeepSpeed's MuonWithAuxAdam"
    elif wrong:
        problem = f"{len(wrong)} parameter(s) tagged for the wrong half, e.g. {wrong[0]}"
    elif not any(layer_is_muon(n, p) for n, p in model.named_parameters()):
        problem = "the model has no matrix for Muon"
    if problem:
        raise UsageError(f"--optimizer muon: refused: {problem}; DeepSpeed would train with another update rule")


def implementation(cfg, ds_config: dict, accelerator: str) -> tuple[str, str | None]:
    """(the optimizer class this run steps with on `accelerator` ("cuda", "cpu"), what must be compiled
    for it or None): the choice DeepSpeed 0.19.8 makes in engine.py `_configure_basic_optimizer` /
    `get_optimizer_configuration` (torch_adam first, then CPU Adam under optimizer offload, else FusedAdam),
    or our client optimizer. DeepSpeed's ops are JIT-built on first use unless pre-built (docs/gpu.md)."""
    name = cfg.schedule.optimizer
    section = ds_config.get("optimizer")
    cuda = accelerator != "cpu"
    if section is None:  # a client optimizer (launcher/optimizers.py REGISTRY or a user's class)
        spec, _ = resolve(name, cfg.schedule.optimizer_args)
        if spec.name == "lion":
            return (("deepspeed.ops.lion.FusedLion", "DeepSpeed's fused_lion CUDA op: nvcc, or DS_BUILD_FUSED_LION=1")
                    if cuda else ("deepspeed.ops.lion.DeepSpeedCPULion", "DeepSpeed's cpu_lion C++ op: a host C++"
                                  " compiler, or DS_BUILD_CPU_LION=1"))
        return spec.origin, None
    kind, params = str(section.get("type", "")).lower(), section.get("params", {})
    if kind == "muon":  # DeepSpeed decorates its Muon update with torch.compile (runtime/zero/muon/original_muon.py)
        return ("DeepSpeed MuonWithAuxAdam, its AdamW half torch.optim.AdamW",
                "torch.compile of DeepSpeed's Muon update at the first step (inductor: tens of seconds on a CPU"
                " the first time, cached after; TORCHDYNAMO_DISABLE=1 runs it eagerly)")
    if kind not in ("adam", "adamw"):
        return f"DeepSpeed's {section.get('type')}", None
    torch_name = "torch.optim.AdamW" if kind == "adamw" or params.get("adam_w_mode", True) else "torch.optim.Adam"
    if params.get("torch_adam"):
        return f"{torch_name}({'fused=True' if params.get('fused') else 'foreach'}) through DeepSpeed", None
    if offloads_optimizer(ds_config):
        return ("deepspeed.ops.adam.DeepSpeedCPUAdam on the host (optimizer offload)",
                "DeepSpeed's cpu_adam C++ op: a host C++ compiler, or DS_BUILD_CPU_ADAM=1")
    return ("deepspeed.ops.adam.FusedAdam", "DeepSpeed's fused_adam " + (
        "CUDA op: nvcc matching torch's CUDA, or DS_BUILD_FUSED_ADAM=1" if cuda else "C++ op: a host C++ compiler"))


def describe_implementation(cfg, ds_config: dict, accelerator: str) -> str:
    """The start-up / --dry-run line: the class that steps, and whether anything is compiled for it."""
    what, build = implementation(cfg, ds_config, accelerator)
    return f"optimizer implementation on {accelerator}: {what}" + (
        f"; JIT-compiled on first use: {build}" if build else "; nothing to compile")


def describe(cfg, ds_config: dict) -> str:
    """One start-up line: which optimizer runs, where it comes from, its lr(s) and hyper-parameters."""
    name = cfg.schedule.optimizer
    section = ds_config.get("optimizer")
    if name is None and not cfg.schedule.optimizer_args:
        params = {k: v for k, v in (section or {}).get("params", {}).items() if k != "lr"}
        return f"optimizer adamw (DeepSpeed {(section or {}).get('type', 'AdamW')}, the profile's): lr {cfg.schedule.lr:g}, {params}"
    spec, hp = resolve(name, cfg.schedule.optimizer_args)
    line = f"optimizer {spec.name} ({spec.origin}): lr {cfg.schedule.lr:g}, {hp}"
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if spec.name == "muon" and stage >= 1:
        line += (f"; gradient clipping off: under ZeRO-{stage} DeepSpeed would clip Muon's orthogonalized update"
                 " instead of the gradient (DeepSpeed issue #8439)")
    return line
