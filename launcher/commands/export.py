"""`zerotrain export RUN_DIR|CHECKPOINT --to DIR [--dtype float32|bfloat16] [--best] [--max-shard-size 5GB]
[--no-check]`.

Writes a Hugging Face directory shaped as `save_pretrained` and the Hub leave one, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as `LlamaForCausalLM` (`Qwen3ForCausalLM`
for a QK-norm model): safetensors shards of at most --max-shard-size (default 5GB, as save_pretrained;
`model.safetensors`, or `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`),
`config.json` and `generation_config.json` (bos/eos/pad from the tokenizer) written by transformers' own
config classes (zerotrain.modeling.hf.save), the tokenizer's files when it is a Hugging Face one (a hub
tokenizer is resolved again by the name the run recorded, pinned to its commit; `model_max_length` set to the
trained --seq-len), the chat template the run rendered its chat records with (the tokenizer's own, kept; else
zerotrain's plain ChatML as chat_template.jinja, so `apply_chat_template` on the export renders a record as the run
did), and a README.md model card naming the tokenizer (a hub name as given, else by vocabulary size and hash) and
the data's format.

RUN_DIR means its newest complete checkpoint that verifies; with --best the one
checkpoints/best.json names (the lowest validation loss: the one users ship). The weights are the fp32 master weights, put
together by DeepSpeed's own consolidation (`deepspeed.utils.zero_to_fp32`) from every rank's
ZeRO-1/2/3 partition files in this one CPU process: no launch at the original world size. The
model's shape comes from RUN_DIR/config.json, written by the driver. The checkpoint's files are
DeepSpeed pickles that our own runs wrote; the directory written holds none.

Checked export (`--no-check` skips it, for a model too large to hold twice in CPU memory): after
writing, DIR is loaded with AutoModelForCausalLM (in the export's dtype) and its loss on a fixed batch
is compared with the live model's: the checkpoint's consolidated fp32 weights in our own Transformer.
The batch is up to CHECK_ROWS x CHECK_LEN tokens of the documents the run held out for evaluation
(re-drawn from its mix with its seed and --eval-tokens, as the driver draws them) or of its
--eval-data; a run that held out nothing, or whose data is not readable here, gets a fixed batch of
pseudo-random token ids (seed 0), and the check says which. Both models see plain causal rows
(transformers' Llama has no document mask). The relative difference |export - live| / live is printed
and written into the model card. Beyond CHECK_TOLERANCE the command exits 10
(`export-check-failed`, launcher/ends.py) with one line, and DIR stays for inspection, its card
saying the check failed. The tolerance: fp32 1e-4 (the same weights in two implementations:
measured 8e-8 to 1e-7 on the tests' models); bf16 1e-2 (the weights are rounded to bf16's 8
significant bits, up to 2^-9 relative each, and the export computes in bf16 too: the bound leaves room
for that on a trained model; measured 3e-7 and 4e-5 on the tests' near-initial models). On a model
near its initialisation even a real conversion bug moves the loss little (the embedding rows shifted
by one: 2.8e-3 relative, caught at fp32's bound, not at bf16's): export fp32 to check such a model.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import torch

from zerotrain import __version__
from zerotrain.cli_args import Parser
from zerotrain.dataio.format.errors import DataError, first_line
from zerotrain.dataio.pipeline.loader import load_data, open_data
from zerotrain.dataio.sources.holdout import holdout_rows, mix_rows
from zerotrain.dataio.sources.hub import TOKENIZER_FILES
from zerotrain.dataio.sources.sft import PLAIN_CHAT_TEMPLATE
from zerotrain.dataio.sources.tokenizer import load_tokenizer
from zerotrain.launcher import model_spec
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.ends import EXIT_EXPORT_CHECK
from zerotrain.launcher.errors import UsageError, ZerotrainError, fail
from zerotrain.launcher.settings import INIT_FROM
from zerotrain.modeling import hf
from zerotrain.modeling.sizes import ModelArgs, count_params

DTYPES = ("float32", "bfloat16")
CHECK_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}  # relative loss difference (module docstring)
CHECK_ROWS, CHECK_LEN = 4, 256  # the fixed batch of the check: at most 4 rows of 256 tokens


class ExportCheckFailed(ZerotrainError):
    """The export's loss differs from the checkpoint's beyond tolerance (exit EXPORT_CHECK: 10)."""


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
    """fp32 weights from every rank's ZeRO partitions, by DeepSpeed's zero_to_fp32 (its chatter and progress
    bars muted: an error of ours stays one line; one of DeepSpeed's is raised). A checkpoint saved with the
    optimizer swapped to NVMe keeps its fp32 partitions in TAG/offloaded_tensors/, which zero_to_fp32 does not
    read: those are read from there (ds_compat.swapped_fp32_state_dict), the rest is zero_to_fp32's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        raise UsageError(f"export {tag_dir}: no ZeRO partition files (*zero_pp_rank_*_optim_states.pt); export reads"
                         " checkpoints of ZeRO stage 1, 2 or 3 profiles")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if (tag_dir / "offloaded_tensors").is_dir():
            try:
                return ds_compat.swapped_fp32_state_dict(tag_dir)
            except ValueError as e:
                raise UsageError(f"export {tag_dir}: its fp32 weights were swapped to NVMe (offloaded_tensors/): {e}")\
                    from None
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def live_model(state: dict, args: ModelArgs, where: str):
    """Our Transformer (CPU, eval mode) holding a consolidated state dict's tensors themselves (built on
    the meta device and assigned: no second copy of the weights)."""
    from zerotrain.modeling.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    missing = set(model.load_state_dict(state, strict=False, assign=True).missing_keys)
    if args.tie_embeddings:  # assign replaced the embedding's Parameter: tie the head to the new one
        model.lm_head.weight = model.embed_tokens.weight
    if missing - ({"lm_head.weight"} if args.tie_embeddings else set()):
        raise UsageError(f"{where}: the checkpoint lacks {sorted(missing)[0]}")
    return model.eval()


