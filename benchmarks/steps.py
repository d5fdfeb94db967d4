"""Training-step benchmarks: zerotrain against what its users would
otherwise run, side by side in one invocation (benchmarks/harness.py alternates them).

    train_step   1 rank, fp32, two shapes: zerotrain ZeRO-2 and ZeRO-3 (the cpu profile; the real
                 driver) vs a plain PyTorch loop over the same model (torch.optim.AdamW as a user
                 writes it, and with fused=True; with each attention kernel that runs on a CPU; and on
                 the same rows as one document each, which is what the HF loop computes: the share of
                 the gap to it that document masking explains), a plain loop over transformers'
                 LlamaForCausalLM with the same weights, and the HF Trainer with DeepSpeed ZeRO-2. Also the machine's
                 fp32 matmul peak, measured before and after, and each program's MFU against it
                 (zerotrain.modeling.model.flops_per_token). BENCH_COMPILE=1 adds zerotrain ZeRO-2 --compile.
                 BENCH_PLAIN_VS_HF=1: only our model's plain loop against HF Llama's (and ours on the rows as
                 one document), alternated (`bench_plain_vs_hf`: the CPU must not get slower than HF's loop).
    two_ranks    zerotrain ZeRO-2/3 under the `deepspeed` launcher and DDP under `torchrun`, 2 ranks
                 of 1 thread, against the same programs on 1 rank of 1 thread: tokens/s and scaling
                 efficiency; then one counting chunk: zerotrain's own collectives and host syncs per
                 optimizer step (outside DeepSpeed's), and the share of step time waiting for data.

Same threads per rank everywhere in one comparison (OMP_NUM_THREADS). The step time is the wall
time between consecutive optimizer steps with everything the program does per step (zerotrain:
its loader, per-step agreement collectives and metrics logging included).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from harness import TINY, Worker, alternate, launcher_cmd, matmul_peak, median, spread, step_times

CORES = os.cpu_count() or 1
SEED = 1337
# name -> (model, seq_len, micro_batch, warm-up steps, steps per chunk). d8 is the depth rule at 8
# layers x 512 (head dim 64): 26.0M parameters, the issue's ~25M shape.
SHAPES = {"debug": ("debug", 256, 8, 2, 3), "25M": ("d8", 256, 4, 1, 2)}
if TINY:
    SHAPES = {"debug": ("debug", 64, 2, 1, 1)}
CHUNKS = int(os.environ.get("BENCH_CHUNKS", "1" if TINY else "3"))
COMPILE = os.environ.get("BENCH_COMPILE") == "1"  # also zerotrain --compile (inductor: minutes of set-up)
PLAIN_VS_HF = os.environ.get("BENCH_PLAIN_VS_HF") == "1"  # train_step: only our plain loop against HF's


def say(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def profiles(work: Path) -> dict[int, Path]:
    """The shipped cpu profiles: ZeRO-3 (cpu) and ZeRO-2 (cpu-zero2), as files."""
    from zerotrain.launcher.profiles import load_profile

    out = {}
    for stage, name in ((2, "cpu-zero2"), (3, "cpu")):
        path = work / f"{name}.json"
        path.write_text(json.dumps(load_profile(name)[1]))
        out[stage] = path
    return out


def save_batches(work: Path, mix: Path, seq: int, micro: int, world: int, n: int = 4) -> Path:
    """The first n batches zerotrain's loader gives each rank (same data, seed and packing as the
    driver), saved as .npy for the baselines to cycle through."""
    import numpy as np

    from zerotrain.dataio.format.pieces import default_piece_len
    from zerotrain.dataio.pipeline.loader import Batches, load_data, open_data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    out = work / f"batches-{seq}x{micro}-w{world}"
    if out.exists():
        return out
    out.mkdir()
    data = load_data(open_data(str(mix), ByteTokenizer()), default_piece_len(seq), world, 0, seq_len=seq)
    for rank in range(world):
        loader = Batches(data, rank, world, SEED, seq, micro)
        batches = [loader.next() for _ in range(n)]
        for key in ("input_ids", "position_ids", "labels"):
            np.save(out / f"rank{rank}.{key}.npy", np.stack([b[key].numpy() for b in batches]), allow_pickle=False)
        loader.close()
    return out


def export_hf(work: Path, shape: str, seq: int) -> Path:
    """Our model at the benchmark seed, written as a Hugging Face Llama directory (modeling/hf.py)."""
    import torch

    from zerotrain.modeling import hf
    from zerotrain.modeling.model import Transformer

    out = work / f"hf-{shape}"
    if not out.exists():
        import argparse

        from step_worker import model_args

        args = model_args(argparse.Namespace(shape=shape, seq=seq))
        torch.manual_seed(SEED)
        hf.save(out, Transformer(args).state_dict(), args)
    return out


def shape_args(shape: str, seq: int):
    import argparse

    from step_worker import model_args

    return model_args(argparse.Namespace(shape=shape, seq=seq))


def start(name, launcher, ranks, threads, program, common, work, extra=(), alone=False) -> Worker:
    """Start one compared program. alone: wait until it is ready before anything else starts, so its
    set-up is timed on a quiet machine; otherwise all start at once (sooner; set-up not reported)
    and `ready()` waits for them."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    say(f"  starting {name} ({launcher}, {ranks} rank(s) x {threads} thread(s))")
    return Worker(name, launcher_cmd(launcher, ranks, program, *common, *extra), env, work / f"{name}.log",
                  connect=alone and not TINY)


