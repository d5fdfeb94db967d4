"""Which model a run trains, from the flags: exactly one of

    --model NAME                         a named preset (zerotrain.modeling.model.PRESETS; the default, debug)
    --depth D [--aspect-ratio A] [--head-dim H]
                                         the depth rule (zerotrain.modeling.sizes.depth_args)
    --scaling-rule NAME --heads H [--rules-file YAML]
                                         a heads-based rule (modeling/scaling_rules.yaml)
    --init-from HF_DIR                   a Hugging Face Llama directory: its config.json is the
                                         architecture, its safetensors the starting weights

plus `--qk-norm` for the first three. Everything is checked here, before any process builds a
model or writes a file; a problem is a UsageError naming the flag.
"""
from __future__ import annotations

from zerotrain.launcher.errors import UsageError

DEPTH_ONLY = ("aspect_ratio", "head_dim")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(cfg, names) -> list[str]:
    return [n for n in names if getattr(cfg, n) is not None]


def resolve(cfg, vocab_size: int) -> tuple:
    """(ModelArgs, label for the run id, HF directory to load weights from or None)."""
    from zerotrain.modeling import hf, sizes
    from zerotrain.modeling.model import preset

    sources = _given(cfg, ("depth", "scaling_rule", "init_from"))
    if len(sources) > 1:
        raise UsageError(f"{_flag(sources[0])} and {_flag(sources[1])}: give one way to pick the model")
    if sources and cfg.model is not None:
        raise UsageError(f"--model {cfg.model} and {_flag(sources[0])}: give one way to pick the model")
    for name in DEPTH_ONLY:
        if getattr(cfg, name) is not None and cfg.depth is None:
            raise UsageError(f"{_flag(name)}: only used with --depth")
    if (cfg.heads is not None or cfg.rules_file is not None) and cfg.scaling_rule is None:
        raise UsageError(f"{'--heads' if cfg.heads is not None else '--rules-file'}: only used with --scaling-rule")
    common = dict(vocab_size=vocab_size, max_seq_len=cfg.seq_len)
    if cfg.qk_norm is not None:
        common["qk_norm"] = cfg.qk_norm

    if cfg.init_from is not None:
        if cfg.qk_norm is not None:
            raise UsageError("--qk-norm and --init-from: the Hugging Face config.json decides")
        where = f"--init-from {cfg.init_from}"
        try:
            hf_cfg = hf.read_config(cfg.init_from)
            args = hf.args_from_config(hf_cfg, where)
            hf.check_weights(cfg.init_from, args, hf_cfg["vocab_size"])
        except ValueError as e:
            msg = str(e).removeprefix(f"{cfg.init_from}: ")
            raise UsageError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        if vocab_size > hf_cfg["vocab_size"]:
            raise UsageError(f"{where}: vocab_size {hf_cfg['vocab_size']} is smaller than the tokenizer's {vocab_size}")
        return args, "hf-" + _safe(cfg.init_from), cfg.init_from
    if cfg.depth is not None:
        try:
            args = sizes.depth_args(cfg.depth, cfg.aspect_ratio or 64, cfg.head_dim or 128, **common)
        except ValueError as e:
            raise UsageError(f"--depth {cfg.depth}: {e}") from None
        return args, f"d{cfg.depth}", None
    if cfg.scaling_rule is not None:
        if cfg.heads is None:
            raise UsageError(f"--scaling-rule {cfg.scaling_rule}: needs --heads H")
        try:
            rule = sizes.get_rule(cfg.scaling_rule, cfg.rules_file or sizes.RULES_FILE)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {cfg.scaling_rule}: {e}") from None
        try:
            args = sizes.rule_args(rule, cfg.heads, **common)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {cfg.scaling_rule} --heads {cfg.heads}: {e}") from None
        return args, f"{cfg.scaling_rule}-h{cfg.heads}", None
    name = cfg.model or "debug"
    try:
        args = preset(name, **common)
    except (KeyError, ValueError) as e:
        raise UsageError(f"--model {name}: {e.args[0]}") from None
    return args, name, None


def _safe(path: str) -> str:
    from pathlib import Path

    name = Path(path).resolve().name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"


def rule_lr_defaults(values: dict) -> dict:
    """{lr, min_lr} when --lr is not given: the scaling rule's law for the run's optimizer, else the
    optimizer's own default peak lr (launcher/optimizers.py: muon 0.02, lion 3e-4); {} otherwise.

    min_lr defaults to lr / 10 then (the ratio of the built-in defaults). AdamW without a law
    returns {}: RunConfig's defaults, as before. Any problem with the rule or the optimizer is
    left for `resolve` / RunConfig.validate to report with the flag named.
    """
    if values.get("lr") is not None:
        return {}
    from zerotrain.launcher import optimizers

    optimizer = values.get("optimizer")
    if optimizer is not None and not isinstance(optimizer, str):
        return {}
    lr = _rule_lr(values, optimizers.law_names(optimizer))
    if lr is None:
        lr = optimizers.default_lr(optimizer)
    if lr is None:
        return {}
    return {"lr": lr, **({} if values.get("min_lr") is not None else {"min_lr": lr / 10})}


def _rule_lr(values: dict, law_names: list[str]) -> float | None:
    if not values.get("scaling_rule") or values.get("heads") is None:
        return None
    from zerotrain.modeling import sizes
    from zerotrain.modeling.model import count_params

    try:
        rule = sizes.get_rule(values["scaling_rule"], values.get("rules_file") or sizes.RULES_FILE)
        overrides = {} if values.get("qk_norm") is None else {"qk_norm": values["qk_norm"]}
        args = sizes.rule_args(rule, values["heads"], **overrides)
    except (ValueError, TypeError):
        return None
    return sizes.rule_lr(rule, count_params(args)["non_embedding"], law_names)


