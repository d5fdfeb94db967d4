"""The real driver (`zerotrain.launcher.trainer.run`), its per-step pieces timed in place: where a zerotrain step's
time goes outside DeepSpeed (fetch, agree, logging) and what a profile setting changes. One program,
not a comparison: `make bench` compares; this is the tool behind several figures in RESULTS.md.

    python benchmarks/driver_steps.py [--shape debug|d8] [--stage 2|3] [--steps N]
                                      [--optimizer-params JSON] [--zero JSON] [--compile] [--bind]
                                      [--health-window S | --no-health]
    deepspeed --num_gpus 2 benchmarks/driver_steps.py ...      the same on 2 ranks (rank 0 prints)

The profile is `cpu` at --stage, with --optimizer-params merged into its optimizer's params and
--zero into its zero_optimization (e.g. --zero '{"contiguous_gradients": false}'). --bind pins each
rank to one core (os.sched_setaffinity, before torch starts its threads). Prints the first four
training steps' seconds (compilation shows there) and, per piece, the median over the steps after
the third. The run directory goes to a temporary directory, removed at the end. `health.observe` is the
health check's bookkeeping (components/participants/health.py): --health-window S closes its windows every S
seconds (0.001: at every step, the worst case), --no-health leaves the participant out (the A/B of its cost).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PIECES = ("fetch", "accept", "train_step", "agree", "save")  # the Trainer's; and the participants' hooks


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="debug", choices=("debug", "d8"))
    p.add_argument("--stage", type=int, default=2, choices=(2, 3))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--optimizer-params", default="{}")
    p.add_argument("--zero", default="{}")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--bind", action="store_true")
    p.add_argument("--health-window", type=float, help="the profile's zerotrain.health.window_s")
    p.add_argument("--no-health", action="store_true", help="leave the health participant out")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    a = p.parse_args(argv)
    if a.bind:
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % (os.cpu_count() or 1)})
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/run.py
    from harness import demo_mix

    import zerotrain.launcher.trainer as trainer
    from zerotrain.launcher.components import participants
    from zerotrain.launcher.components.participants.health import HealthWatch
    from zerotrain.launcher.components.observe.metrics import StepLogger
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.profiles import load_profile

    _, prof = load_profile("cpu")
    prof["zero_optimization"] = {**prof["zero_optimization"], "stage": a.stage, **json.loads(a.zero)}
    prof["optimizer"]["params"].update(json.loads(a.optimizer_params))
    if a.health_window:
        prof["zerotrain"]["health"] = {"window_s": a.health_window}
    if a.no_health:
        HealthWatch.from_run = classmethod(lambda cls, run: None)
    # Every rank must name the same directory: the launcher's port tells this launch from another.
    work = Path(tempfile.gettempdir()) / f"zerotrain-driver-steps-{os.environ.get('MASTER_PORT', os.getpid())}"
    work.mkdir(exist_ok=True)
    tmp = work / f"profile.json.{os.getpid()}"  # every rank writes the same file: atomically
    tmp.write_text(json.dumps(prof))
    os.replace(tmp, work / "profile.json")
    times = collections.defaultdict(list)

    def timed(cls, name, label=None):
        fn = getattr(cls, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            times[label or name].append(time.perf_counter() - t0)
            return out
        setattr(cls, name, wrapper)

    for name in PIECES:
        timed(trainer.Trainer, name)
    for cls in participants.ORDER:
        for hook in ("contribute", "observe", "logged"):
            if hook in vars(cls):  # its own, not the protocol's no-op
                timed(cls, hook, f"{cls.name}.{hook}")
    timed(StepLogger, "log")
    timed(trainer.Trainer, "_loop")  # the whole loop: its mean step
    cfg = {"profile": str(work / "profile.json"), "data": str(demo_mix()), "seq_len": 256,
           "micro_batch": 8 if a.shape == "debug" else 4, "grad_accum": 1, "lr": 3e-3, "warmup_steps": 2,
           "max_steps": a.steps, "seed": 1, "out": str(work / "runs"), "resume": "never",
           "log_data_every_steps": 0, "compile": a.compile or None}
    cfg.update({"model": "debug"} if a.shape == "debug" else {"depth": 8, "aspect_ratio": 64, "head_dim": 64})
    trainer.single_process_env()
    try:
        trainer.run(config_from(cfg), hard_exit=False)
    finally:
        if os.environ.get("RANK", "0") == "0":
            shutil.rmtree(work, ignore_errors=True)
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"first steps (s): {[round(x, 2) for x in times['train_step'][:4]]}")
    print(f"loop: {times.pop('_loop')[0] / a.steps * 1e3:.2f} ms per step (mean over {a.steps})")
    for name, xs in times.items():
        xs = xs[3:] if len(xs) > 5 else xs
        print(f"{name:26s} n={len(xs):3d} median {statistics.median(xs) * 1e3:9.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
