"""Harness for tests/test_universal.py, run under the real `deepspeed` launcher (1 or 2 CPU ranks).

Trains the `debug` model (vocab 256) on one fixed random token batch (global batch 8 rows x 64
tokens at every world size: micro 4 x grad-accum 2/world) with each of a ZeRO-2, a ZeRO-3 and a
ZeRO-3 engine with persistent parameters (VARIANTS), and checks DeepSpeed's universal checkpoint
across a world-size change, one phase per launch:

  first  (2 ranks): steps 1..K, save tag K, dump the state at K, then step K+1 (the reference)
  shrink (1 rank):  convert first's tag K, load, compare with first's dumps, step K+1, compare
                    with first's reference; save tag K+1, dump, step K+2 (reference for grow)
  grow   (2 ranks): the same from shrink's tag K+1; then a conversion of a corrupted tag, which
                    must stop both ranks with the same one line

A dump (rank 0, safetensors + JSON) holds the full fp32 master weights, Adam's exp_avg and
exp_avg_sq, Adam's step, the lr and the scheduler's step at a save, and the full weights and
loss of the step after it. Each phase writes result-PHASE-VARIANT.json for the test to assert on.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, without an install
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402

from zerotrain.launcher.resize import universal  # noqa: E402
from zerotrain.launcher.components.engine import EngineSpec, build_engine  # noqa: E402
from zerotrain.launcher.components.process_group import init_process_group  # noqa: E402
from zerotrain.launcher.errors import UsageError  # noqa: E402
from zerotrain.launcher.components.schedule import Schedule  # noqa: E402
from zerotrain.modeling.model import preset  # noqa: E402

warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

K = 3  # the first save
ROWS, MICRO, SEQ, LR = 8, 4, 64, 3e-3
REPO = Path(__file__).resolve().parents[2]


# zero3-persist: ZeRO-3 keeping parameters below 1e6 elements whole on every rank, as the GPU
# profiles do (all of the debug model's); cpu.json partitions every parameter (threshold 0).
# The -bf16 ones (the GPU profiles' precision) are slow on this CPU: run by hand with --variants.
PERSIST = {"stage3_param_persistence_threshold": 1_000_000}
VARIANTS = {  # name: (zero_optimization entries, bf16)
    "zero2": ({"stage": 2}, False), "zero3": ({"stage": 3}, False), "zero3-persist": ({"stage": 3, **PERSIST}, False),
    "zero2-bf16": ({"stage": 2}, True), "zero3-bf16": ({"stage": 3, **PERSIST}, True)}


def ds_config(variant: str, world: int) -> dict:
    cfg = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    cfg.pop("zerotrain")
    zero, bf16 = VARIANTS[variant]
    cfg["zero_optimization"].update(zero)
    cfg["bf16"]["enabled"] = bf16
    cfg["optimizer"]["params"]["lr"] = LR
    accum = ROWS // (MICRO * world)
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=accum, train_batch_size=ROWS)
    return cfg


def batch() -> torch.Tensor:
    """The global batch of every step: rows that follow one fixed random permutation of the
    vocabulary from a random first token, so the loss falls quickly (5.6 -> 4.0 in 5 steps)."""
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(256, generator=g)
    rows = torch.empty(ROWS, SEQ, dtype=torch.long)  # (rows, tokens)
    rows[:, 0] = torch.randint(0, 256, (ROWS,), generator=g)
    for t in range(1, SEQ):
        rows[:, t] = perm[rows[:, t - 1]]
    return rows


def build(variant: str, world: int, universal_load: bool):
    cfg = ds_config(variant, world)
    if universal_load:
        cfg = universal.ds_config_for_universal(cfg)
    sched = lambda opt: LambdaLR(opt, Schedule(LR, LR / 10, 2, 10))  # noqa: E731
    return build_engine(EngineSpec(cfg, preset("debug", vocab_size=256), seed=1337, lr_scheduler=sched)).engine


def train_step(engine, rows: torch.Tensor) -> float:
    """One optimizer step on the global batch `rows`, split over ranks and micro-steps; the mean loss."""
    world, rank = dist.get_world_size(), dist.get_rank()
    accum = ROWS // (MICRO * world)
    total = torch.zeros((), dtype=torch.float64)
    for a in range(accum):
        first = (a * world + rank) * MICRO
        ids = rows[first:first + MICRO]
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        total += loss.detach().double()
    dist.all_reduce(total)
    return total.item() / (accum * world)


def full_state(engine) -> dict[str, torch.Tensor]:
    """Full fp32 master weights and Adam moments by parameter name (a collective under ZeRO-3)."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"param/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    return out


def adam_step(engine) -> float:
    return float(next(iter(engine.optimizer.optimizer.state.values()))["step"])


def scalars(engine) -> dict:
    return {"adam_step": adam_step(engine), "lr": engine.get_lr()[0],
            "scheduler_step": engine.lr_scheduler.last_epoch, "global_steps": engine.global_steps}


def tag_for(step: int) -> str:
    return f"global_step{step}"