def copy_tokenizer(tokenizer, out: Path, seq_len: int | None = None, chat_template: str | None = None) -> list[str]:
    """Copy a Hugging Face tokenizer's files (those AutoTokenizer reads, the chat template included)
    next to the weights; [] for the byte tokenizer. `seq_len`: the trained context, written as the tokenizer's
    model_max_length (so a trainer's default max length does not exceed it); `chat_template`: the template the run
    rendered its chats with when the tokenizer brought none, written as chat_template.jinja (where transformers 5
    saves one, and reads it)."""
    if tokenizer.name == "bytes":
        return []
    copied = [f for f in TOKENIZER_FILES if (tokenizer.directory / f).is_file()]
    for file in copied:
        shutil.copyfile(tokenizer.directory / file, out / file)  # a hub cache's symlinks: their content
    if "tokenizer_config.json" not in copied:  # transformers needs a class name and the special tokens
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer.directory / "tokenizer.json"))
        ids = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
        special = {key: tok.id_to_token(i) for key, i in ids.items() if i is not None}
        (out / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=2) + "\n")
        copied.append("tokenizer_config.json")
    if seq_len is not None:
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": seq_len}, indent=2) + "\n")
    if chat_template is not None and tokenizer.chat_template is None:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        copied.append("chat_template.jinja")
    return copied


def chat_format(run: dict, tokenizer) -> tuple[str | None, str | None]:
    """(the template the run rendered its chat records with when its tokenizer has none, else None; the words
    the model card says the run's data was in)."""
    formats = {s.get("format", "text") for s in run.get("sources", [])}
    words = []
    template = None
    if "chat" in formats:
        if tokenizer.chat_template is not None:
            words.append("chat records rendered with the tokenizer's own chat template (kept here)")
        else:
            template = PLAIN_CHAT_TEMPLATE
            words.append("chat records rendered with zerotrain's plain ChatML template (`<|im_start|>ROLE\\nCONTENT"
                         "<|im_end|>\\n` as text" + ("" if tokenizer.name == "bytes" else
                                                       ", written here as chat_template.jinja") + ")")
    if "sft" in formats:
        words.append("prompt/response records (prompt, separator, response)")
    if "text" in formats:
        words.append("text documents")
    return template, "; ".join(words) or None


