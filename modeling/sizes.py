"""Model sizes from one knob: the depth rule and the heads-based scaling rules.

- `depth_args(D)`: n_layers = D, dim = D x aspect_ratio rounded to a multiple of head_dim,
  n_heads = dim / head_dim (nanochat's single size knob).
- `rule_args(name, H)`: every size from the head count, by a rule in scaling_rules.yaml
  (`enoki`, `qwen3`, or your own file); `rule_lr(rule, P, optimizer)`: the rule's optional
  learning-rate power law lr = a * (b + P) ** d in the non-embedding parameter count P, one per
  optimizer (`lr: {adamw: {a, b, d}, muon: {...}}`; the older `lr: {a, b, d}` is AdamW's).

Everything raises ValueError with a message that names the offending value; the launcher turns
it into a one-line flag error. Named presets live beside the model (zerotrain.modeling.model.PRESETS).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.modeling.model import ModelArgs

RULES_FILE = resource_dir("zerotrain.modeling", "scaling_rules.yaml")
RULE_KEYS = {"description", "head_dim", "layers_per_head", "mlp_ratio", "kv_heads_ratio", "tie_embeddings",
             "qk_norm", "lr"}


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def depth_args(depth: int, aspect_ratio: int = 64, head_dim: int = 128, **overrides) -> ModelArgs:
    """dim = depth x aspect_ratio, rounded to the nearest multiple of head_dim (ties round up)."""
    _positive_int(depth, "depth")
    _positive_int(aspect_ratio, "aspect ratio")
    _positive_int(head_dim, "head dim")
    raw = depth * aspect_ratio
    if raw < head_dim:
        raise ValueError(f"depth {depth} x aspect ratio {aspect_ratio} = {raw} is {raw / head_dim:g} heads of"
                         f" {head_dim}, not a whole head; use a larger depth or a smaller head dim")
    n_heads = (2 * raw + head_dim) // (2 * head_dim)
    return ModelArgs(dim=n_heads * head_dim, n_layers=depth, n_heads=n_heads, **overrides)


def load_rules(path: str | Path = RULES_FILE) -> dict[str, dict]:
    """The rules of a YAML file (safe_load: plain data only), each checked."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"scaling rules {path}: no such file")
    try:
        rules = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"scaling rules {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(rules, dict) or not rules:
        raise ValueError(f"scaling rules {path}: expected a mapping of rule names to rules")
    for name, rule in rules.items():
        _check_rule(rule, f"scaling rules {path}: rule {name!r}")
    return rules


def _check_rule(rule, where: str) -> None:
    if not isinstance(rule, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = sorted(set(rule) - RULE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(RULE_KEYS))})")
    for key in ("head_dim", "layers_per_head", "mlp_ratio"):
        if key not in rule:
            raise ValueError(f"{where}: missing {key}")
    _positive_int(rule["head_dim"], f"{where}: head_dim")
    lph = rule["layers_per_head"]
    if not (isinstance(lph, list) and len(lph) == 2):
        raise ValueError(f"{where}: layers_per_head must be [numerator, denominator], got {lph!r}")
    for v in lph:
        _positive_int(v, f"{where}: layers_per_head entries")
    _positive_int(rule.get("kv_heads_ratio", 1), f"{where}: kv_heads_ratio")
    _positive_number(rule["mlp_ratio"], f"{where}: mlp_ratio")
    for key in ("tie_embeddings", "qk_norm"):
        if not isinstance(rule.get(key, False), bool):
            raise ValueError(f"{where}: {key} must be true or false, got {rule[key]!r}")
    law = rule.get("lr")
    if law is not None:
        if not isinstance(law, dict) or not law:
            raise ValueError(f"{where}: lr must be a mapping: {{a, b, d}} or {{optimizer: {{a, b, d}}, ...}}"
                             " (lr = a * (b + P) ** d)")
        if set(law) & {"a", "b", "d"}:  # the single-law form (before per-optimizer laws): AdamW's
            _check_law(law, f"{where}: lr")
        else:
            for optimizer, one in law.items():
                if not isinstance(optimizer, str):
                    raise ValueError(f"{where}: lr: optimizer names must be strings, got {optimizer!r}")
                _check_law(one, f"{where}: lr.{optimizer}")


def _check_law(law, where: str) -> None:
    if not isinstance(law, dict) or set(law) != {"a", "b", "d"}:
        raise ValueError(f"{where} must be a mapping with exactly a, b and d (lr = a * (b + P) ** d)")
    for key in ("a", "b", "d"):  # PyYAML reads 1.0e5 (no sign in the exponent) as a string
        if isinstance(law[key], str):
            with contextlib.suppress(ValueError):
                law[key] = float(law[key])
    _positive_number(law["a"], f"{where}.a")
    for key in ("b", "d"):
        if isinstance(law[key], bool) or not isinstance(law[key], (int, float)) or not math.isfinite(law[key]):
            raise ValueError(f"{where}.{key} must be a number, got {law[key]!r}")
    if law["b"] < 0:
        raise ValueError(f"{where}.b must be >= 0, got {law['b']!r}")


def _positive_number(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")


def get_rule(name: str, rules_file: str | Path = RULES_FILE) -> dict:
    rules = load_rules(rules_file)
    if name not in rules:
        raise ValueError(f"unknown scaling rule {name!r}; known: {', '.join(rules)}")
    return rules[name]


def rule_args(rule: dict, heads: int, **overrides) -> ModelArgs:
    """ModelArgs for `heads` attention heads under `rule` (a checked entry of load_rules)."""
    _positive_int(heads, "heads")
    num, den = rule["layers_per_head"]
    n_layers = num * heads // den
    if n_layers < 1:
        raise ValueError(f"heads {heads} gives {num} * {heads} // {den} = 0 layers")
    kv_ratio = rule.get("kv_heads_ratio", 1)
    if heads % kv_ratio:
        raise ValueError(f"heads {heads} is not divisible by the rule's kv_heads_ratio {kv_ratio}")
    dim = heads * rule["head_dim"]
    args = dict(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=heads // kv_ratio,
                ffn_hidden=64 * math.ceil(rule["mlp_ratio"] * dim / 64),
                tie_embeddings=rule.get("tie_embeddings", False), qk_norm=rule.get("qk_norm", False))
    return ModelArgs(**{**args, **overrides})


def rule_laws(rule: dict) -> dict[str, dict]:
    """The rule's lr laws by optimizer name; the single-law form is AdamW's (the only optimizer before)."""
    law = rule.get("lr")
    if law is None:
        return {}
    return {"adamw": law} if "a" in law else dict(law)


def rule_lr(rule: dict, non_embedding_params: int, optimizer: str | list[str] = "adamw") -> float | None:
    """lr = a * (b + P) ** d by the law of `optimizer` (or the first of several names that has one), or None."""
    laws = rule_laws(rule)
    for name in [optimizer] if isinstance(optimizer, str) else optimizer:
        if name in laws:
            law = laws[name]
            return float(law["a"] * (law["b"] + non_embedding_params) ** law["d"])
    return None
