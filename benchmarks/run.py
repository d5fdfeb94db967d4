"""`make bench`: every benchmark, or the named ones, printed as one table. Performance is measured
here, never asserted in timed tests (tests/test_benchmarks.py only runs each entry at a tiny size).

    python benchmarks/run.py                 everything (~10-15 min on the 2-core development machine)
    python benchmarks/run.py NAME [NAME ...] only those; `--list` names them
    BENCH_TINY=1 python benchmarks/run.py    every entry at a tiny size (the smoke test's)

An unknown name stops before anything runs (one line, exit 2). A baseline whose optional package
is missing is left out with one line naming what to install (`pip install -e .[bench]`); the
other benchmarks still run. Each row carries the 1-minute load average at the benchmark's start
and end: this machine is shared, and a figure taken under load says so. Results with their date,
machine and command: benchmarks/RESULTS.md.

To add a benchmark: a function returning rows (dicts with the keys of COLUMNS, `load` filled in
here), registered in BENCHMARKS with its name and one line saying what it compares.

Training (benchmarks/steps.py, the programs in benchmarks/step_worker.py): `train_step` (1 rank,
zerotrain ZeRO-2/3 vs a plain PyTorch loop, HF Llama, the HF Trainer with DeepSpeed; MFU against
the matmul peak measured in the same run) and `two_ranks` (deepspeed launcher vs torchrun DDP,
scaling efficiency; zerotrain's own collectives and host syncs per step; data wait).
Start-up, shard verification, checkpoints and packing baselines: benchmarks/startup.py,
benchmarks/checkpoints.py, benchmarks/packing_baselines.py; fused q/k/v and gate/up weights against our
separate projections: benchmarks/projections.py; the chunked loss's memory against full logits:
benchmarks/loss_memory.py; bf16 against fp32 through the driver: benchmarks/precision.py; ZeRO-Offload's step
time on this CPU: benchmarks/offload.py; sequence parallelism against data parallelism at the same tokens per step:
benchmarks/sequence_parallel.py.

Data benchmarks (dataio): the demo mix (built offline by launcher/commands/demo.py under runs/demo-data/)
read (1) from its source files with the bytes tokenizer, (2) from prepared shards, (3) with a
byte-level BPE trained on it; `zerotrain verify` speed; and packing efficiency, best-fit (the
default) against greedy.

`local_source_memory`: a generated ~BENCH_LOCAL_GB (default 1) GB source of parquet shards laid out
like a hub snapshot, read as one `hf` directory source in a fresh process, twice (the first read
converts the shards into datasets' Arrow cache, the second maps the cache): load time, loader
tokens/s over the whole source, and memory from /proc/self/status: peak RSS (VmHWM, what
`/usr/bin/time -v` calls maximum resident set size; it counts the memory-mapped file pages read)
and the peak of anonymous memory (RssAnon, sampled every 20 ms: the process's own memory, which
must not grow with the source). The first read's conversion holds a few parquet row groups at
a time (datasets reads a row group per batch): its extra memory follows the row-group size,
not the number or size of the shards.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# Before anything loads OpenMP (every compared program inherits it): with GOMP's default active
# spin-wait, two threads on two cores shared with other processes ran zerotrain's ZeRO-2 step 5x
# slower (1.48 s vs 0.29 s, debug model, load average ~3); PASSIVE measures the programs, not that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# DeepSpeed JIT-builds its CPU communication op into ~/.cache/torch_extensions/py311_cpu/, one directory
# whatever the virtual environment: two venvs on one machine (CI clones beside this checkout) rebuild
# it for each other (40-50 s under a lock, seen as a 48 s engine set-up). One build per venv instead.
import hashlib  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "zerotrain" / (
    "torch_extensions-" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])))

from harness import (TINY, MissingDependency, _WORK, bpe_dir, clean_shm, demo_mix, free_port, load_average,  # noqa: E402
                     machine, shards_dir, workdir)

COLUMNS = ("benchmark", "setting", "result", "target", "load")
SECONDS = float(os.environ.get("BENCH_SECONDS", "0.5" if TINY else "5"))


def loader_rows(label: str, data: str, tokenizer: str, target: float | None, packings=("best-fit",)) -> list[dict]:
    from zerotrain.dataio.pipeline.commands import bench

    rows = []
    for packing in packings:
        for seq_len, micro in ((2048, 8), (256, 8)):
            r = bench(data, tokenizer, seq_len, micro, seconds=SECONDS, progress=False, packing=packing)
            shares = ", ".join(f"{s['name']} {s['share']:.1%}" for s in r["sources"])
            rows.append({"benchmark": label, "setting": f"{packing}, seq {seq_len} x micro {micro}, 1 process",
                         "result": f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s, efficiency {r['efficiency']:.2%}"
                                   f" ({shares})",
                         "target": f">= {target / 1e6:.0f}M tokens/s" if target else ""})
    return rows


def bench_stream_bytes():
    return loader_rows("loader: mix files, bytes tokenizer", str(demo_mix()), "bytes", 5e6, ("best-fit", "greedy"))


def bench_shards():
    return loader_rows("loader: prepared shards (uint16)", str(shards_dir()), "bytes", 20e6, ("best-fit", "greedy"))


def bench_stream_bpe():
    return loader_rows("loader: mix files, BPE 8192 (tokenizing)", str(demo_mix()), str(bpe_dir()), None)


def bench_prepare_verify():
    from zerotrain.dataio.format.shards import read_manifest, read_speed, verify
    from zerotrain.dataio.pipeline.prepare import prepare
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    out = workdir() / "prepare-timed"
    t0 = time.time()
    prepare(str(demo_mix()), ByteTokenizer(), out, shard_tokens=2_000_000, log=lambda *a: None)
    t_prep = time.time() - t0
    m = read_manifest(out)
    n = sum(s["tokens"] for s in m["sources"])
    t0 = time.time()
    results = verify(out, m, ByteTokenizer())
    t_ver = time.time() - t0
    mb = sum(r["bytes"] for r in results) / 1e6
    tok_s, byte_s = read_speed(out, m, 2.0)
    return [{"benchmark": "zerotrain prepare (bytes)", "setting": f"demo mix, {n / 1e6:.1f}M tokens",
             "result": f"{t_prep:.1f}s ({n / t_prep / 1e6:.1f}M tokens/s)", "target": ""},
            {"benchmark": "zerotrain verify", "setting": f"{len(results)} shards, {mb:.0f} MB, sha256 + checks",
             "result": f"{t_ver:.2f}s ({mb / t_ver:.0f} MB/s)", "target": ""},
            {"benchmark": "shard read speed (memmap)", "setting": "page cache warm",
             "result": f"{tok_s / 1e6:,.0f}M tokens/s ({byte_s / 1e9:.1f} GB/s)", "target": ""}]


def bench_packing():
    """Greedy (ours) against best-fit, on the demo mix's documents in training order."""
    import numpy as np

    from zerotrain.dataio.format.packing import best_fit_efficiency, open_rows_for
    from zerotrain.dataio.pipeline.loader import MixedStream, load_data, open_data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    data = load_data(open_data(str(demo_mix()), ByteTokenizer()))
    stream = MixedStream(data, 0, 1, 1337)
    lengths = np.concatenate([[len(d) + 1 for d in stream.next_documents(1 << 20)] for _ in range(8)])
    rows = []
    for seq_len in (256, 512, 1024, 2048):
        ends = np.cumsum(lengths)
        starts = ends - lengths
        crosses = starts // seq_len != (ends - 1) // seq_len
        avoidable = float(np.mean(crosses & (lengths <= seq_len)))  # would fit in a row, split anyway
        k = open_rows_for(seq_len)
        eff, _ = best_fit_efficiency(lengths, seq_len, open_rows=k)
        rows.append({"benchmark": f"packing efficiency, seq {seq_len}", "setting": f"{len(lengths):,} demo documents",
                     "result": f"best-fit ({k} open rows) {eff:.2%}, no document that fits is cut; greedy 100.00%,"
                               f" cuts {avoidable:.1%} of documents that would fit in one row", "target": ">= 99%"})
    return rows


