"""ZeRO-Offload's step time on this CPU: `python benchmarks/run.py offload_step`.

The real driver (benchmarks/step_worker.py `zt`), 1 rank x every core, the 25M shape of `train_step`
(benchmarks/steps.py SHAPES; the debug shape at BENCH_TINY), the shipped CPU profiles with
`zerotrain.offload` set in a copy: ZeRO-2 (cpu-zero2) with --offload none and optimizer, ZeRO-3 (cpu) with
none, optimizer and all; alternated chunk by chunk (benchmarks/harness.py). Reported: ms per optimizer step,
tokens/s, and each offloaded row against the same stage without offload.

What it means: on DeepSpeed's CPU accelerator host and device memory are the same RAM, so offload here
crosses no bus and saves no memory: the rows measure only the extra work DeepSpeed's offload path does on a
CPU (its own host-side gradient and parameter copies, DeepSpeedCPUAdam instead of torch's fused AdamW). What
it does not mean: anything about a GPU, where the optimizer step moves to the CPU and state crosses PCIe
every step (the planner's `offload traffic` line estimates that; docs/offload.md gives DeepSpeed's figures).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from harness import TINY, alternate, median, step_row, step_times
from steps import CHUNKS, CORES, SHAPES, profiles, ready, say, shape_args, start

ROWS = ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "all"))  # (ZeRO stage, --offload)


def bench_offload_step() -> list[dict]:
    from harness import demo_mix
    from zerotrain.modeling.model import count_params

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-offload-"))
    rows = []
    try:
        shipped = profiles(work)  # {2: cpu-zero2, 3: cpu}
        paths = {}
        for stage, mode in ROWS:
            profile = json.loads(shipped[stage].read_text())
            profile["zerotrain"]["offload"] = mode
            paths[stage, mode] = work / f"zero{stage}-offload-{mode}.json"
            paths[stage, mode].write_text(json.dumps(profile))
        mix = demo_mix()
        label = "debug" if TINY else "25M"
        shape, seq, micro, warmup, steps = SHAPES[label]
        args = shape_args(shape, seq)
        common = ["--shape", shape, "--seq", str(seq), "--micro", str(micro), "--work", str(work), "--mix", str(mix)]
        name = {key: f"ZeRO-{key[0]} --offload {key[1]}" for key in ROWS}
        say(f"offload_step {label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}")
        workers = []
        try:
            for key in ROWS:
                workers.append(start(name[key], "python", 1, CORES, "zt", common, work, ["--profile", str(paths[key])]))
            ready(workers)
            results = alternate(workers, warmup, CHUNKS, steps, say)
        finally:
            for w in workers:
                w.close()
        tokens = seq * micro
        step = {key: median(step_times(results[name[key]])) for key in ROWS}
        setting = (f"{label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}, 1 rank x"
                   f" {CORES} threads, fp32; CPU: host = device RAM, no bus crossed")
        for key in ROWS:
            vs = "" if key[1] == "none" else f", {step[key] / step[key[0], 'none']:.2f}x the step without offload"
            rows.append(step_row(f"offload: {name[key]}", setting, step_times(results[name[key]]), tokens, vs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
