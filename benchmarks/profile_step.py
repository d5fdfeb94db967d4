"""Where a training step's time goes: the PyTorch profiler over a few optimizer steps of our model,
as zerotrain runs it (a DeepSpeed engine from the cpu profile, ZeRO-2 or ZeRO-3) or as a plain loop
(torch.optim.AdamW, optionally fused), on packed rows of the demo mix. Prints the share of
forward, backward, clipping and optimizer, and the top operators by self CPU time.

    python benchmarks/profile_step.py [--program zero2|zero3|plain|plain-fused] [--shape debug|d8]
                                      [--seq 256] [--micro 8] [--steps 3] [--threads N]
                                      [--ds '{"zero_optimization": {"contiguous_gradients": false}}']

Before profiling it times --steps steps without the profiler (median ms/step): `--ds` merges a
JSON object into the DeepSpeed config, to try a setting and see what it changes.

A tool for finding where a step's time goes, not part of `make bench` (the profiler's own overhead
would distort a timing). For Python-level time (the driver's own code, DeepSpeed's hooks) use py-spy
on a benchmark worker: `py-spy record --pid PID` (not a dependency of this project).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--program", default="zero2", choices=("zero2", "zero3", "plain", "plain-fused"))
    p.add_argument("--shape", default="debug", help="debug, or dN: the depth rule with head dim 64 (d8: 26M)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ds", default="{}", help="JSON merged into the DeepSpeed config (zero2/zero3)")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/run.py
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from harness import demo_mix, free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from zerotrain.dataio.format.pieces import default_piece_len
    from zerotrain.dataio.pipeline.loader import Batches, load_data, open_data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from step_worker import CLIP, adamw, model_args, our_model

    torch.set_num_threads(a.threads)
    a.seed = 1337
    data = load_data(open_data(str(demo_mix()), ByteTokenizer()), default_piece_len(a.seq), 1, 0, seq_len=a.seq)
    loader = Batches(data, 0, 1, a.seed, a.seq, a.micro)
    batches = [{k: loader.next()[k] for k in ("input_ids", "position_ids", "labels")} for _ in range(4)]
    loader.close()
    if a.program.startswith("zero"):
        from zerotrain.launcher.components.engine import EngineSpec, build_engine
        from zerotrain.launcher.profiles import load_profile

        _, prof = load_profile("cpu")
        ds = {k: v for k, v in prof.items() if k != "zerotrain"}
        stage = int(a.program[-1])
        ds.update(train_micro_batch_size_per_gpu=a.micro, gradient_accumulation_steps=1, train_batch_size=a.micro,
                  zero_optimization={**ds["zero_optimization"], "stage": stage})
        ds = merged(ds, json.loads(a.ds))
        engine = build_engine(EngineSpec(ds, model_args(a), seed=a.seed)).engine  # joins the process group
        torch.set_num_threads(a.threads)  # as asked: joining sets a CPU rank's threads when OMP_NUM_THREADS is unset

        def step(b):
            with record_function("forward"):
                loss = engine(**b)
            with record_function("backward"):
                engine.backward(loss)
            with record_function("optimizer (clip + step)"):
                engine.step()
            return loss
    else:
        model = our_model(a)
        optimizer = adamw(model.parameters(), fused=a.program == "plain-fused")

        def step(b):
            with record_function("forward"):
                loss = model(**b)
            with record_function("backward"):
                loss.backward()
            with record_function("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            with record_function("optimizer (clip + step)"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return loss

    for i in range(2):  # warm-up
        step(batches[i % len(batches)]).item()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        step(batches[i % len(batches)]).item()
        times.append(time.perf_counter() - t0)
    print(f"{a.program} {a.ds if a.program.startswith('zero') else ''}: median {statistics.median(times) * 1e3:,.0f}"
          f" ms/step over {a.steps} steps (no profiler)", flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof_:
        for i in range(a.steps):
            with record_function("step"):
                step(batches[i % len(batches)]).item()
    events = prof_.key_averages()
    total = next(e for e in events if e.key == "step").cpu_time_total
    print(f"{a.program}, {a.shape}, seq {a.seq} x micro {a.micro}, {a.threads} thread(s): "
          f"{total / a.steps / 1e3:,.0f} ms/step under the profiler")
    for e in events:
        if e.key in ("forward", "backward", "clip", "optimizer (clip + step)"):
            print(f"  {e.key:<26}{e.cpu_time_total / total:6.1%}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=55))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main(sys.argv[1:])