def tokenizer_words(run: dict, tokenizer) -> str:
    """The model card's name for the tokenizer: the hub name as the run was given it, else its content (never a
    path, which means nothing where the card is read)."""
    if tokenizer.name == "bytes":
        return ("zerotrain's byte tokenizer (ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS; not a Hugging Face one, so"
                " no tokenizer files here)")
    content = f"vocabulary {tokenizer.vocab_size:,}, tokenizer.json sha256 {tokenizer.sha256[:16]}"
    if tokenizer.origin is not None:  # a hub name: the run records it pinned to its commit
        given = run.get("run", {}).get("tokenizer") or tokenizer.name
        return f"`{given}` from the Hugging Face Hub (`{tokenizer.name}`; {content}); its files are here"
    return f"a Hugging Face tokenizer, its files here ({content})"


# -- the check -----------------------------------------------------------------------------------

def check_batch(run: dict, tokenizer, args: ModelArgs):
    """(input_ids, labels, what they are): the fixed batch of the check (module docstring)."""
    cfg = run.get("run", {})
    length = min(CHECK_LEN, cfg.get("seq_len") or CHECK_LEN, args.max_seq_len)
    rows, why = None, "the run held out no documents (no --eval-tokens) and has no --eval-data"
    try:  # the driver's own draw (launcher/run_plan.py _load_plan_data), packed into rows of `length`
        if cfg.get("eval_data"):
            what = f"--eval-data {cfg['eval_data']}"
            rows = mix_rows(load_data(open_data(cfg["eval_data"], tokenizer), seq_len=length, verify="quick"), length,
                            CHECK_ROWS * length)
        elif cfg.get("eval_tokens") and cfg.get("data"):
            what = f"the documents the run held out of {cfg['data']}"
            data = load_data(open_data(cfg["data"], tokenizer), holdout=(cfg.get("seed"), cfg["eval_tokens"]),
                             seq_len=length, verify="quick")
            rows = holdout_rows(data.eval_stores, data.specs, tokenizer, length)
            why = "every source of the run is streamed: none held out"
    except DataError as e:
        rows, why = None, f"the run's data cannot be read here ({first_line(e)})"
    if rows:
        ids = torch.cat([r["input_ids"] for r in rows.values()])[:CHECK_ROWS]
        labels = torch.cat([r["labels"] for r in rows.values()])[:CHECK_ROWS]
        return ids, labels, f"{int((labels[:, 1:] != -100).sum()):,} tokens of {what}"
    ids = torch.randint(0, tokenizer.vocab_size, (CHECK_ROWS, length), generator=torch.Generator().manual_seed(0))
    return ids, ids.clone(), f"{ids.numel() - CHECK_ROWS:,} pseudo-random token ids (seed 0; {why})"