LOCAL_GB = float(os.environ.get("BENCH_LOCAL_GB", "1"))


def write_snapshot(root: Path, total_bytes: int, shards: int = 8, seed: int = 0) -> Path:
    """~total_bytes of text documents (lowercase words, lengths log-normal around 3 kB) as parquet
    shards sample/10BT/000_00000.parquet ... like a downloaded hub dataset. Written from numpy
    buffers (no Python string per document), a shard at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", np.uint8)  # ~19% spaces: words of ~5 letters
    (root / "sample" / "10BT").mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        size = total_bytes // shards
        lengths = np.clip(rng.lognormal(7.6, 0.8, size // 1500), 50, 100_000).astype(np.int64)
        lengths = lengths[np.cumsum(lengths) <= size]
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = letters[rng.integers(0, 32, int(offsets[-1]), dtype=np.uint8)]
        text = pa.LargeStringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data))
        pq.write_table(pa.table({"text": text}), root / "sample" / "10BT" / f"{k:03d}_00000.parquet",
                       row_group_size=16_384)
    return root


MEASURE = r"""
import json, os, resource, sys, threading, time
sys.path.insert(0, sys.argv[2])

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

import datasets, numpy, torch  # noqa: the libraries' own memory is the baseline, not the source's
from zerotrain.dataio.pipeline.commands import bench
from zerotrain.dataio.pipeline.loader import load_data, open_data
base = status()
peak_anon = [base["RssAnon"]]

