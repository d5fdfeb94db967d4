"""Data-path benchmark: zerotrain's packed loader against what a user of the
Hugging Face stack would pack with, on the same documents (the demo mix, byte-tokenized, EOS
appended to each document as our loader does):

- ours: `zerotrain.dataio.pipeline.commands.bench` (the training loader alone: best-fit packing into fixed rows with
  per-document positions and labels, as torch tensors) from prepared shards, and from the mix's
  text with the bytes tokenizer and with a BPE-8192 tokenizer (tokenizing on the fly);
- TRL `pack_dataset(strategy="bfd")` (best-fit decreasing: truncates documents longer than a row)
  and `"bfd_split"` (splits them instead, keeping every token), on a `datasets.Dataset` of token ids;
- `datasets.map` concatenate-and-chunk (the `run_clm.py` recipe: concatenate, cut every seq_len,
  drop the remainder), on the same Dataset.

tokens/s: tokens in per second of packing (for ours: tokens out of the loader, padding included;
for the others the Dataset already holds token ids, so tokenizing is not in their figure).
Packing efficiency: real tokens / (rows x seq_len) with rows padded to seq_len, as they are trained.
Every method runs once as warm-up, then BENCH_REPS (default 3) times, alternating.
"""
from __future__ import annotations

import os
import sys
import time

from harness import TINY, MissingDependency, bpe_dir, demo_mix, median, need, shards_dir

REPS = int(os.environ.get("BENCH_REPS", "1" if TINY else "3"))
SEQ_LENS = (256,) if TINY else (256, 2048)
OURS_SECONDS = 0.3 if TINY else 2.0


def documents():
    """The demo mix's documents as byte token ids, EOS appended: (pyarrow list array, lengths)."""
    import numpy as np
    import pyarrow as pa

    from zerotrain.dataio.pipeline.loader import load_data, open_data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    data = load_data(open_data(str(demo_mix()), tok))
    docs = [np.append(np.asarray(s.doc(d), np.int32), tok.eos_id) for s in data.stores for d in range(len(s))]
    if TINY:
        docs = docs[:2000]
    lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
    offsets = np.zeros(len(docs) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs))), lengths


def group_texts(examples, seq_len):
    """transformers' examples/pytorch/language-modeling/run_clm.py: concatenate and chunk."""
    from itertools import chain

    concatenated = list(chain(*examples["input_ids"]))
    total = (len(concatenated) // seq_len) * seq_len
    return {"input_ids": [concatenated[i:i + seq_len] for i in range(0, total, seq_len)]}


def bench_packing_baselines() -> list[dict]:
    import datasets
    import numpy as np
    import pyarrow as pa

    from zerotrain.dataio.pipeline.commands import bench

    datasets.disable_progress_bars()
    array, lengths = documents()
    ds = datasets.Dataset(pa.table({"input_ids": array}))
    n_in = int(lengths.sum())
    rows, skipped = [], []
    try:
        trl = need("trl", "trl")
    except MissingDependency as e:
        trl = None
        skipped.append(("TRL pack_dataset", f"not run: {e}"))
        print(f"benchmark packing_baselines: TRL baseline skipped: {e}", file=sys.stderr, flush=True)
    shards, bpe = str(shards_dir()), str(bpe_dir())
    mix = str(demo_mix())
    for seq in SEQ_LENS:
        def ours(path, tokenizer):
            def run():
                r = bench(path, tokenizer, seq, 8, seconds=OURS_SECONDS, progress=False)
                return r["tokens_per_s"], r["efficiency"], 1.0, None
            return run

        def packed_stats(out, t):
            lens = out.data.column("input_ids").combine_chunks().value_lengths().to_numpy()
            kept = int(lens.sum())
            return n_in / t, kept / (len(lens) * seq), kept / n_in, len(lens)

        def trl_pack(strategy):
            def run():
                t0 = time.perf_counter()
                out = trl.pack_dataset(ds, seq, strategy=strategy)
                return packed_stats(out, time.perf_counter() - t0)
            return run

        def chunked():
            t0 = time.perf_counter()
            out = ds.map(group_texts, batched=True, fn_kwargs={"seq_len": seq}, load_from_cache_file=False)
            return packed_stats(out, time.perf_counter() - t0)

        methods = {"ours: prepared shards (uint16), best-fit": ours(shards, "bytes"),
                   "ours: mix text, bytes tokenizer, best-fit": ours(mix, "bytes"),
                   "ours: mix text, BPE-8192 on the fly, best-fit": ours(mix, bpe),
                   "datasets.map concatenate-and-chunk (run_clm)": chunked}
        if trl is not None:
            methods["TRL pack_dataset bfd (truncates)"] = trl_pack("bfd")
            methods["TRL pack_dataset bfd_split"] = trl_pack("bfd_split")
        for name, run in list(methods.items()):  # warm-up: imports, caches, first-call costs
            try:
                run()
            except ValueError as e:  # an older TRL without this strategy
                del methods[name]
                skipped.append((name, f"not run: {e}"))
        got = {name: [] for name in methods}
        for _ in range(REPS):
            for name, run in methods.items():
                got[name].append(run())
        for name, results in got.items():
            tps = [r[0] for r in results]
            eff, kept = results[-1][1], results[-1][2]
            cut = ""
            if name.startswith("datasets.map"):
                ends = np.cumsum(lengths)
                crosses = (ends - lengths) // seq != (ends - 1) // seq
                cut = f", cuts {np.mean(crosses & (lengths <= seq)):.1%} of the documents that fit in a row"
            rows.append({"benchmark": f"packing: {name}", "setting": f"seq {seq}; demo mix, {len(lengths):,} documents,"
                         f" {n_in / 1e6:.1f}M tokens", "result": f"{median(tps) / 1e6:.1f}M tokens/s"
                         f" (min-max {min(tps) / 1e6:.1f}-{max(tps) / 1e6:.1f}, n={len(tps)}); efficiency {eff:.2%},"
                         f" tokens kept {kept:.2%}{cut}", "target": ""})
    for name, why in dict.fromkeys(skipped):
        rows.append({"benchmark": f"packing: {name}", "result": why})
    return rows
