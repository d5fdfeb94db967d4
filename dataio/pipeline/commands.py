"""The data subcommands of `zerotrain`, and the data summary printed before training.

    zerotrain prepare --data MIX.json --tokenizer T --out DIR    tokenize a mix into verified shards
    zerotrain verify DIR [--tokenizer T]                         check a prepared directory, measure reads
    zerotrain data-bench --data MIX|DIR [--seq-len --micro-batch --seconds]   loader tokens/s
    zerotrain tokenizer train --data MIX.json --vocab-size N --out DIR        byte-level BPE (HF format)

Bad input ends as exit status 2 with one line (zerotrain.launcher.errors.UsageError).
"""
from __future__ import annotations

import json
import argparse
import time
from pathlib import Path

from zerotrain.cli_args import Parser, exact_integer
from zerotrain.dataio.format.errors import DataError, UsageError
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.format.pieces import default_piece_len
from zerotrain.dataio.format.shards import read_manifest, read_speed, verify
from zerotrain.dataio.pipeline.prepare import prepare
from zerotrain.dataio.sources.readers import find_files, load_text_source
from zerotrain.dataio.sources.sft import ChatRenderer, is_sft, labelled_tokens
from zerotrain.dataio.sources.streamed import open_streamed, record_text, records
from zerotrain.dataio.sources.tokenizer import TRAINING_RECORD, HFTokenizer, load_tokenizer, train_bpe


def _run(fn, argv):
    try:
        return fn(argv)
    except DataError as e:
        raise UsageError(str(e)) from None


def _positive(name):
    def parse(text):
        try:
            v = exact_integer(text)  # 1e6 too; 2.5 and 1e400 refused (zerotrain/cli_args.py)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}"
                                             + ("" if str(e).startswith("not a number") else f" ({e})")) from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return v
    return parse


# --------------------------------------------------------------------------------------------

def prepare_main(argv):
    p = Parser(prog="zerotrain prepare", description="Tokenize a mix into shards + manifest.json.")
    p.add_argument("--data", required=True, help="mix JSON")
    p.add_argument("--tokenizer", default="bytes")
    p.add_argument("--out", required=True, help="new directory to write")
    p.add_argument("--shard-tokens", type=_positive("--shard-tokens"), default=100_000_000)
    p.add_argument("--max-tokens-per-source", type=_positive("--max-tokens-per-source"), default=None,
                   help="cap per source (for large hub datasets)")
    a = p.parse_args(argv)

    def go(_):
        tok = load_tokenizer(a.tokenizer)
        t0 = time.time()
        out = prepare(a.data, tok, a.out, a.shard_tokens, a.max_tokens_per_source)
        manifest = read_manifest(out)
        verify(out, manifest, tok)
        n = sum(s["tokens"] for s in manifest["sources"])
        print(f"prepared {out}: {len(manifest['shards'])} shards, {n:,} tokens, {manifest['dtype']},"
              f" verified; {time.time() - t0:.1f}s")
    _run(go, argv)


def verify_main(argv):
    p = Parser(prog="zerotrain verify", description="Check a prepared directory and measure read speed.")
    p.add_argument("dir")
    p.add_argument("--tokenizer", default=None, help="also check the shards were made with this tokenizer")
    p.add_argument("--seconds", type=float, default=2.0, help="how long to measure read speed")
    a = p.parse_args(argv)

    def go(_):
        root = Path(a.dir)
        manifest = read_manifest(root)
        t0 = time.time()
        results = verify(root, manifest, load_tokenizer(a.tokenizer) if a.tokenizer else None)
        dt = time.time() - t0
        total = sum(r["bytes"] for r in results)
        print(f"{'shard':<34}{'source':<14}{'documents':>12}{'tokens':>15}  sha256")
        for sh in manifest["shards"]:
            print(f"{sh['file']:<34}{sh['source']:<14}{sh['documents']:>12,}{sh['tokens']:>15,}"
                  f"  {sh['sha256'][:16]} ok")
        tok_s, byte_s = read_speed(root, manifest, a.seconds)
        print(f"verified {len(results)} shards ({total / 1e6:.1f} MB) in {dt:.2f}s: schema, counts, offsets,"
              f" token range, sha256 all match; tokenizer {manifest['tokenizer']['name']}")
        print(f"read speed (memory-mapped, page cache as it is): {tok_s / 1e6:,.0f}M tokens/s, {byte_s / 1e9:.2f} GB/s")
    _run(go, argv)