def check_export(hf_dir: Path, state: dict, args: ModelArgs, batch, dtype: str, where: str) -> dict:
    """The live model's loss and the export's (loaded by transformers, in `dtype`) on `batch`."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    ids, labels, what = batch
    model = live_model(state, args, where)
    with torch.no_grad():
        live = float(model(ids, labels=labels))
    del model
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # "Loading weights" bars: the one line below says what happened
    try:
        theirs = AutoModelForCausalLM.from_pretrained(hf_dir).to(getattr(torch, dtype)).eval()  # bf16 values: exact
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
    with torch.no_grad():
        exported = float(theirs(input_ids=ids, labels=labels).loss)
    del theirs
    diff = abs(exported - live) / abs(live)
    return {"live": live, "export": exported, "relative": diff, "tolerance": CHECK_TOLERANCE[dtype],
            "passed": diff <= CHECK_TOLERANCE[dtype], "batch": what, "dtype": dtype}


def check_line(c: dict) -> str:
    return (f"check: loss on {c['batch']}: checkpoint (fp32, zerotrain) {c['live']:.6f}, export ({c['dtype']},"
            f" transformers) {c['export']:.6f}, relative difference {c['relative']:.2e}"
            f" ({'within' if c['passed'] else 'BEYOND'} the {c['dtype']} tolerance {c['tolerance']:g})")


def model_card(run: dict, meta: dict, tag_dir: Path, args: ModelArgs, dtype: str, tokenizer,
               check: dict | None) -> str:
    """README.md: the Hub's front matter, where the weights come from, and the check's figure."""
    arch = hf.ARCHITECTURES["qwen3" if args.qk_norm else "llama"]
    n = count_params(args)
    if check is None:
        checked = "Not checked (`--no-check`)."
    else:
        checked = (f"Loss on a fixed batch of {check['batch']}, as plain causal rows: the checkpoint's fp32 weights in"
                   f" zerotrain's model {check['live']:.6f}; this directory loaded with `AutoModelForCausalLM` in"
                   f" {dtype} {check['export']:.6f}; relative difference {check['relative']:.2e}, tolerance"
                   f" {check['tolerance']:g}: **{'passed' if check['passed'] else 'FAILED: do not ship this export'}**"
                   ".")
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- zerotrain", "---", "",
        f"# {run.get('run_id', tag_dir.parent.parent.name)}", "",
        f"A {arch} ({n['total']:,} parameters, {dtype}) exported by zerotrain {__version__} from checkpoint"
        f" `{tag_dir.name}` (step {meta.get('step')}, {meta.get('tokens_seen', 0):,} tokens seen) of run"
        f" `{run.get('run_id', '')}`.", "",
        f"- tokenizer: {tokenizer_words(run, tokenizer)}",
        *([f"- data format: {fmt}"] if (fmt := chat_format(run, tokenizer)[1]) else []),
        *bos_words(run, tokenizer),
        f"- layers {args.n_layers}, hidden {args.dim}, heads {args.n_heads} (kv {args.n_kv_heads}), vocabulary"
        f" {args.vocab_size:,}, context {args.max_seq_len:,}"
        + (f" (trained on rows of {seq_len:,} tokens)" if (seq_len := run.get("run", {}).get("seq_len")) else ""), "",
        "## Export check", "", checked, ""])


def bos_words(run: dict, tokenizer) -> list[str]:
    """The card's line for a run whose documents began with BOS ("bos": true in its mix): prompts should too. A
    tokenizer that puts it before every text itself (a Llama's) does so for `encode`: said as well."""
    if not any(s.get("bos") for s in run.get("sources") or []) or tokenizer.bos_id is None:
        return []
    text = tokenizer.special_text(tokenizer.bos_id)
    how = ("this tokenizer's `encode` puts it first" if getattr(tokenizer, "adds_bos", False) else
           "this tokenizer does not add it: start a prompt's ids with it")
    return [f"- documents began with BOS (id {tokenizer.bos_id}{f', `{text}`' if text else ''}): {how}"]


# -- the command ---------------------------------------------------------------------------------

def base_generation_config(run: dict) -> Path | None:
    """The generation_config.json of the --init-from model a run started from, when the run trained with that
    model's own tokenizer: its end-of-text ids (Llama 3 Instruct's list, <|eot_id|> among them, where the tokenizer
    names one) and its sampling defaults are the model's, which a generation_config written from the tokenizer
    would drop. None otherwise (a swapped tokenizer, no such file, a directory gone, a JSON that is no object)."""
    init_from = run.get("run", {}).get("init_from")
    if not init_from or (run.get("run_sources") or {}).get("tokenizer") != INIT_FROM:
        return None
    try:
        file = model_spec.init_from_dir(init_from) / "generation_config.json"
        return file if file.is_file() and isinstance(json.loads(file.read_text()), dict) else None
    except (UsageError, OSError, ValueError):
        return None


def run_tokenizer(run: dict, saved: Path, what: str):
    """The tokenizer a run trained with (config.json's "tokenizer"), checked against the sha256 of its
    tokenizer.json that the run recorded: a file changed or replaced since (another at the same path) is
    refused in one line rather than shipped with weights that learned other ids. Runs that recorded no sha256
    (before 2026-11-29) are taken as they are."""
    try:
        tokenizer = load_tokenizer(run.get("tokenizer", "bytes"))
    except DataError as e:
        raise UsageError(f"{what}: the run's tokenizer cannot be loaded ({e})") from None
    want, got = run.get("tokenizer_sha256"), getattr(tokenizer, "sha256", None)
    if want and got and want != got:
        raise UsageError(f"{what}: the run's tokenizer {tokenizer.name} is not the one it trained with (sha256"
                         f" {got[:16]}..., {saved} records {want[:16]}...): put that tokenizer.json back, or give"
                         " the one the run used")
    return tokenizer


def export(source: Path, out: Path, dtype: str = "float32", best: bool = False, max_shard_size: int | str = "5GB",
           check: bool = True) -> dict:
    """Write the Hugging Face directory; returns {"checkpoint", "args", "tokenizer_files", "weight_files",
    "check" (None with check=False)}. A failed check raises ExportCheckFailed after the directory is written."""
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
    tokenizer = run_tokenizer(run, saved, "export")

    state = consolidated_state_dict(tag_dir)
    tmp = out.with_name(out.name + ".partial")  # written whole, then renamed: no half-written DIR
    shutil.rmtree(tmp, ignore_errors=True)
    result = None
    try:
        weight_files = hf.save(tmp, state, args, tokenizer.bos_id, tokenizer.eos_id, dtype=getattr(torch, dtype),
                               pad_id=tokenizer.pad_id, max_shard_size=max_shard_size)
        base = base_generation_config(run)
        if base is not None:  # the model's own (its eos list, its sampling defaults), not ours from the tokenizer
            shutil.copyfile(base, tmp / "generation_config.json")
        tokenizer_files = copy_tokenizer(tokenizer, tmp, run.get("run", {}).get("seq_len"),
                                         chat_format(run, tokenizer)[0])
        if check:
            result = check_export(tmp, state, args, check_batch(run, tokenizer, args), dtype, f"export {tag_dir}")
        (tmp / "README.md").write_text(model_card(run, checkpoint.read_meta(tag_dir), tag_dir, args, dtype,
                                                  tokenizer, result))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ValueError):
            raise UsageError(f"export {tag_dir}: {e}") from None
        raise
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    done = {"checkpoint": tag_dir, "args": args, "tokenizer_files": tokenizer_files, "weight_files": weight_files,
            "check": result}
    if result is not None and not result["passed"]:
        raise ExportCheckFailed(f"export {tag_dir} -> {out}: the export's loss differs from the checkpoint's by"
                                f" {result['relative']:.2e} relative ({result['export']:.6f} vs {result['live']:.6f}),"
                                f" beyond the {dtype} tolerance {result['tolerance']:g}; do not ship it")
    return done


