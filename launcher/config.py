"""The run configuration: one typed dataclass, filled from defaults < recipe JSON < command line.

Flag names use dashes (`--seq-len`), recipe keys may use dashes or underscores. Unknown recipe
keys are refused, never ignored. The batch triple is resolved later, against the profile and the
world size (launcher.profiles.resolve_batch).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from launcher.errors import UsageError, read_json_object


@dataclass
class RunConfig:
    profile: str = "cpu"
    model: str = "debug"
    data: str | None = None
    tokenizer: str = "bytes"
    seq_len: int = 256
    micro_batch: int | None = None  # None: the profile's
    grad_accum: int | None = None  # None: the profile's, or derived from global_batch_tokens
    global_batch_tokens: int | None = None
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    max_steps: int = 100
    seed: int = 1337
    out: str = "runs"
    run_id: str | None = None  # None: derived from the config, so the same command resumes
    save_every_steps: int = 0  # 0: only at the end
    resume: str = "auto"
    activation_checkpointing: bool | None = None  # None: the profile's
    log_data_every_steps: int = 100  # realised token share per source in metrics.jsonl; 0: never
    packing: str | None = None  # None: best-fit (or greedy); see dataio/packing.py
    # The model, instead of --model (see launcher/model_spec.py): the depth rule, a scaling rule, or HF weights.
    depth: int | None = None
    aspect_ratio: int | None = None  # None: 64 (dim = depth x aspect ratio)
    head_dim: int | None = None  # None: 128 (dim is rounded to a multiple of it)
    scaling_rule: str | None = None
    heads: int | None = None
    rules_file: str | None = None  # None: modeling/scaling_rules.yaml
    init_from: str | None = None  # a Hugging Face Llama directory (safetensors)
    qk_norm: bool | None = None  # None: off (or the rule's / the HF config's)
    compile: bool | None = None  # None: off

    # Keys that may change between a run and its resume without counting as config drift.
    RESUMABLE_CHANGES = ("max_steps", "save_every_steps", "resume", "out", "run_id",
                         "log_data_every_steps")
    # Keys added after 0.1: left out of the identity hash while unset, so earlier run ids still resume.
    HASHED_ONLY_WHEN_SET = ("packing",
                            "depth", "aspect_ratio", "head_dim", "scaling_rule", "heads", "rules_file", "init_from",
                            "qk_norm", "compile")

    def validate(self) -> None:
        if self.data is None:
            raise UsageError("--data: a mix file is required (see dataio/sources.py for its format)")
        for name in ("seq_len", "max_steps", "micro_batch", "grad_accum", "global_batch_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer, got {v!r}")
        for name in ("save_every_steps", "warmup_steps", "seed", "log_data_every_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"--{name.replace('_', '-')}: must be a non-negative integer, got {v!r}")
        for name in ("lr", "min_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UsageError(f"--{name.replace('_', '-')}: must be a non-negative number, got {v!r}")
        if self.lr == 0 or self.min_lr > self.lr:
            raise UsageError(f"--lr {self.lr} / --min-lr {self.min_lr}: need 0 <= min-lr <= lr and lr > 0")
        if self.grad_accum is not None and self.global_batch_tokens is not None:
            raise UsageError("--grad-accum and --global-batch-tokens: give one, the other is derived")
        if self.resume not in ("auto", "never") and not Path(self.resume).exists():
            raise UsageError(f"--resume {self.resume}: no such checkpoint (use auto, never or a checkpoint path)")
        if self.run_id is not None and (not self.run_id or "/" in self.run_id or self.run_id.startswith(".")):
            raise UsageError(f"--run-id {self.run_id!r}: must be a plain directory name")

    def to_dict(self) -> dict:
        return asdict(self)

    def identity_hash(self) -> str:
        """Hash of what defines the training (not how long or where it runs)."""
        d = {k: v for k, v in self.to_dict().items()
             if k not in self.RESUMABLE_CHANGES and not (k in self.HASHED_ONLY_WHEN_SET and v is None)}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"command line: {message}")


def _arg_type(f):
    t = f.type if isinstance(f.type, str) else f.type.__name__
    return int if "int" in t else float if "float" in t else str


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="zerotrain train", description="Train a decoder-only LM with DeepSpeed.")
    p.add_argument("--config", help="recipe JSON with the same keys as the flags; flags override it")
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, type=_arg_type(f), default=None, dest=f.name)
    # Injected by the deepspeed launcher (and older torch launchers); the env var is what we use.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def load_recipe(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"recipe {path}: no such file")
    raw = read_json_object(p, f"recipe {path}")
    known = {f.name for f in fields(RunConfig)}
    recipe = {}
    for k, v in raw.items():
        key = k.replace("-", "_")
        if key not in known:
            raise UsageError(f"recipe {path}: unknown key {k!r}")
        recipe[key] = v
    return recipe


def resolve_config(argv: list[str] | None) -> RunConfig:
    ns = build_parser().parse_args(argv)
    values = load_recipe(ns.config) if ns.config else {}
    values.update({f.name: getattr(ns, f.name) for f in fields(RunConfig) if getattr(ns, f.name) is not None})
    from launcher.model_spec import rule_lr_defaults

    values.update(rule_lr_defaults(values))  # a scaling rule's lr law, when --lr is not given
    cfg = RunConfig(**values)
    cfg.validate()
    return cfg
