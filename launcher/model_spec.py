"""Which model a run trains, from the flags: exactly one of

    --model NAME                         a named preset (zerotrain.modeling.sizes.PRESETS; the default, debug)
    --depth D [--aspect-ratio A] [--head-dim H]
                                         the depth rule (zerotrain.modeling.sizes.depth_args)
    --scaling-rule NAME --heads H [--rules-file YAML]
                                         a heads-based rule (modeling/scaling_rules.yaml)
    --init-from HF_DIR | ORG/NAME[@REV]  a Hugging Face Llama / Qwen3 directory, or a hub model found through the
                                         Hugging Face cache (init_from_dir): its config.json is the
                                         architecture, its safetensors the starting weights

plus `--qk-norm` for the first three, and `--rope-theta` for all four (with --init-from it replaces the
checkpoint's base: continued pretraining at a longer context). Everything is checked here, before any process builds a
model or writes a file; a problem is a UsageError naming the flag.

With --init-from the model's tokenizer comes with it (`init_from_tokenizer`, the one resolution the command line,
recipes, `zerotrain plan`, pre-flight and the notebook's `finetune(model=HF_DIR)` share): without --tokenizer, the
directory's tokenizer.json (recorded with the source "init-from"); a directory without one trains with the byte
tokenizer only when its vocabulary is the byte tokenizer's. A --tokenizer whose vocabulary differs from the
directory's is refused, unless --swap-tokenizer says the swap is meant (then a warning).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.sources.hub import fetch_command, model_snapshot, split_name
from zerotrain.dataio.sources.tokenizer import ByteTokenizer, load_tokenizer, same_vocabulary
from zerotrain.launcher.config import RunConfig, value
from zerotrain.launcher.errors import UsageError
from zerotrain.modeling import hf, sizes
from zerotrain.modeling.sizes import ModelArgs, count_params, preset

DEPTH_ONLY = ("aspect_ratio", "head_dim")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(cfg, names) -> list[str]:
    return [n for n in names if value(cfg, n) is not None]


def resolve(cfg, vocab_size: int) -> tuple:
    """(ModelArgs, label for the run id, HF directory to load weights from or None)."""
    sources = _given(cfg, ("depth", "scaling_rule", "init_from"))
    if len(sources) > 1:
        raise UsageError(f"{_flag(sources[0])} and {_flag(sources[1])}: give one way to pick the model")
    if sources and cfg.model.preset is not None:
        raise UsageError(f"--model {cfg.model.preset} and {_flag(sources[0])}: give one way to pick the model")
    for name in DEPTH_ONLY:
        if value(cfg, name) is not None and cfg.model.depth is None:
            raise UsageError(f"{_flag(name)}: only used with --depth")
    if (cfg.model.heads is not None or cfg.model.rules_file is not None) and cfg.model.scaling_rule is None:
        which = "--heads" if cfg.model.heads is not None else "--rules-file"
        raise UsageError(f"{which}: only used with --scaling-rule")
    common = dict(vocab_size=vocab_size, max_seq_len=cfg.data.seq_len)
    if cfg.model.qk_norm is not None:
        common["qk_norm"] = cfg.model.qk_norm
    if cfg.model.rope_theta is not None:
        theta = cfg.model.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
            raise UsageError(f"--rope-theta: must be a number above 1, got {cfg.model.rope_theta!r}")
        common["rope_theta"] = float(cfg.model.rope_theta)

    if cfg.model.init_from is not None:
        if cfg.model.qk_norm is not None:
            raise UsageError("--qk-norm and --init-from: the Hugging Face config.json decides")
        where = f"--init-from {cfg.model.init_from}"
        directory = init_from_dir(cfg.model.init_from)
        try:
            hf_cfg = hf.read_config(directory)
            args = hf.args_from_config(hf_cfg, where)
            hf.check_weights(directory, args)
        except ValueError as e:
            msg = str(e).removeprefix(f"{directory}: ")
            if hub_model_name(cfg.model.init_from) and msg.startswith("no "):  # a snapshot cached in part
                repo, revision = split_name(cfg.model.init_from)
                msg += (f" in its cached snapshot {directory} (fetched in part, e.g. its tokenizer alone): "
                        f"`{fetch_command(repo, 'model', revision)}`")
            raise UsageError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        if vocab_size > hf_cfg["vocab_size"]:
            raise UsageError(f"{where}: vocab_size {hf_cfg['vocab_size']} is smaller than the tokenizer's {vocab_size}")
        if "rope_theta" in common:  # the weights load by name: the base is free to change (context extension)
            args = replace(args, rope_theta=common["rope_theta"])
        return args, "hf-" + _safe(cfg.model.init_from), str(directory)
    if cfg.model.depth is not None:
        try:
            args = sizes.depth_args(cfg.model.depth, cfg.model.aspect_ratio or 64, cfg.model.head_dim or 128, **common)
        except ValueError as e:
            raise UsageError(f"--depth {cfg.model.depth}: {e}") from None
        return args, f"d{cfg.model.depth}", None
    if cfg.model.scaling_rule is not None:
        if cfg.model.heads is None:
            raise UsageError(f"--scaling-rule {cfg.model.scaling_rule}: needs --heads H")
        try:
            rule = sizes.get_rule(cfg.model.scaling_rule, cfg.model.rules_file or sizes.RULES_FILE)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {cfg.model.scaling_rule}: {e}") from None
        try:
            args = sizes.rule_args(rule, cfg.model.heads, **common)
        except ValueError as e:
            raise UsageError(f"--scaling-rule {cfg.model.scaling_rule} --heads {cfg.model.heads}: {e}") from None
        return args, f"{cfg.model.scaling_rule}-h{cfg.model.heads}", None
    name = cfg.model.preset or "debug"
    try:
        args = preset(name, **common)
    except (KeyError, ValueError) as e:
        raise UsageError(f"--model {name}: {e.args[0]}") from None
    return args, name, None




def context_warnings(cfg: RunConfig, args: ModelArgs, init_from: str | None) -> list[str]:
    """--seq-len beyond the context an --init-from model was trained for (its max_position_embeddings): the
    positions past it were never trained (RoPE runs on; the loss there is the model's guess)."""
    if init_from is None or cfg.data.seq_len <= args.max_seq_len:
        return []
    return [f"--seq-len {cfg.data.seq_len} is longer than --init-from {cfg.model.init_from}'s max_position_embeddings"
            f" {args.max_seq_len} (the context it was trained for): positions past {args.max_seq_len} start"
            " untrained; a context extension usually raises --rope-theta too"]


def hub_model_name(init_from: str) -> bool:
    """`init_from` names a hub model ORG/NAME[@REVISION]: no path of that name exists (a path wins, as in
    transformers) and it has the hub's form, an organisation included (a bare word is more likely a mistyped path)."""
    return not Path(init_from).expanduser().exists() and split_name(init_from) is not None \
        and "/" in init_from.partition("@")[0]


def init_from_dir(init_from: str) -> Path:
    """The directory `--init-from` (or `model=`) names: a local path, or a hub model ORG/NAME[@REVISION]'s snapshot
    in the Hugging Face cache (zerotrain.dataio.sources.hub.model_snapshot, as --tokenizer resolves hub names:
    offline from the cache; online its config, safetensors and tokenizer files are fetched into it). UsageError (one line) for a
    hub name neither cached nor reachable, naming how to fetch it."""
    if not hub_model_name(init_from):
        return Path(init_from).expanduser()
    try:
        directory, _, _ = model_snapshot(init_from)
    except DataError as e:
        raise UsageError(f"--init-from {init_from}: no such directory; as a hub {e}") from None
    return directory


def describe_init_from(init_from: str | None) -> list[str]:
    """The start-up's and --dry-run's line for a hub model: which commit, found how and where ([] otherwise)."""
    if init_from is None or not hub_model_name(init_from):
        return []
    init_from_dir(init_from)  # its one-line refusal, if any, first
    return [f"hub: model {model_snapshot(init_from)[2]}"]


def init_from_tokenizer(init_from: str, given: str | None, swap: bool) -> tuple[str, str | None]:
    """(the tokenizer a run from `--init-from init_from` trains with, the warning to print or None), with
    `given` the --tokenizer given (None: not given) and `swap` --swap-tokenizer. UsageError (one line): a
    directory without a tokenizer and no --tokenizer, unless its vocabulary is the byte tokenizer's; a
    --tokenizer whose vocabulary is not the directory's without --swap-tokenizer. A directory that is not a
    Hugging Face model we can import (its config, its weights) is left to `resolve`, which names what is wrong."""
    where = f"--init-from {init_from}"
    directory = init_from_dir(init_from)
    try:  # a model we cannot import is refused by `resolve` naming what is wrong, before its tokenizer is asked for
        hf_cfg = hf.read_config(directory)
        hf.check_weights(directory, hf.args_from_config(hf_cfg, where))
    except ValueError:
        return given or ByteTokenizer.name, None
    if not (directory / "tokenizer.json").is_file():
        if given is not None:
            return given, None
        if _byte_vocabulary(hf_cfg):
            return ByteTokenizer.name, None
        slow = " (only a slow tokenizer's files: save it with a fast tokenizer.json)" \
            if (directory / "tokenizer_config.json").is_file() else ""
        raise UsageError(f"{where}: no tokenizer.json in the directory{slow}, and its vocabulary"
                         f" ({hf_cfg.get('vocab_size')}) is not the byte tokenizer's; give --tokenizer (the one the model"
                         " was trained with)")
    # a hub model's tokenizer by its hub name pinned to the snapshot's commit (recorded, exported, resolved again
    # offline on resume as --tokenizer ORG/NAME@COMMIT), a directory's by its path
    own = f"{split_name(init_from)[0]}@{directory.name}" if hub_model_name(init_from) else init_from
    if given is None:
        return own, None
    try:
        ours, theirs = load_tokenizer(own), load_tokenizer(given)
    except DataError as e:
        raise UsageError(str(e)) from None
    if same_vocabulary(ours, theirs):
        return given, None
    change = (f"--tokenizer {given} (vocabulary {theirs.vocab_size:,}) is not the tokenizer of {where} (vocabulary"
              f" {ours.vocab_size:,}, {ours.name})")
    if not swap:
        raise UsageError(f"{change}: the model would see other ids for the same text; leave --tokenizer out to use"
                         " the model's, or add --swap-tokenizer to train it on another one")
    return given, f"{change}: --swap-tokenizer: the model is trained on another tokenizer than the one it learned"


def _byte_vocabulary(hf_cfg: dict) -> bool:
    """The directory's vocabulary is zerotrain's byte tokenizer's: its size (padded as ours pads it) and its EOS
    (an export of a byte-tokenizer run writes both)."""
    vocab = hf_cfg.get("vocab_size")
    padded = sizes.ModelArgs(vocab_size=ByteTokenizer.vocab_size).vocab_size
    return (isinstance(vocab, int) and ByteTokenizer.vocab_size <= vocab <= padded
            and hf_cfg.get("eos_token_id") == ByteTokenizer.eos_id)


def _safe(path: str) -> str:
    name = Path(path).resolve().name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"


def rule_law_lr(values: dict, law_names: list[str]) -> float | None:
    """The lr the --scaling-rule's law gives for the first of `law_names` it has (launcher/hparams.py), or
    None (no rule, no law, or a rule problem `resolve` reports with the flag named)."""
    if not values.get("scaling_rule") or values.get("heads") is None:
        return None
    try:
        rule = sizes.get_rule(values["scaling_rule"], values.get("rules_file") or sizes.RULES_FILE)
        overrides = {} if values.get("qk_norm") is None else {"qk_norm": values["qk_norm"]}
        args = sizes.rule_args(rule, values["heads"], **overrides)
    except (ValueError, TypeError):
        return None
    return sizes.rule_lr(rule, count_params(args)["non_embedding"], law_names)