def bench(data_path: str, tokenizer: str = "bytes", seq_len: int = 2048, micro_batch: int = 8,
          seconds: float = 10.0, max_tokens: int | None = None, rank: int = 0, world: int = 1, seed: int = 1337,
          workers: int = 0, progress: bool = True, packing: str = "best-fit", piece_len: int | None = None) -> dict:
    """Run the loader alone; tokens/s, load time, per-source shares and epochs.
    piece_len: as in training, default_piece_len(seq_len) when None."""
    # Here, not at the top: the loader imports torch, which prepare, verify and tokenizer train never need.
    from zerotrain.dataio.pipeline.loader import Batches, load_data, open_data

    t0 = time.time()
    data = load_data(open_data(data_path, load_tokenizer(tokenizer)), piece_len or default_piece_len(seq_len),
                     world, workers, seq_len=seq_len)
    load_s = time.time() - t0
    batches = Batches(data, rank, world, seed, seq_len, micro_batch, {"workers": workers}, packing)
    first = batches.next()  # warm-up (and worker start-up) not timed
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(max_tokens) if max_tokens else None, unit="tok", unit_scale=True, desc="data-bench")
    n_tok = n_rows = n_real = 0
    t0 = time.time()
    while True:
        b = batches.next()
        if b is None:
            break
        n_tok += b["input_ids"].numel()
        n_real += b["real_tokens"]
        n_rows += b["input_ids"].shape[0]
        if bar is not None:
            bar.update(b["input_ids"].numel())
        dt = time.time() - t0
        if (max_tokens and n_tok >= max_tokens) or (not max_tokens and dt >= seconds):
            break
    dt = time.time() - t0
    if bar is not None:
        bar.close()
    per_source = batches.tokens_per_source()
    sizes = data.source_tokens()
    total = sum(per_source) or 1
    sources = []
    for spec, tok, (size, exact) in zip(data.specs, per_source, sizes):
        sources.append({"name": spec.name, "weight": spec.weight, "share": tok / total, "tokens": tok,
                        "epochs": tok / (size / world) if size else None})
    del first
    return {"tokens": n_tok, "seconds": dt, "tokens_per_s": n_tok / max(dt, 1e-9), "load_s": load_s,
            "efficiency": n_real / max(1, n_tok), "rows": n_rows, "sources": sources,
            "exhausted": batches.exhausted}


def data_bench_main(argv):
    p = Parser(prog="zerotrain data-bench", description="Measure the data loader alone, in tokens/s.")
    p.add_argument("--data", required=True, help="mix JSON or prepared directory")
    p.add_argument("--tokenizer", default="bytes")
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=2048)
    p.add_argument("--micro-batch", type=_positive("--micro-batch"), default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--tokens", type=_positive("--tokens"), default=None, help="stop after this many tokens instead")
    p.add_argument("--workers", type=int, default=0, help="background worker processes (as zerotrain.dataloader)")
    p.add_argument("--packing", choices=("best-fit", "greedy"), default="best-fit")
    p.add_argument("--world", type=_positive("--world"), default=1, help="pretend to be one rank of this many")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--piece-len", type=_positive("--piece-len"), default=None,
                   help="cut documents longer than this into pieces (default 8 x --seq-len, as in training)")
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.world:
        raise UsageError(f"--rank {a.rank}: must be in [0, --world {a.world})")

    def go(_):
        r = bench(a.data, a.tokenizer, a.seq_len, a.micro_batch, a.seconds, a.tokens, a.rank, a.world,
                  workers=a.workers, packing=a.packing, piece_len=a.piece_len)
        print(f"data-bench {a.data}: seq_len {a.seq_len} x micro_batch {a.micro_batch}, rank {a.rank}/{a.world},"
              f" tokenizer {a.tokenizer}, workers {a.workers}, packing {a.packing}")
        print(f"  load/verify {r['load_s']:.2f}s; {r['tokens']:,} tokens in {r['seconds']:.2f}s ="
              f" {r['tokens_per_s'] / 1e6:.2f}M tokens/s; packing efficiency {r['efficiency']:.2%}"
              " (real tokens / row slots)")
        print(f"  {'source':<16}{'weight':>8}{'share':>8}{'tokens':>15}{'epochs':>9}")
        for s in r["sources"]:
            ep = f"{s['epochs']:.3f}" if s["epochs"] is not None else "?"
            print(f"  {s['name']:<16}{s['weight']:>8.1%}{s['share']:>8.1%}{s['tokens']:>15,}{ep:>9}")
        if r["exhausted"]:
            print(f"  source {r['exhausted']!r} ran out (on_exhausted: stop)")
    _run(go, argv)