def shard_size(text: str) -> int | str:
    """--max-shard-size: bytes, or a size as save_pretrained takes it ("5GB", "500MB", "100KB"), checked by
    huggingface_hub's own parser (the one save_pretrained uses)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    value = int(text) if text.isdigit() else text
    try:
        split_torch_state_dict_into_shards({}, max_shard_size=value)  # parses the size, splits nothing
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes or a size like 5GB, 500MB, 100KB") from None
    number = re.match(r"\s*(\d+(\.\d*)?)", text)
    if number is None or float(number.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def main(argv: list[str]) -> None:
    p = Parser(prog="zerotrain export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--to", required=True, help="the Hugging Face directory to write (new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="tensor dtype of the safetensors files")
    p.add_argument("--best", action="store_true", help="the checkpoint checkpoints/best.json names (lowest val loss)")
    p.add_argument("--max-shard-size", type=shard_size, default="5GB", metavar="SIZE",
                   help="largest safetensors shard, as save_pretrained: bytes or 5GB, 500MB, 100KB")
    p.add_argument("--no-check", action="store_true", help="skip loading the export with transformers and"
                                                           " comparing its loss with the checkpoint's")
    ns = p.parse_args(argv)
    try:
        done = export(Path(ns.source), Path(ns.to), ns.dtype, ns.best, ns.max_shard_size, not ns.no_check)
    except ExportCheckFailed as e:
        fail(str(e), EXIT_EXPORT_CHECK)
    arch = "Qwen3ForCausalLM" if done["args"].qk_norm else "LlamaForCausalLM"
    files = done["weight_files"]
    print(f"exported {done['checkpoint']} -> {ns.to} ({arch}, {ns.dtype}, "
          + (files[0] if len(files) == 1 else f"{len(files)} shards + {hf.INDEX_FILE}") + ")")
    print("tokenizer: " + (", ".join(done["tokenizer_files"]) if done["tokenizer_files"] else
                           "none written: the byte tokenizer is not a Hugging Face one (ids 0-255 are UTF-8 bytes,"
                           " 256 BOS, 257 EOS)"))
    print(check_line(done["check"]) if done["check"] else "check: skipped (--no-check)")
