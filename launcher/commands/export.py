"""`zerotrain export RUN_DIR|CHECKPOINT --to DIR [--dtype float32|bfloat16] [--best]`.

Writes a Hugging Face directory that `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads as `LlamaForCausalLM` (`Qwen3ForCausalLM` for a QK-norm model): `config.json`,
`model.safetensors`, and the tokenizer files when the run's tokenizer is a Hugging Face one.

RUN_DIR means its newest complete checkpoint that verifies; with --best the one
checkpoints/best.json names (the lowest validation loss: the one users ship). The weights are the fp32 master weights, put
together by DeepSpeed's own consolidation (`deepspeed.utils.zero_to_fp32`) from every rank's
ZeRO-1/2/3 partition files in this one CPU process: no launch at the original world size. The
model's shape comes from RUN_DIR/config.json, written by the driver. The checkpoint's files are
DeepSpeed pickles that our own runs wrote; the directory written holds none.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

from zerotrain.cli_args import Parser
from zerotrain.dataio.errors import DataError
from zerotrain.dataio.tokenizer import load_tokenizer
from zerotrain.launcher.components import checkpoint
from zerotrain.launcher.errors import UsageError
from zerotrain.modeling import hf
from zerotrain.modeling.sizes import ModelArgs

DTYPES = ("float32", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def find_checkpoint(source: Path, best: bool = False) -> tuple[Path, Path]:
    """(checkpoint tag directory, run directory) for a run directory or a checkpoint directory.

    A run directory means its newest complete checkpoint that verifies (checksums in the marker),
    or with `best` the one checkpoints/best.json names (the lowest validation loss).
    """
    if (source / checkpoint.MARKER).is_file():
        if best:
            raise UsageError(f"export {source} --best: give the run directory, not a checkpoint")
        problem = checkpoint.verify(source)
        if problem:
            raise UsageError(f"export {source}: {problem}")
        return source, source.parent.parent
    if (source / "checkpoints").is_dir():
        if best:
            marked = checkpoint.read_best(source / "checkpoints")
            if marked is None:
                raise UsageError(f"export {source} --best: no checkpoints/best.json (the run never evaluated;"
                                 " train with --eval-every-steps)")
            tag = source / "checkpoints" / marked["tag"]
            problem = checkpoint.verify(tag) if (tag / checkpoint.MARKER).is_file() else "not complete"
            if problem:
                raise UsageError(f"export {source} --best: {tag}: {problem}")
            return tag, source
        done = checkpoint.complete_checkpoints(source / "checkpoints")
        if not done:
            raise UsageError(f"export {source}: the run has no complete checkpoint"
                             f" (no checkpoints/*/{checkpoint.MARKER})")
        tag = checkpoint.find_resume(source / "checkpoints", say=lambda *a: None)
        return tag, source
    if source.exists():
        raise UsageError(f"export {source}: neither a run directory nor a complete zerotrain checkpoint")
    raise UsageError(f"export {source}: no such file or directory")


def consolidated_state_dict(tag_dir: Path) -> dict:
    """fp32 weights from every rank's ZeRO partitions, by DeepSpeed's zero_to_fp32 (its chatter muted)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        raise UsageError(f"export {tag_dir}: no ZeRO partition files (*zero_pp_rank_*_optim_states.pt); export reads"
                         " checkpoints of ZeRO stage 1, 2 or 3 profiles")
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def copy_tokenizer(name: str, out: Path, tokenizer) -> list[str]:
    """Copy a Hugging Face tokenizer's files next to the weights; [] for the byte tokenizer."""
    if name == "bytes":
        return []
    src = Path(name)
    src_dir = src if src.is_dir() else src.parent
    if not (src_dir / "tokenizer.json").is_file():
        raise UsageError(f"export: the run's tokenizer {name} is gone (no tokenizer.json); it is needed next to"
                         " the weights")
    copied = []
    for file in TOKENIZER_FILES:
        if (src_dir / file).is_file():
            shutil.copyfile(src_dir / file, out / file)
            copied.append(file)
    if "tokenizer_config.json" not in copied:  # transformers needs a class name and the special tokens
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(src_dir / "tokenizer.json"))
        ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
        special = {key: tok.id_to_token(i) for key, i in ids.items() if i is not None}
        (out / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=2) + "\n")
        copied.append("tokenizer_config.json")
    return copied


def export(source: Path, out: Path, dtype: str = "float32", best: bool = False) -> dict:
    import torch

    tag_dir, run_dir = find_checkpoint(source, best)
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise UsageError(f"export {source}: no {saved} (the model's shape is read from it)")
    run = json.loads(saved.read_text())
    try:
        args = ModelArgs(**run["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"export {saved}: no valid model section ({e})") from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"export --to {out}: exists and is not an empty directory")
    try:
        tokenizer = load_tokenizer(run.get("tokenizer", "bytes"))
    except DataError as e:
        raise UsageError(f"export: the run's tokenizer cannot be loaded ({e})") from None

    state = consolidated_state_dict(tag_dir)
    tmp = out.with_name(out.name + ".partial")  # written whole, then renamed: no half-written DIR
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save(tmp, state, args, tokenizer.bos_id, tokenizer.eos_id, dtype=getattr(torch, dtype))
        tokenizer_files = copy_tokenizer(run.get("tokenizer", "bytes"), tmp, tokenizer)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ValueError):
            raise UsageError(f"export {tag_dir}: {e}") from None
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return {"checkpoint": tag_dir, "args": args, "tokenizer_files": tokenizer_files}


def main(argv: list[str]) -> None:
    p = Parser(prog="zerotrain export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--to", required=True, help="the Hugging Face directory to write (new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="tensor dtype in model.safetensors")
    p.add_argument("--best", action="store_true", help="the checkpoint checkpoints/best.json names (lowest val loss)")
    ns = p.parse_args(argv)
    done = export(Path(ns.source), Path(ns.to), ns.dtype, ns.best)
    arch = "Qwen3ForCausalLM" if done["args"].qk_norm else "LlamaForCausalLM"
    print(f"exported {done['checkpoint']} -> {ns.to} ({arch}, {ns.dtype})")
    print("tokenizer: " + (", ".join(done["tokenizer_files"]) if done["tokenizer_files"] else
                           "none written: the byte tokenizer is not a Hugging Face one (ids 0-255 are UTF-8 bytes,"
                           " 256 BOS, 257 EOS)"))