def save(engine, ckpt_dir: Path, step: int, client_state: dict) -> None:
    """DeepSpeed's save plus the completion marker as the driver writes it (step, world size).
    Kept apart from zerotrain.launcher.components.checkpoints.checkpoint's Checkpointer: only the tag's format matters here."""
    engine.save_checkpoint(str(ckpt_dir), tag=tag_for(step), client_state=client_state)
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {"step": step, "world_size": dist.get_world_size()}
        (ckpt_dir / tag_for(step) / universal.COMPLETE_MARKER).write_text(json.dumps(meta))
    dist.barrier()


def save_and_continue(engine, step: int, run: Path, data, losses: list[float]) -> None:
    """Save tag `step`, dump the state there, take step+1 as the reference a same-world run gives."""
    state, at_save = full_state(engine), scalars(engine)
    save(engine, run / "checkpoints", step, {"harness": {"step": step, "losses": losses}})
    loss_next = train_step(engine, data)
    after = {k: v for k, v in full_state(engine).items() if k.startswith("param/")}
    if dist.get_rank() == 0:
        save_file(state, str(run / f"state_{step}.safetensors"))
        save_file(after, str(run / f"after_{step + 1}.safetensors"))
        (run / f"dump_{step}.json").write_text(json.dumps({**at_save, "losses": losses,
                                                           "loss_next": loss_next}))


def max_diff(a: dict, b: dict, prefix: str) -> float:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys and set(keys) == {k for k in b if k.startswith(prefix)}, prefix
    return max((a[k] - b[k]).abs().max().item() for k in keys)


def resume(variant: str, phase: str, work: Path, data: torch.Tensor) -> None:
    """Convert the previous phase's checkpoint, load it on this world size, compare, take one step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    root = work / variant
    src_run, step = (root / "first", K) if phase == "shrink" else (root / "shrink", K + 1)
    tag = src_run / "checkpoints" / tag_for(step)
    universal.check_supported(ds_config(variant, world), tag)
    t0 = time.time()
    udir = universal.convert_on_rank0(tag, poll_s=0.05)
    convert_s = time.time() - t0
    engine = build(variant, world, universal_load=True)
    client = universal.load(engine, udir)
    loaded, got = full_state(engine), scalars(engine)
    loss_next = train_step(engine, data)
    after = {k: v for k, v in full_state(engine).items() if k.startswith("param/")}
    if rank == 0:
        saved = load_file(str(src_run / f"state_{step}.safetensors"))
        ref_after = load_file(str(src_run / f"after_{step + 1}.safetensors"))
        dump = json.loads((src_run / f"dump_{step}.json").read_text())
        result = {
            "world": world, "variant": variant, "convert_s": round(convert_s, 2),
            "saved": {k: dump[k] for k in ("adam_step", "lr", "scheduler_step", "global_steps")}, "loaded": got,
            "client_state": client.get("harness"), "expected_client_state": {"step": step, "losses": dump["losses"]},
            "param_diff": max_diff(loaded, saved, "param/"),
            "exp_avg_diff": max_diff(loaded, saved, "exp_avg/"),
            "exp_avg_sq_diff": max_diff(loaded, saved, "exp_avg_sq/"),
            "loss_initial": dump["losses"][0], "loss_before_save": dump["losses"][-1],
            "loss_resumed": loss_next, "loss_same_world": dump["loss_next"],
            "update_size": max_diff(ref_after, saved, "param/"),  # how far the step after the save moved weights
            "update_diff": max_diff(after, ref_after, "param/"),
            "universal_dir": sorted(p.name for p in udir.parent.iterdir()),
        }
        (work / f"result-{phase}-{variant}.json").write_text(json.dumps(result, indent=2))
    if phase == "shrink":  # the 1-rank checkpoint the grow phase starts from
        (root / phase).mkdir(exist_ok=True)
        save_and_continue(engine, step + 1, root / phase, data, client["harness"]["losses"] + [loss_next])


def failing_conversion(work: Path, variant: str) -> None:
    """A conversion that fails on rank 0 must stop every rank with the same one line."""
    bad = work / "corrupt" / "checkpoints" / tag_for(K)
    if dist.get_rank() == 0:
        shutil.copytree(work / variant / "first" / "checkpoints" / tag_for(K), bad)
        shard = bad / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:100])  # a truncated shard
    dist.barrier()
    try:
        universal.convert_on_rank0(bad, poll_s=0.05)
        message = None
    except UsageError as e:
        message = str(e)
    (work / f"result-failure-rank{dist.get_rank()}.json").write_text(json.dumps({"message": message}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("first", "shrink", "grow"), required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--variants", default="zero2,zero3,zero3-persist")
    ap.add_argument("--local_rank", type=int, default=0)  # added by the deepspeed launcher
    opts = ap.parse_args()
    init_process_group()
    data = batch()
    variants = opts.variants.split(",")
    for variant in variants:
        if opts.phase == "first":
            run = opts.work / variant / "first"
            run.mkdir(parents=True, exist_ok=True)
            engine = build(variant, dist.get_world_size(), universal_load=False)
            losses = [train_step(engine, data) for _ in range(K)]
            save_and_continue(engine, K, run, data, losses)
        else:
            resume(variant, opts.phase, opts.work, data)
        dist.barrier()
    if opts.phase == "grow":
        failing_conversion(opts.work, variants[0])


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main()