def _params_parser():
    import argparse

    from zerotrain.modeling import sizes

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise UsageError(f"params: {message}")

    p = Parser(prog="zerotrain params", description="Parameter counts and training FLOPs per token.")
    p.add_argument("presets", nargs="*", help="preset names (default: all, unless --depth or --scaling-rule)")
    p.add_argument("--depth", type=int, action="append", default=[], help="the depth rule; repeatable")
    p.add_argument("--aspect-ratio", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--scaling-rule")
    p.add_argument("--heads", type=int, action="append", default=[], help="with --scaling-rule; repeatable")
    p.add_argument("--rules-file", default=str(sizes.RULES_FILE))
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--vocab-size", type=int, default=258, help="default: the byte tokenizer's 258")
    p.add_argument("--seq-len", type=int, default=2048, help="for the attention term of FLOPs per token")
    p.add_argument("--optimizer", help="print the peak lr a run with this optimizer would use: the rule's law for it,"
                                       " else its default (launcher/optimizers.py)")
    return p


def _params_laws(ns, rule) -> tuple[list[str], float | None]:
    """(law names to look up in the rule, the lr where there is no law) for `params --optimizer`."""
    if ns.optimizer is None:
        return ["adamw"], None  # AdamW's law, and "-" where there is none
    from zerotrain.launcher import optimizers
    from zerotrain.launcher.config import RunConfig
    from zerotrain.modeling import sizes

    name = ns.optimizer
    law_only = rule is not None and name in sizes.rule_laws(rule)  # e.g. `adana`, a user class's law
    if name not in optimizers.REGISTRY and not optimizers.is_user_class(name) and not law_only:
        raise UsageError(f"--optimizer {name}: unknown optimizer; known: {optimizers.known()}"
                         + (f", or a law of rule {ns.scaling_rule}: {', '.join(sizes.rule_laws(rule))}"
                            if rule is not None and sizes.rule_laws(rule) else ""))
    return optimizers.law_names(name), optimizers.default_lr(name) or RunConfig.__dataclass_fields__["lr"].default


def _params_rows(ns, rule, laws, fallback_lr) -> list[tuple]:
    """(label, ModelArgs, lr or None) for every preset, depth and rule size asked for."""
    from zerotrain.modeling import sizes
    from zerotrain.modeling.model import PRESETS, count_params, preset

    common = dict(vocab_size=ns.vocab_size, **({"qk_norm": True} if ns.qk_norm else {}))
    rows = []
    for name in ns.presets or ([] if ns.depth or ns.scaling_rule else list(PRESETS)):
        try:
            rows.append((name, preset(name, **common), fallback_lr))
        except (KeyError, ValueError) as e:
            raise UsageError(f"params {name}: {e.args[0]}") from None
    for depth in ns.depth:
        try:
            rows.append((f"depth {depth}", sizes.depth_args(depth, ns.aspect_ratio, ns.head_dim, **common),
                         fallback_lr))
        except ValueError as e:
            raise UsageError(f"--depth {depth}: {e}") from None
    for heads in (ns.heads if rule is not None else []):
        try:
            args = sizes.rule_args(rule, heads, **common)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {ns.scaling_rule} --heads {heads}: {e}") from None
        law_lr = sizes.rule_lr(rule, count_params(args)["non_embedding"], laws)
        rows.append((f"{ns.scaling_rule} H={heads}", args, law_lr if law_lr is not None else fallback_lr))
    return rows


def params_main(argv: list[str]) -> None:
    """`zerotrain params`: sizes, parameter counts and training FLOPs per token."""
    from zerotrain.modeling import sizes
    from zerotrain.modeling.model import count_params, flops_per_token

    ns = _params_parser().parse_args(argv)
    if ns.heads and not ns.scaling_rule:
        raise UsageError("--heads: only used with --scaling-rule")
    if ns.scaling_rule and not ns.heads:
        raise UsageError(f"--scaling-rule {ns.scaling_rule}: needs --heads H")
    for name in ("vocab_size", "seq_len"):
        if getattr(ns, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer")
    rule = None
    if ns.scaling_rule:
        try:
            rule = sizes.get_rule(ns.scaling_rule, ns.rules_file)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {ns.scaling_rule}: {e}") from None
    laws, fallback_lr = _params_laws(ns, rule)
    rows = _params_rows(ns, rule, laws, fallback_lr)
    vocab = rows[0][1].vocab_size if rows else ns.vocab_size
    print(f"vocab {vocab} ({ns.vocab_size} padded to a multiple of 64), FLOPs per token at seq len {ns.seq_len}")
    print(f"{'model':<14}{'layers':>7}{'dim':>6}{'heads':>6}{'kv':>4}{'ffn':>7}{'total':>15}{'non-emb':>15}"
          f"{'FLOPs/tok':>11}{'lr':>10}")
    for label, args, lr in rows:
        n = count_params(args)
        print(f"{label:<14}{args.n_layers:>7}{args.dim:>6}{args.n_heads:>6}{args.n_kv_heads:>4}{args.ffn_hidden:>7}"
              f"{n['total']:>15,}{n['non_embedding']:>15,}{flops_per_token(args, ns.seq_len):>11.3e}"
              f"{(f'{lr:.3e}' if lr is not None else '-'):>10}")
    if ns.optimizer is not None:
        has_law = rule is not None and any(n in sizes.rule_laws(rule) for n in laws)
        print(f"lr: the peak lr of a run with --optimizer {ns.optimizer} and no --lr: "
              + (f"rule {ns.scaling_rule}'s law for {'/'.join(laws)}" if has_law else
                 f"{fallback_lr:g}, its default" + (f" (rule {ns.scaling_rule} has no law for it)" if ns.scaling_rule
                                                     else "")))
