"""Test harness for launcher/components/checkpoints/checkpointer.py's Checkpointer under a real `deepspeed` launch
(tests/test_checkpointer.py), and the measurement of how long a save blocks the loop.

The debug model under ZeRO-3 with the cpu profile's settings, trained on random tokens.

`check` (run with ZEROTRAIN_TEST_FAIL_SAVE=1:3): saves at steps 1..6 with --keep-last 2 and a
mirror, step 2 marked best. Step 3 fails on rank 1 through the test hook (a half-written file,
ENOSPC); step 5 fails on rank 0 for real: its file-size limit (RLIMIT_FSIZE) is lowered so that
torch.save's write fails with EFBIG. Both must fail on every rank with a CheckpointError, no hang.
Then the step 6 checkpoint is loaded back after one more step and must restore the weights.
Each rank writes OUT_DIR/rank{r}.json; rank 0 adds what is on disk.

`measure`: per save, how long save() blocks the caller, without and with --mirror, waiting for
each save's marker and mirror copy between saves, then back to back (the background work of one
save overlapping the next). Prints one JSON line on rank 0.

Usage: deepspeed --num_gpus 2 tests/helpers/ckpt_harness.py check OUT_DIR
       deepspeed --num_gpus 2 tests/helpers/ckpt_harness.py measure OUT_DIR [SAVES [PRESET]]
"""
from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)

warnings.filterwarnings("ignore", category=FutureWarning)

SEED, SEQ_LEN, MICRO_BATCH = 1234, 64, 2


def build(model_preset: str = "debug"):
    import torch

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.model import preset

    dist, _ = init_process_group()
    world = dist.get_world_size()
    _, profile = load_profile("cpu")
    ds_config = {k: v for k, v in profile.items() if k != "zerotrain"}
    ds_config.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1,
                     train_batch_size=MICRO_BATCH * world)
    args = preset(model_preset)
    engine = build_engine(EngineSpec(ds_config, args, seed=SEED)).engine  # the cpu profile: ZeRO-3 under zero.Init
    gen = torch.Generator().manual_seed(SEED + dist.get_rank())

    def train_step():
        ids = torch.randint(0, args.vocab_size, (MICRO_BATCH, SEQ_LEN), generator=gen)
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()

    return engine, train_step


def fingerprint(engine) -> float:
    """Sum of every full parameter (gathered: collective under ZeRO-3)."""
    import deepspeed
    import torch

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        return float(sum(p.double().sum() for p in params))


