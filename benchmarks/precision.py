"""bf16 against fp32 on this CPU: `python benchmarks/run.py bf16_step`.

The real driver (benchmarks/step_worker.py `zt`), 1 rank x every core, the shapes of `train_step`
(benchmarks/steps.py SHAPES), each ZeRO stage's shipped CPU profile (cpu-zero2, cpu) as it ships (fp32)
and as a user's bf16 copy (`"bf16": {"enabled": true}`, nothing else changed: what tests/test_bf16.py
trains), alternated chunk by chunk (benchmarks/harness.py). Reported: ms per optimizer step, tokens/s,
bf16's speed against fp32 at the same stage, and MFU against the matmul peak of the run's own dtype,
measured in the same invocation (bf16 GEMMs use AVX-512 BF16 / AMX where the CPU has them, and are
emulated, much slower, where it does not: the rows name the CPU's flags).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import alternate, matmul_peak, median, step_row, step_times
from steps import CHUNKS, CORES, SHAPES, profiles, ready, say, shape_args, start


def bf16_flags() -> str:
    """The CPU's bf16 instructions as lscpu names them (e.g. "avx512_bf16, amx_bf16"), or "none"."""
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no lscpu)"
    line = next((ln for ln in flags.splitlines() if ln.startswith("Flags:")), "")
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in line.split()]
    return ", ".join(found) or "none (bf16 emulated)"


def bench_bf16_step() -> list[dict]:
    from harness import demo_mix
    from zerotrain.modeling.model import count_params, flops_per_token

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-bf16-"))
    rows = []
    try:
        fp32 = profiles(work)  # {2: cpu-zero2, 3: cpu}
        bf16 = {}
        for stage, path in fp32.items():
            profile = json.loads(path.read_text())
            profile["bf16"] = {"enabled": True}
            bf16[stage] = work / f"{path.stem}-bf16.json"
            bf16[stage].write_text(json.dumps(profile))
        mix = demo_mix()
        flags = bf16_flags()
        for label, (shape, seq, micro, warmup, steps) in SHAPES.items():
            args = shape_args(shape, seq)
            common = ["--shape", shape, "--seq", str(seq), "--micro", str(micro), "--work", str(work), "--mix", str(mix)]
            programs = [(f"zerotrain ZeRO-{stage} {dtype}", dtype, stage, path)
                        for stage in (2, 3) for dtype, path in (("fp32", fp32[stage]), ("bf16", bf16[stage]))]
            say(f"bf16_step {label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}")
            peak = {d: matmul_peak(CORES, dtype=t) for d, t in (("fp32", "float32"), ("bf16", "bfloat16"))}
            workers = []
            try:
                for name, _, _, path in programs:
                    workers.append(start(name, "python", 1, CORES, "zt", common, work, ["--profile", str(path)]))
                ready(workers)
                results = alternate(workers, warmup, CHUNKS, steps, say)
            finally:
                for w in workers:
                    w.close()
            after = {d: matmul_peak(CORES, dtype=t) for d, t in (("fp32", "float32"), ("bf16", "bfloat16"))}
            peak = {d: max(peak[d], after[d]) for d in peak}
            tokens, flops = seq * micro, flops_per_token(args, seq)
            step = {name: median(step_times(results[name])) for name, *_ in programs}
            setting = (f"{label}: {count_params(args)['total'] / 1e6:.2f}M params, seq {seq} x micro {micro}, 1 rank x"
                       f" {CORES} threads; CPU bf16 flags: {flags}")
            for name, dtype, stage, _ in programs:
                m = step[name]
                vs = "" if dtype == "fp32" else f", {step[f'zerotrain ZeRO-{stage} fp32'] / m:.2f}x fp32's speed"
                rows.append(step_row(f"bf16 vs fp32: {name}", setting, step_times(results[name]), tokens,
                                     f"{vs}; MFU {flops * tokens / m / peak[dtype]:.1%} of the {dtype} peak"))
            rows.append({"benchmark": f"matmul peaks ({label})", "setting": f"{CORES} threads, best 2048^3 GEMM",
                         "result": f"fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s"
                                   f" ({peak['bf16'] / peak['fp32']:.2f}x)", "target": ""})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