def ready(workers: list[Worker]) -> None:
    for w in workers:
        if w.conn is None:
            w.connect()


def describe_setup(w: Worker) -> str:
    s = w.setup
    parts = [f"imports {s.get('imports_s', 0):.1f}s"]
    if "plan_s" in s:
        parts.append(f"plan+data {s['plan_s']:.1f}s, Trainer (model, engine, loader) {s['trainer_s']:.1f}s")
    else:
        parts.append(f"build {s.get('build_s', 0):.1f}s")
    return f"{w.name} {w.ready_s:.1f}s ({', '.join(parts)})"


def bench_train_step() -> list[dict]:
    if PLAIN_VS_HF:
        return bench_plain_vs_hf()
    from harness import demo_mix
    from zerotrain.modeling.model import count_params, flops_per_token

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-steps-"))
    rows = []
    try:
        prof = profiles(work)
        mix = demo_mix()
        for label, (shape, seq, micro, warmup, steps) in SHAPES.items():
            args = shape_args(shape, seq)
            batches = save_batches(work, mix, seq, micro, 1)
            hf_dir = export_hf(work, shape, seq)
            common = ["--shape", shape, "--seq", str(seq), "--micro", str(micro), "--work", str(work),
                      "--mix", str(mix), "--batches", str(batches), "--hf-dir", str(hf_dir)]
            say(f"train_step {label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}")
            peak_before = matmul_peak(CORES)
            programs = [("zerotrain ZeRO-2", "zt", ["--profile", str(prof[2])]),
                        ("zerotrain ZeRO-3", "zt", ["--profile", str(prof[3])]),
                        ("plain PyTorch loop", "plain", []),
                        ("plain PyTorch loop, fused AdamW", "plain", ["--fused"]),
                        # each attention kernel that runs on a CPU (the loop above is auto = sdpa), and
                        # the same rows as one document each, which HF's loop below is (no mask to pay for)
                        ("plain PyTorch loop, --attention flex", "plain", ["--attention", "flex"]),
                        ("plain PyTorch loop, rows as one document (no mask)", "plain", ["--one-document"]),
                        ("HF Llama, plain loop", "hf", []),
                        ("HF Trainer + DeepSpeed ZeRO-2", "hf-trainer", ["--profile", str(prof[2])])]
            if COMPILE:
                programs.insert(1, ("zerotrain ZeRO-2 --compile", "zt", ["--profile", str(prof[2]), "--compile"]))
            workers = []
            try:
                timed_setup = label == list(SHAPES)[-1]  # set-up hardly depends on the shape: timed once
                for name, program, extra in programs:
                    workers.append(start(name, "python", 1, CORES, program, common, work, extra, alone=timed_setup))
                ready(workers)
                results = alternate(workers, warmup, CHUNKS, steps, say)
            finally:
                for w in workers:
                    w.close()
            peak_after = matmul_peak(CORES)
            peak = max(peak_before, peak_after)
            tokens = seq * micro
            flops = flops_per_token(args, seq)
            base = median(step_times(results["plain PyTorch loop"]))
            trainer = median(step_times(results["HF Trainer + DeepSpeed ZeRO-2"]))
            loads = [c["load"] for r in results.values() for c in r]
            setting = (f"{label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro},"
                       f" 1 rank x {CORES} threads, fp32")
            for name, _, _ in programs:
                xs = step_times(results[name])
                m = median(xs)
                mfu = flops * tokens / m / peak
                extra = ""
                if name.startswith("zerotrain"):
                    extra = f"; {trainer / m:.2f}x HF Trainer"
                rows.append({"benchmark": f"train step: {name}", "setting": setting,
                             "result": f"{m * 1e3:,.0f} ms/step ({spread(xs)}, n={len(xs)}), {tokens / m:,.0f}"
                                       f" tokens/s, {base / m:.2f}x plain loop{extra}; MFU {mfu:.1%}",
                             "target": (">= 0.95x plain, >= 1.1x HF Trainer" if name == "zerotrain ZeRO-2" else "")})
            if timed_setup:
                rows.append({"benchmark": f"train step set-up ({label})", "setting": "spawn to ready for the first"
                             " step, each started alone; not in the figures above",
                             "result": "; ".join(describe_setup(w) for w in workers), "target": ""})
            rows.append({"benchmark": f"MFU denominator ({label})", "setting": f"fp32 matmul peak, {CORES} threads,"
                         " best 2048^3 GEMM", "result": f"{peak_before / 1e9:.0f} GFLOP/s before, {peak_after / 1e9:.0f}"
                         f" after (max used); model {flops / 1e6:.1f} MFLOP/token; load during steps"
                         f" {min(loads):.1f}-{max(loads):.1f}", "target": ""})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def bench_plain_vs_hf() -> list[dict]:
    """Our model against HF Llama, each in the same plain loop (torch.optim.AdamW as written, clipping), on the same
    packed rows of the demo mix (short documents, several a row: ours masks them, HF's attends across them), and
    ours on those rows as one document each (no mask, what HF computes). Only these programs, alternated round by
    round in one invocation (the others frozen), so a shared machine's load falls on each alike. The ratio is ours
    over HF's tokens/s (the aim: at least 1.0x)."""
    from harness import demo_mix
    from zerotrain.modeling.model import count_params

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-plain-hf-"))
    rows = []
    programs = [("plain loop, our model", "plain", []), ("plain loop, our model, rows as one document", "plain",
                                                         ["--one-document"]), ("plain loop, HF Llama", "hf", [])]
    try:
        mix = demo_mix()
        for label, (shape, seq, micro, warmup, steps) in SHAPES.items():
            args = shape_args(shape, seq)
            common = ["--shape", shape, "--seq", str(seq), "--micro", str(micro), "--work", str(work),
                      "--mix", str(mix), "--batches", str(save_batches(work, mix, seq, micro, 1)),
                      "--hf-dir", str(export_hf(work, shape, seq))]
            workers = []
            try:
                for name, program, extra in programs:
                    workers.append(start(name, "python", 1, CORES, program, common, work, extra))
                ready(workers)
                results = alternate(workers, warmup, CHUNKS, steps, say)
            finally:
                for w in workers:
                    w.close()
            hf = median(step_times(results["plain loop, HF Llama"]))
            loads = [c["load"] for r in results.values() for c in r]
            setting = (f"{label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}, 1 rank x"
                       f" {CORES} threads, fp32; load {min(loads):.1f}-{max(loads):.1f}")
            for name, _, _ in programs:
                xs = step_times(results[name])
                m = median(xs)
                rows.append({"benchmark": f"plain loop vs HF: {name}", "setting": setting,
                             "result": f"{m * 1e3:,.0f} ms/step ({spread(xs)}, n={len(xs)}), {seq * micro / m:,.0f}"
                                       f" tokens/s, {hf / m:.2f}x HF", "target": ">= 1.0x HF" if name == programs[0][0]
                             else ""})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def bench_two_ranks() -> list[dict]:
    from harness import demo_mix
    from zerotrain.modeling.model import count_params

    label, (shape, seq, micro, warmup, steps) = list(SHAPES.items())[-1]
    ranks = 2
    threads = max(1, CORES // ranks)
    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-ranks-"))
    rows = []
    try:
        prof = profiles(work)
        mix = demo_mix()
        args = shape_args(shape, seq)
        groups = [("zerotrain ZeRO-2", "zt", ["--profile", str(prof[2])], "deepspeed"),
                  ("zerotrain ZeRO-3", "zt", ["--profile", str(prof[3])], "deepspeed"),
                  ("DDP", "ddp", [], "torchrun")]
        workers, names = [], {}
        try:
            for world in (1, ranks):
                batches = save_batches(work, mix, seq, micro, world)
                common = ["--shape", shape, "--seq", str(seq), "--micro", str(micro), "--work", str(work),
                          "--mix", str(mix), "--batches", str(batches)]
                for name, program, extra, launcher in groups:
                    if world == 1 and program == "ddp":
                        program, launcher = "plain", "python"  # DDP's 1-rank reference: the same loop unwrapped
                    tag = f"{name}, {world} rank{'s' if world > 1 else ''}"
                    workers.append(start(tag, launcher if world > 1 else "python", world, threads, program, common,
                                         work, extra))
                    names[(name, world)] = tag
            ready(workers)
            say(f"two_ranks {label}: {count_params(args)['total'] / 1e6:.2f}M params")
            results = alternate(workers, warmup, CHUNKS, steps, say)
            counts = {}
            for name in ("zerotrain ZeRO-2", "zerotrain ZeRO-3"):
                w = next(w for w in workers if w.name == names[(name, ranks)])
                counts[name] = w.run(2, count=True)
        finally:
            for w in workers:
                w.close()
        setting = f"{label}: seq {seq} x micro {micro} per rank, {threads} thread(s) per rank, fp32, gloo"
        eff = {}
        for name, _, _, launcher in groups:
            one, two = median(step_times(results[names[(name, 1)]])), median(step_times(results[names[(name, 2)]]))
            tps1, tps2 = seq * micro / one, ranks * seq * micro / two
            eff[name] = tps2 / (ranks * tps1)
            xs = step_times(results[names[(name, 2)]])
            rows.append({"benchmark": f"2 ranks: {name} ({launcher})", "setting": setting,
                         "result": f"{tps2:,.0f} tokens/s ({two * 1e3:,.0f} ms/step, {spread(xs)}); 1 rank"
                                   f" {tps1:,.0f} tokens/s; scaling efficiency {eff[name]:.0%}",
                         "target": "within 5 points of DDP" if name.startswith("zerotrain") else ""})
        for name in ("zerotrain ZeRO-2", "zerotrain ZeRO-3"):
            rows.extend(overhead_rows(name, counts[name], results[names[(name, ranks)]], setting))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def overhead_rows(name: str, counted: dict, timed: list[dict], setting: str) -> list[dict]:
    """Section 1.4: zerotrain's own collectives and host syncs per step, and the data wait."""
    ours = {k: v for k, v in counted["counts"].items() if "<- zerotrain" in k}
    theirs = {k: v for k, v in counted["counts"].items() if "<- deepspeed" in k}

    def total(d, kind):
        return sum(v[0] for k, v in d.items() if k.startswith(kind))

    step = median(counted["step_s"])
    wait = sum(v[1] for k, v in ours.items() if k.startswith("collective"))
    listed = ", ".join(f"{k.split(' <- zerotrain ')[0].split(' ', 1)[1]} x{v[0]:g}"
                       f" ({k.split(' <- zerotrain ')[1]})" for k, v in ours.items())
    records = [r for c in timed for r in c["records"] if "data_wait_s" in r]
    frac = median([r["data_wait_s"] / r["step_s"] for r in records]) if records else float("nan")
    wait_ms = median([r["data_wait_s"] for r in records]) * 1e3 if records else float("nan")
    return [{"benchmark": f"overheads per step: {name}, 2 ranks", "setting": setting,
             "result": f"zerotrain's own: {total(ours, 'collective'):g} collectives, {total(ours, 'host-sync'):g}"
                       f" host syncs per step ({listed}); {wait * 1e3:.1f} ms/step inside its collectives"
                       f" ({wait / step:.1%} of the step); DeepSpeed's: {total(theirs, 'collective'):g} collectives,"
                       f" {total(theirs, 'host-sync'):g} host syncs per step", "target": ""},
            {"benchmark": f"data wait: {name}, 2 ranks", "setting": "metrics data_wait_s / step_s, timed chunks",
             "result": f"median {frac:.2%} of the step ({wait_ms:.2f} ms)", "target": ""}]