def check(out: Path) -> None:
    import torch.distributed as dist

    from zerotrain.launcher.components.checkpoints.checkpoint import (BEST, MARKER, complete_checkpoints, incomplete_checkpoints,
                                                          read_meta, tag_for, verify)
    from zerotrain.launcher.components.checkpoints.checkpointer import load
    from zerotrain.launcher.components import faults
    from zerotrain.launcher.components.hooks import TestHooks
    from zerotrain.launcher.errors import CheckpointError

    engine, train_step = build()
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir, mirror = out / "run" / "checkpoints", out / "mirror"
    said = []
    # ZEROTRAIN_TEST_FAIL_SAVE from the test: its faulty stand-in, built as the run builds its own
    ckpt = faults.checkpointer(TestHooks.from_env(), ckpt_dir, "run", rank, world, keep_last=2, mirror=mirror,
                               say=said.append)
    result = {"errors": {}, "save_s": {}}
    for step in range(1, 7):
        train_step()
        limit = None
        if step == 5 and rank == 0:  # a real failed write on rank 0: a file-size limit it exceeds
            ckpt.wait()  # the background threads must not hit the limit
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        t0 = time.perf_counter()
        try:
            ckpt.save(engine, step, {"zerotrain": {"step": step}}, {"step": step, "world_size": world, "run_id": "run"})
        except CheckpointError as e:
            result["errors"][step] = str(e)
        finally:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        result["save_s"][step] = round(time.perf_counter() - t0, 3)
        if step == 2:
            ckpt.mark_best(tag_for(2), 2, 1.0)
    saved_weights = fingerprint(engine)
    train_step()
    moved_weights = fingerprint(engine)
    client_state = load(engine, ckpt_dir / tag_for(6))
    result.update(saved_weights=saved_weights, moved_weights=moved_weights, loaded_weights=fingerprint(engine),
                  loaded_step=client_state["zerotrain"]["step"])
    ckpt.close()
    if rank == 0:
        tags = lambda paths: [p.name for p in paths]  # noqa: E731
        result.update(
            said=said,
            local=tags(complete_checkpoints(ckpt_dir)), local_incomplete=tags(incomplete_checkpoints(ckpt_dir)),
            mirror=tags(complete_checkpoints(mirror / "run" / "checkpoints")),
            mirror_leftovers=sorted(p.name for p in (mirror / "run" / "checkpoints").iterdir()
                                    if p.name.startswith(".")),
            best=json.loads((ckpt_dir / BEST).read_text()),
            mirror_best=json.loads((mirror / "run" / "checkpoints" / BEST).read_text()),
            verify={str(p): verify(p) for d in (ckpt_dir, mirror / "run" / "checkpoints")
                    for p in complete_checkpoints(d)},
            marker_files={p.name: sorted(read_meta(p)["files"]) for p in complete_checkpoints(ckpt_dir)},
            on_disk={p.name: sorted(f.relative_to(p).as_posix() for f in p.rglob("*")
                                    if f.is_file() and f.name != MARKER) for p in complete_checkpoints(ckpt_dir)},
            latest=(ckpt_dir / "latest").read_text())
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def measure(out: Path, saves: int, model_preset: str) -> None:
    import torch.distributed as dist

    from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer

    engine, train_step = build(model_preset)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for label, mirror in (("no_mirror", None), ("mirror", out / "mirror")):
        ckpt = Checkpointer(out / f"run-{label}" / "checkpoints", "run", rank, world, keep_last=2, mirror=mirror,
                            say=lambda m: None)
        blocked, marker, mirrored, back_to_back = [], [], [], []
        for i in range(1, saves + 1):  # each save's background work finished before the next
            train_step()
            ckpt.save(engine, i, {"zerotrain": {"step": i}}, {"step": i, "world_size": world})
            blocked.append(ckpt.last_blocked_s)
            t0 = time.perf_counter()
            ckpt.wait(mirror=False)
            marker.append(time.perf_counter() - t0)
            ckpt.wait()
            mirrored.append(time.perf_counter() - t0)
            dist.barrier()
        size = sum(f.stat().st_size for f in (out / f"run-{label}" / "checkpoints" / f"global_step{saves}").rglob("*")
                   if f.is_file())
        for i in range(saves + 1, 2 * saves + 1):  # no waiting: the next save overlaps the background work
            train_step()
            ckpt.save(engine, i, {"zerotrain": {"step": i}}, {"step": i, "world_size": world})
            back_to_back.append(ckpt.last_blocked_s)
        ckpt.close()
        med = lambda xs: round(statistics.median(xs) * 1000, 1)  # noqa: E731
        report[label] = {"save_blocks_ms": med(blocked), "then_marker_ms": med(marker),
                         "then_mirror_ms": med(mirrored) if mirror else None,
                         "save_blocks_back_to_back_ms": med(back_to_back),
                         "checkpoint_bytes": size}
    if rank == 0:
        print("MEASURE " + json.dumps({"model": model_preset, "world": world, "saves": saves, **report}), flush=True)


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
        mode, out_dir = argv[0], Path(argv[1])
        out_dir.mkdir(parents=True, exist_ok=True)
        if mode == "check":
            check(out_dir)
        else:
            measure(out_dir, int(argv[2]) if len(argv) > 2 else 5, argv[3] if len(argv) > 3 else "debug")
