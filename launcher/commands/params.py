"""`zerotrain params`: parameter counts and training FLOPs per token of presets, depths and scaling rules."""
from __future__ import annotations

from zerotrain.cli_args import Parser
from zerotrain.launcher import optimizers
from zerotrain.launcher.errors import UsageError
from zerotrain.modeling import sizes
from zerotrain.modeling.sizes import PRESETS, count_params, flops_per_token, preset


def _params_parser():
    p = Parser(prog="zerotrain params", description="Parameter counts and training FLOPs per token.")
    p.add_argument("presets", nargs="*", help="preset names (default: all, unless --depth or --scaling-rule)")
    p.add_argument("--depth", type=int, action="append", default=[], help="the depth rule; repeatable")
    p.add_argument("--aspect-ratio", type=int, default=64, help="with --depth: dim = depth x aspect ratio")
    p.add_argument("--head-dim", type=int, default=128, help="with --depth")
    p.add_argument("--scaling-rule", help="a rule in --rules-file, with --heads")
    p.add_argument("--heads", type=int, action="append", default=[], help="with --scaling-rule; repeatable")
    p.add_argument("--rules-file", default=str(sizes.RULES_FILE),
                   help="scaling rules YAML (default: the rules zerotrain ships, modeling/scaling_rules.yaml)")
    p.add_argument("--qk-norm", action="store_true", help="count the RMSNorm on queries and keys")
    p.add_argument("--vocab-size", type=int, default=258, help="default: the byte tokenizer's 258")
    p.add_argument("--seq-len", type=int, default=2048, help="for the attention term of FLOPs per token")
    p.add_argument("--optimizer", help="print the peak lr a run with this optimizer would use: the rule's law for it,"
                                       " else its default (launcher/optimizers.py)")
    return p


def _params_laws(ns, rule) -> tuple[list[str], float | None]:
    """(law names to look up in the rule, the lr where there is no law) for `params --optimizer`."""
    if ns.optimizer is None:
        return ["adamw"], None  # AdamW's law, and "-" where there is none
    name = ns.optimizer
    law_only = rule is not None and name in sizes.rule_laws(rule)  # e.g. `adana`, a user class's law
    if name not in optimizers.REGISTRY and not optimizers.is_user_class(name) and not law_only:
        raise UsageError(f"--optimizer {name}: unknown optimizer; known: {optimizers.known()}"
                         + (f", or a law of rule {ns.scaling_rule}: {', '.join(sizes.rule_laws(rule))}"
                            if rule is not None and sizes.rule_laws(rule) else ""))
    return optimizers.law_names(name), optimizers.default_lr(name)  # None: per size (sizes.default_lr)


def _params_rows(ns, rule, laws, fallback_lr) -> list[tuple]:
    """(label, ModelArgs, lr or None) for every preset, depth and rule size asked for."""
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
        if lr is None and ns.optimizer is not None:  # no law, no optimizer default: the per-size rule
            lr = sizes.default_lr(n["non_embedding"])
        print(f"{label:<14}{args.n_layers:>7}{args.dim:>6}{args.n_heads:>6}{args.n_kv_heads:>4}{args.ffn_hidden:>7}"
              f"{n['total']:>15,}{n['non_embedding']:>15,}{flops_per_token(args, ns.seq_len):>11.3e}"
              f"{(f'{lr:.3e}' if lr is not None else '-'):>10}")
    if ns.optimizer is not None:
        has_law = rule is not None and any(n in sizes.rule_laws(rule) for n in laws)
        print(f"lr: the peak lr of a run with --optimizer {ns.optimizer} and no --lr: "
              + (f"rule {ns.scaling_rule}'s law for {'/'.join(laws)}" if has_law else
                 (f"{fallback_lr:g}, its default" if fallback_lr is not None else
                  ("the profile's optimizer.params.lr, else " if ns.optimizer == "adamw" else "")
                  + "the per-size rule shown (modeling/sizes.py DEFAULT_LR_LAWS)")
                 + (f" (rule {ns.scaling_rule} has no law for it)" if ns.scaling_rule else "")))