def tokenizer_main(argv):
    top = Parser(prog="zerotrain tokenizer", description="Tokenizers for zerotrain (one action: train).")
    actions = top.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("train", help="train a byte-level BPE on a mix (Hugging Face format)",
                           description="Train a byte-level BPE (Hugging Face format).")
    p.add_argument("--data", required=True, help="mix JSON")
    p.add_argument("--vocab-size", type=_positive("--vocab-size"), required=True, help="tokens in the vocabulary")
    p.add_argument("--out", required=True, help="new (or empty) directory for tokenizer.json")
    p.add_argument("--max-documents", type=_positive("--max-documents"), default=None,
                   help="train on at most this many documents (spread over the sources by weight)")
    a = top.parse_args(argv)

    def go(_):
        out = Path(a.out)
        if out.exists() and not out.is_dir():
            raise DataError(f"--out {out}: is a file, not a directory (tokenizer train writes a directory)")
        if out.exists() and any(out.iterdir()):
            raise DataError(f"--out {out}: exists and is not empty")
        mix = parse_mix(a.data)
        for spec in mix.sources:
            if spec.format == "tokens":
                raise DataError(f"{spec.where()}: format tokens is token ids already; a tokenizer is trained on text")

        def texts():
            for spec in mix.sources:
                limit = int(a.max_documents * spec.weight) + 1 if a.max_documents else None
                if spec.streamed:
                    for i, rec in enumerate(records(open_streamed(spec, 0, 1))):
                        if limit and i >= limit:
                            break
                        t = record_text(spec, rec, lambda why: None)
                        if t:
                            yield t
                else:
                    store = load_text_source(spec)
                    for d in range(min(len(store), limit or len(store))):
                        yield store.text(d)
        t0 = time.time()
        train_bpe(texts(), a.vocab_size, out)
        tok = HFTokenizer(out)
        print(f"trained byte-level BPE, vocab {tok.vocab_size:,} of the {a.vocab_size:,} asked, eos {tok.eos_id},"
              f" bos {tok.bos_id}, saved to {out} ({time.time() - t0:.1f}s)")
        record = json.loads((out / TRAINING_RECORD).read_text())
        if record["vocab_size_obtained"] < a.vocab_size:
            print(f"warning: the vocabulary came out smaller than --vocab-size {a.vocab_size:,}:"
                  f" {record['vocab_size_obtained']:,} tokens. Too little text: {record['documents']:,} document(s),"
                  f" {record['bytes']:,} bytes left no more pairs to merge; train on more text (--data, without"
                  f" --max-documents) or ask for a smaller vocabulary. Asked and obtained: {out / TRAINING_RECORD}")
    _run(go, argv)


# --------------------------------------------------------------------------------------------
# Before training
# --------------------------------------------------------------------------------------------