def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.02)

threading.Thread(target=sample, daemon=True).start()
r = bench(sys.argv[1], "bytes", 2048, 8, max_tokens=int(sys.argv[3]), progress=False)
end = status()
peak_anon[0] = max(peak_anon[0], end["RssAnon"])
print(json.dumps({"base_rss": base["RssAnon"] + base["RssFile"], "base_anon": base["RssAnon"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak_anon": peak_anon[0], "load_s": r["load_s"],
                  "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"]}))
"""


def bench_local_source_memory():
    """A ~LOCAL_GB GB snapshot directory as one `hf` source: memory and speed, cold and warm cache."""
    root = write_snapshot(workdir() / "snapshot", int(LOCAL_GB * 1e9))
    size = sum(f.stat().st_size for f in (root / "sample" / "10BT").iterdir())
    mix = workdir() / "local-mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "fw", "weight": 1, "hf": str(root)}]}))
    env = {**os.environ, "HF_DATASETS_CACHE": str(workdir() / "hf-datasets-cache"), "OMP_NUM_THREADS": "1"}
    rows, text_bytes = [], int(LOCAL_GB * 1e9)
    for label in ("first read (parquet -> Arrow cache)", "second read (Arrow cache mapped)"):
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(mix), str(REPO), str(text_bytes)],
                              capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        m = json.loads(proc.stdout.splitlines()[-1])
        gb = 1 << 30
        rows.append({"benchmark": f"local source memory, {label}",
                     "setting": f"{LOCAL_GB:g} GB of text in 8 parquet shards ({size / 1e9:.2f} GB on disk), one hf"
                                " source; seq 2048 x micro 8, every token read once",
                     "result": f"peak RSS {m['peak_rss'] / gb:.2f} GiB (after imports {m['base_rss'] / gb:.2f});"
                               f" anonymous {m['base_anon'] / gb:.2f} -> peak {m['peak_anon'] / gb:.2f} GiB;"
                               f" load {m['load_s']:.1f}s, {m['tokens_per_s'] / 1e6:.1f}M tokens/s",
                     "target": "anonymous memory flat (independent of the source's size)"})
    return rows


def bench_planner_rss():
    """The planner's memory model (launcher/planning) against this CPU: peak RSS of rank 0 in real
    2-rank fp32 runs under the deepspeed launcher (ZeRO-2 and ZeRO-3; `tiny` and `small`; micro-batch
    2 x 256; 3 steps), as the driver logs it (metrics.jsonl peak_rss_gib), against the planner's
    prediction for the same config. Target: within +-20%."""
    import json
    import random
    import subprocess

    from zerotrain.launcher import model_spec

    from zerotrain.launcher import planning as planner
    from zerotrain.launcher.config import RunConfig
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.launcher.settings import resolve as resolve_settings

    root = workdir() / "planner-rss"
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = "the model reads every token of the packed row and learns which byte comes next".split()
    with open(root / "a.jsonl", "w") as f:
        for _ in range(2000):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))}) + "\n")
    (root / "mix.json").write_text(json.dumps({"sources": [{"name": "a", "path": "a.jsonl", "weight": 1.0}]}))
    _, cpu = load_profile("cpu")
    (root / "cpu-zero2.json").write_text(json.dumps({**cpu, "zero_optimization": {"stage": 2}}))
    rows = []
    for stage, profile in ((2, str(root / "cpu-zero2.json")), (3, "cpu")):
        for model in ("tiny", "small"):  # 38.9M and 113.8M parameters: up to ~4 GB a rank
            port = free_port()
            run_id = f"z{stage}-{model}"
            flags = ["--profile", profile, "--model", model, "--data", str(root / "mix.json"), "--seq-len", "256",
                     "--micro-batch", "2", "--grad-accum", "1", "--max-steps", "3", "--warmup-steps", "1",
                     "--out", str(root / "runs"), "--run-id", run_id, "--resume", "never",
                     "--log-data-every-steps", "0"]
            r = subprocess.run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                                str(port), str(REPO / "launcher" / "train.py"), *flags], capture_output=True, text=True,
                               cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
            clean_shm(port)  # DeepSpeed's CPU all-reduce leaves its shared-memory buffers behind (~66 MB a rank)
            if r.returncode:
                raise RuntimeError(f"planner_rss {run_id}: exit {r.returncode}: {r.stderr[-1500:]}")
            lines = (root / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
            measured = max(rec["peak_rss_gib"] for rec in map(json.loads, lines) if "peak_rss_gib" in rec)
            cfg = RunConfig.from_flat(dict(data="-", profile=profile, model=model, seq_len=256, micro_batch=2))
            args, _, _ = model_spec.resolve(cfg, 258)
            prof = load_profile(profile)[1]
            setup = planner.setup_from(prof, resolve_settings(None, profile, prof).values, world=2, nodes=1, device_bytes=float("inf"))
            m = planner.memory(args, setup, stage, 2, 256, False)
            predicted = m.total / planner.GiB
            parts = ", ".join(f"{k.replace('_', ' ')} {v / planner.GiB:.2f}" for k, v in m.items() if k != "total")
            rows.append({"benchmark": f"planner vs peak RSS, ZeRO-{stage}, {model}",
                         "setting": f"2 ranks fp32, micro 2 x 256, {args.n_layers} x {args.dim}",
                         "result": f"measured {measured:.2f} GiB, predicted {predicted:.2f} GiB"
                                   f" ({predicted / measured - 1:+.0%}; {parts})", "target": "within +-20%"})
    return rows


def _steps(name):
    def run():
        import steps

        return getattr(steps, f"bench_{name}")()
    return run


def _module(module, function):
    def run():
        import importlib

        return getattr(importlib.import_module(module), function)()
    return run


# name -> (function, what it measures). Order = the order `make bench` runs them in.
BENCHMARKS = {
    "train_step": (_steps("train_step"), "1 rank fp32: zerotrain ZeRO-2/3 vs plain PyTorch, HF Llama, HF Trainer +"
                   " DeepSpeed ZeRO-2; two shapes; MFU vs the measured matmul peak"),
    "two_ranks": (_steps("two_ranks"), "2 ranks: zerotrain (deepspeed launcher) vs DDP (torchrun), scaling"
                  " efficiency; zerotrain's collectives/host syncs per step; data wait"),
    "startup": (_module("startup", "bench_startup"), "launch to first optimizer step for the demo, broken down"),
    "init_from": (_module("startup", "bench_init_from"), "building the model for --init-from: initial weights drawn"
                  " and loaded over, against not drawn"),
    "shard_verify": (_module("startup", "bench_shard_verify"), "verifying ~1 GB of prepared shards: full, and"
                     " quick (sizes + manifest, hashes once per node)"),
    "checkpoint": (_module("checkpoints", "bench_checkpoint"), "save/load, ~25M and ~100M, ZeRO-2/3, vs the disk's"
                   " write bandwidth; loop blocked per save with and without --mirror"),
    "packing_baselines": (_module("packing_baselines", "bench_packing_baselines"), "our packed loader vs TRL"
                          " pack_dataset (BFD) and datasets.map concatenate-and-chunk: tokens/s, efficiency"),
    "fused_projections": (_module("projections", "bench_fused_projections"), "our model with separate q/k/v and"
                          " gate/up projections vs one fused qkv and gate_up weight per layer"),
    "loss_memory": (_module("loss_memory", "bench_loss_memory"), "peak RSS and time of one forward + backward,"
                    " 128,256-token vocabulary: full logits (before) vs the chunked loss"),
    "bf16_step": (_module("precision", "bench_bf16_step"), "1 rank: zerotrain ZeRO-2/3 in fp32 (the cpu profiles) vs"
                  " their bf16 copies; MFU against each dtype's measured matmul peak; the CPU's bf16 flags"),
    "offload_step": (_module("offload", "bench_offload_step"), "1 rank: step time with --offload none / optimizer"
                     " (ZeRO-2, ZeRO-3) / all (ZeRO-3) on this CPU, where no bus is crossed"),
    "sequence_parallel": (_module("sequence_parallel", "bench_sequence_parallel"), "2 ranks: --sequence-parallel 2"
                          " vs data parallelism at the same tokens per step (1,024-token rows) on this CPU"),
    "stream_bytes": (bench_stream_bytes, "loader from the demo mix's files, bytes tokenizer"),
    "shards": (bench_shards, "loader from prepared shards"),
    "stream_bpe": (bench_stream_bpe, "loader from the mix files, BPE tokenized on the fly"),
    "prepare_verify": (bench_prepare_verify, "zerotrain prepare, verify, shard read speed"),
    "packing": (bench_packing, "best-fit vs greedy packing efficiency"),
    "local_source_memory": (bench_local_source_memory, "a ~1 GB local hub snapshot as one source: memory, speed"),
    "planner_rss": (bench_planner_rss, "the planner's memory model vs measured peak RSS (2-rank runs)"),
}


def print_table(rows: list[dict], file=None) -> None:
    file = file or sys.stdout
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in COLUMNS]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)) + " |", file=file)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=file)
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(COLUMNS, widths)) + " |", file=file,
              flush=True)


def main(argv: list[str]) -> int:
    if "--list" in argv or "-h" in argv or "--help" in argv:
        for name, (_, about) in BENCHMARKS.items():
            print(f"{name:<22}{about}")
        return 0
    unknown = [a for a in argv if a not in BENCHMARKS]
    if unknown:
        print(f"benchmarks/run.py: unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    chosen = argv or list(BENCHMARKS)
    m = machine()
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}; {m['cpu']}, {m['cores']} cores; python {m['python']};"
          f" command: {' '.join(['python benchmarks/run.py', *argv])}{' (BENCH_TINY=1)' if TINY else ''};"
          f" load average {m['load']:.1f} at the start", flush=True)
    rows, failed = [], 0
    try:
        for name in chosen:
            t0, load0 = time.time(), load_average()
            try:
                got = BENCHMARKS[name][0]()
            except MissingDependency as e:  # one line naming what to install; the others still run
                print(f"benchmark {name}: skipped: {e}", file=sys.stderr, flush=True)
                rows.append({"benchmark": name, "result": f"not run: {e}"})
                continue
            except Exception as e:  # noqa: BLE001  one benchmark's failure does not stop the others
                failed += 1
                print(f"benchmark {name}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                rows.append({"benchmark": name, "result": f"FAILED: {str(e).splitlines()[0] if str(e) else e!r}"})
                continue
            for r in got:
                r["load"] = f"{load0:.1f} -> {load_average():.1f}"
            rows.extend(got)
            print(f"[{name}: {time.time() - t0:.0f}s]", file=sys.stderr, flush=True)
            if len(chosen) > 1:  # each benchmark's rows as soon as it is done; all of them again at the end
                print_table(got, file=sys.stderr)
    finally:
        shutil.rmtree(_WORK.get("dir", ""), ignore_errors=True) if "dir" in _WORK else None
    print(f"machine: {os.cpu_count()} CPUs, load average {load_average():.1f} at the end")
    print_table(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
