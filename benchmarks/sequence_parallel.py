"""Sequence parallelism against data parallelism on this CPU: `python benchmarks/run.py sequence_parallel`.

The real driver (benchmarks/step_worker.py `zt`) on 2 ranks under the deepspeed launcher, 1 thread each, the
25M shape of `train_step` (benchmarks/steps.py SHAPES; the debug shape at BENCH_TINY) at 1,024-token rows, the
shipped ZeRO-2 CPU profile (cpu-zero2), the same tokens per optimizer step both ways: `--sequence-parallel 2`
with micro-batch 2 (2 rows a step, each shared by both ranks: each computes 512 positions of every row and
the all-to-alls around attention swap them for half the heads) against plain data parallelism with
micro-batch 1 per rank (2 rows a step, one whole row per rank); alternated chunk by chunk
(benchmarks/harness.py). Reported: ms per optimizer step, tokens/s, SP's speed against DP's, and the bytes
each rank sends through the all-to-all per step (launcher/planning `all_to_all_bytes`).

What it means: on a CPU node the exchange is gloo's all-to-all through the kernel's loopback and shared memory
(no NVLink, no NCCL), and the two ranks share 2 cores with everything else here, so the row is the cost of
SP's extra work (the exchanges, the repeated reshapes, each rank's sdpa mask over the whole row) where
memory is not the limit; SP is for rows that do not fit one device, which data parallelism cannot train at
all. It says nothing about a GPU node, where the all-to-all runs over NVLink (the planner's figure:
`zerotrain plan --sequence-parallel N`).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from harness import TINY, alternate, median, step_row, step_times
from steps import CHUNKS, SHAPES, profiles, ready, say, shape_args, start

SEQ = 64 if TINY else 1024
RANKS = 2


def bench_sequence_parallel() -> list[dict]:
    from harness import demo_mix
    from zerotrain.launcher.planning import all_to_all_bytes
    from zerotrain.modeling.model import count_params

    label, (shape, _, _, warmup, steps) = list(SHAPES.items())[-1]
    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-sp-"))
    rows = []
    try:
        profile = profiles(work)[2]
        mix = demo_mix()
        args = shape_args(shape, SEQ)
        programs = {"data parallel, micro-batch 1 per rank": (1, 1),
                    "--sequence-parallel 2, micro-batch 2 per row group": (2, 2)}  # name -> (micro, N)
        say(f"sequence_parallel {label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {SEQ}")
        workers = []
        try:
            for name, (micro, n) in programs.items():
                common = ["--shape", shape, "--seq", str(SEQ), "--micro", str(micro), "--work", str(work),
                          "--mix", str(mix)]
                workers.append(start(name, "deepspeed", RANKS, 1, "zt", common, work,
                                     ["--profile", str(profile), "--sequence-parallel", str(n)]))
            ready(workers)
            results = alternate(workers, warmup, CHUNKS, steps, say)
        finally:
            for w in workers:
                w.close()
        tokens = 2 * SEQ  # per optimizer step, both ways
        step = {name: median(step_times(results[name])) for name in programs}
        dp = step["data parallel, micro-batch 1 per rank"]
        sent = all_to_all_bytes(args, 2, SEQ, 4, 2, False).per_layer * args.n_layers
        setting = (f"{label}: {count_params(args)['total'] / 1e6:.2f}M params, {tokens:,} tokens per step (2 rows x"
                   f" {SEQ}), 2 ranks x 1 thread, ZeRO-2, fp32, gloo on one CPU node (no NVLink)")
        for name, (micro, n) in programs.items():
            vs = "" if n == 1 else (f", {dp / step[name]:.2f}x data parallelism's speed; all-to-all {sent / 1e6:.1f}"
                                    " MB sent per rank per step")
            rows.append(step_row(f"sequence parallel: {name}", setting, step_times(results[name]), tokens, vs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