def describe_data(data, run_tokens: int) -> list[str]:
    """Per source: weight, size (tokens), its files, estimated epochs over the run, its documents
    (count, mean and max length) and the pieces cut from them, and warnings (repetition, a .txt file
    with few documents)."""
    bound = f"pieces of {data.piece_len:,}" if data.piece_len else "no piece bound"
    lines = [f"data: {data.kind} {data.path}, tokenizer {data.tokenizer.name}, {bound}; this run reads"
             f" {run_tokens:,} tokens"]
    for spec, store, (size, exact) in zip(data.specs, data.stores, data.source_tokens()):
        need = run_tokens * spec.weight
        where = spec.location() + _files_part(data, spec, store)
        files = store.files if data.kind == "mix" and store is not None else spec.paths
        if files and str(files[0]).endswith(".txt"):
            where += f", sample_by {spec.sample_by}"  # the default is "paragraph": show what applied
        if size:
            epochs = need / size
            lines.append(f"  {spec.name:<14} weight {spec.weight:6.1%}  {'' if exact else '~'}{size:,} tokens"
                         f"  ~{epochs:.2f} epochs over the run  ({where})")
            if store is not None:
                lines.append(" " * 17 + (_records_line(data, spec, store) if is_sft(spec) else
                                         _documents_line(data, store)))
            if spec.on_exhausted == "stop" and epochs > 1:
                lines.append(f"  WARNING: source {spec.name!r} runs out after ~{1 / epochs:.0%} of the run"
                             " (on_exhausted: stop): training will stop there")
            elif epochs > data.warn_epochs:
                lines.append(f"  WARNING: source {spec.name!r} will repeat ~{epochs:.1f} times"
                             f" (more than warn_epochs {data.warn_epochs:g})")
        else:
            lines.append(f"  {spec.name:<14} weight {spec.weight:6.1%}  size unknown (streamed)  ({where})")
            lines.append(" " * 17 + "documents not counted, none cut into pieces (streamed: read in order;"
                         " `zerotrain prepare` first to cut them)")
        if store is not None and store.note:
            lines.append(f"  WARNING: source {spec.name!r}: {store.note}")
        if store is not None and (store.bad_records or store.empty_records):
            lines.append(f"  note: source {spec.name!r}: skipped {store.bad_records} bad record(s)"
                         f"{' (first: ' + store.first_bad + ')' if store.first_bad else ''},"
                         f" {store.empty_records} empty")
    return lines


def _files_part(data, spec, store) -> str:
    """", 14 files" (the data files read; shards: the shard files); "" for a hub stream."""
    if store is not None:
        n, what = len(store.files), "shard file" if data.kind == "shards" else "file"
    elif spec.hf is None or spec.local_hf:  # a local source read as a stream: its files, found again (cheap)
        n, what = len(find_files(spec).files), "file"
    else:
        return ""
    return f", {n:,} {what}{'' if n == 1 else 's'}"


def _records_line(data, spec, store) -> str:
    """An SFT source, e.g. "1,200 chat records, mean 96 / max 250 tokens, 31% of the tokens (EOS included)
    take loss (responses); overflow truncate_prompt at seq len 256: truncated 3, dropped 1"."""
    n, total = len(store), int(store.lengths.sum())
    what = (f"{spec.format} records" + (f" ({ChatRenderer(data.tokenizer).name})" if spec.format == "chat" else ""))
    held = data.eval_stores[list(data.specs).index(spec)] if data.eval_stores else None
    if held is not None:  # the overflow counts below are the whole source's
        what += f" (+{len(held):,} held out for evaluation)"
    line = (f"{n:,} {what}, mean {total / max(1, n):,.0f} / max {store.longest:,} tokens,"
            f" {labelled_tokens(store) / max(1, total + n):.0%} of the tokens (EOS included) take loss (responses)")
    if data.seq_len is None:
        return line + "; kept whole (no --seq-len given)"
    line += f"; overflow {spec.overflow} at seq len {data.seq_len:,}: "
    if not (store.truncated or store.dropped):
        return line + "none too long"
    return line + ", ".join(f"{k} {v:,}" for k, v in (("truncated", store.truncated), ("dropped", store.dropped)) if v)


def _documents_line(data, store) -> str:
    """e.g. "1 document of 300,000 tokens, cut into 147 pieces of 2,048"."""
    unit = "tokens" if store.kind == "tokens" or data.tokenizer.name == "bytes" else "bytes (before tokenizing)"
    n, total = store.documents, int(store.lengths.sum())
    line = (f"1 document of {total:,} {unit}" if n == 1 else
            f"{n:,} documents, mean {total / n:,.0f} / max {store.longest:,} {unit}")
    if not store.cut_documents:
        return line + (f"; none longer than {store.piece_len:,}, none cut" if store.piece_len else "")
    pieces = len(store) - (n - store.cut_documents)
    what = "cut" if n == 1 else f"{store.cut_documents:,} cut"
    line += f", {what} into {pieces:,} pieces of {store.piece_len:,}"
    if store.piece_len != data.piece_len:  # make_pieces cut finer so every rank (and worker) gets a piece
        across = f"{data.world} rank(s)" + (f" x {data.workers} data worker(s)" if data.workers else "")
        asked = f"the bound {data.piece_len:,} leaves" if data.piece_len else "whole documents leave"
        line += f" ({asked} fewer pieces than {across}: cut finer so each gets one)"
    return line
