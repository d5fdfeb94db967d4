"""Resume on another world size: DeepSpeed's universal checkpoint, for ZeRO-1/2/3 with Adam(W).

A ZeRO checkpoint is sharded by data-parallel rank, so DeepSpeed loads it only into the world
size that saved it. `deepspeed.checkpoint.ds_to_universal` rewrites a tag as one directory per
parameter (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, plus `zero/optimizer_state.pt`
and the saved `*model_states.pt` files); an engine whose config has
`"checkpoint": {"load_universal": true}` slices that for any world size.

On a resume whose world size differs from the checkpoint's (after the process group is joined):

    check_supported(ds_config, tag_dir)               # one line before anything is built
    udir = convert_on_rank0(tag_dir)                  # rank 0 converts (or reuses), the others wait
    engine = build_engine(EngineSpec(ds_config_for_universal(ds_config), ...)).engine   # components/engine.py
    client_state = load(engine, udir)                 # weights, Adam state, step, lr scheduler

Nothing has to be added to `client_state` at save time. ZeRO-1/2 conversion needs
`"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}` in the saved model states,
and that is all a model without tensor or pipeline parallelism needs there; the converter's
`--inject_missing_state`, which convert() passes, supplies exactly that. So checkpoints saved
before this module existed convert too, and the key stays out of `client_state`, where
DeepSpeed 0.19's MoE save path already refuses it as reserved.

Not here: the data loader's re-split over the new ranks (dataio), deciding when to resume.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from zerotrain import durable
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.checkpoints.checkpoint import MARKER as COMPLETE_MARKER
from zerotrain.launcher.errors import UsageError

MARKER = "zerotrain_universal.json"  # written last inside the converted tag: what it was made from
ADAM_TYPES = ("adam", "adamw")  # the converter copies exp_avg / exp_avg_sq and nothing else


def universal_dir_for(tag_dir: Path) -> Path:
    """Where the conversion of `checkpoints/global_stepN` goes: `checkpoints/universal/global_stepN`.

    Outside the tag (rotation and mirroring handle tags as DeepSpeed wrote them) and not matching
    the `global_stepN` pattern one level up, so resume never mistakes it for a regular checkpoint.
    """
    return tag_dir.parent / "universal" / tag_dir.name


def _source_files(tag_dir: Path) -> dict[str, list[int]]:
    """DeepSpeed's files of a tag with size and mtime: identifies the source of a conversion (a tag
    saved again, e.g. after a rollback, has the same sizes but new mtimes; hashing would read it all)."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(tag_dir.iterdir()) if p.suffix == ".pt"}


def _saved_stage3(tag_dir: Path) -> bool:
    """ZeRO-3 writes one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank, ZeRO-1/2 one `mp_rank_00_...`."""
    return any(tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))


def check_supported(ds_config: dict, tag_dir: Path | None = None) -> None:
    """Raise UsageError (one line) for what DeepSpeed 0.19's universal checkpoint cannot do.

    Refused: no ZeRO (stage 0: not covered here; DeepSpeed loads universal checkpoints in its ZeRO
    and bf16 optimizers, and an fp32 stage-0 checkpoint is not sharded at all); an optimizer
    other than Adam/AdamW (the converter copies `exp_avg`/`exp_avg_sq` only); NVMe offload of the
    optimizer (the load skips the ZeRO state and copies `offloaded_tensors/`, which a universal
    checkpoint lacks) or of the parameters (the load writes into in-memory partitions that are
    then None); and, with `tag_dir`, a change between ZeRO-3 and ZeRO-1/2 across the resume (the
    ZeRO-3 conversion writes bare tensors and no `step.pt`, which the ZeRO-1/2 loader cannot read;
    the other direction is untested) or a tag whose rank files are not all visible here (the
    conversion needs every rank's files: a filesystem shared by all nodes).
    """
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    where = "resume on another world size"
    if stage not in (1, 2, 3):
        raise UsageError(f"{where}: supported for ZeRO stage 1, 2 or 3 (DeepSpeed's universal checkpoint), this"
                         f" config has stage {stage}")
    opt = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    if opt not in ADAM_TYPES:
        raise UsageError(f"{where}: DeepSpeed's universal conversion carries Adam/AdamW state only, the optimizer is"
                         f" {opt or 'not set in the config'!r}")
    for key in ("offload_optimizer", "offload_param"):
        if str((zero.get(key) or {}).get("device", "none")).lower() == "nvme":
            raise UsageError(f"{where}: DeepSpeed cannot load a universal checkpoint with zero_optimization.{key}"
                             " on NVMe")
    if tag_dir is None:
        return
    if not (tag_dir / COMPLETE_MARKER).is_file():
        raise UsageError(f"checkpoint {tag_dir}: not a complete zerotrain checkpoint (no {COMPLETE_MARKER})")
    if _saved_stage3(tag_dir) != (stage == 3):
        saved = "ZeRO-3" if _saved_stage3(tag_dir) else "ZeRO-1/2"
        raise UsageError(f"checkpoint {tag_dir}: saved under {saved}, this config has ZeRO-{stage}; resuming on"
                         " another world size cannot also change between ZeRO-3 and ZeRO-1/2")
    saved_world = json.loads((tag_dir / COMPLETE_MARKER).read_text()).get("world_size")
    optim = list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    if saved_world is not None and len(optim) != saved_world:
        raise UsageError(f"checkpoint {tag_dir}: saved by {saved_world} ranks but {len(optim)} optimizer shard(s) are"
                         " visible here; converting it needs every rank's files (a filesystem shared by all nodes)")


def is_converted(tag_dir: Path, out_dir: Path | None = None) -> bool:
    """True if `out_dir` holds a finished conversion of `tag_dir` as it is now."""
    out = out_dir or universal_dir_for(tag_dir)
    try:
        made_from = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return tag_dir.is_dir() and made_from.get("source_files") == _source_files(tag_dir)


def convert(tag_dir: Path, out_dir: Path | None = None, workers: int | None = None) -> Path:
    """Convert the complete checkpoint tag `tag_dir` to universal format; returns the converted tag dir.

    One process (rank 0 of a run, or a CLI). Reuses an existing conversion of the same source.
    Runs `python -m deepspeed.checkpoint.ds_to_universal` as a child process rather than calling its
    `main()` here: its worker pools fork, which is unsafe in a process holding CUDA contexts and
    communicator threads; it holds the whole model's fp32 weights and Adam moments at once, freed
    when it exits; and its progress output stays out of the run's log unless it fails.
    Writes into a hidden temporary directory next to `out_dir` and renames it into place, so a kill
    mid-conversion leaves no half-written `out_dir` (the leftover is removed by the next call).
    """
    tag_dir = Path(tag_dir)
    out = Path(out_dir) if out_dir is not None else universal_dir_for(tag_dir)
    if not tag_dir.is_dir():
        raise UsageError(f"checkpoint {tag_dir}: no such directory")
    if is_converted(tag_dir, out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".tmp-{out.name}-*"):  # left by a conversion killed earlier
        shutil.rmtree(stale, ignore_errors=True)
    work = out.parent / f".tmp-{out.name}-{os.getpid()}"
    # The converter writes `latest_universal` next to its output folder; inside `work` it goes away
    # with it (loads always name the tag, never trust a `latest` pointer).
    staged = work / out.name
    n = workers or max(1, min(4, os.cpu_count() or 1))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(staged), "--inject_missing_state",
           "--num_extract_workers", str(n), "--num_merge_workers", str(max(1, n // 2))]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        # the converter's exception is the last line of its stderr (its progress goes to stdout)
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()] or done.stdout.splitlines()
        raise UsageError(f"checkpoint {tag_dir}: DeepSpeed's universal conversion failed (exit {done.returncode}):"
                         f" {lines[-1] if lines else 'no output'}")
    durable.write_json(staged / MARKER, {"source": str(tag_dir.resolve()), "source_files": _source_files(tag_dir),
                                         "seconds": round(time.time() - t0, 2)})
    if out.exists():  # an older conversion of a tag that has since been re-saved
        out.rename(work / "replaced")
    staged.rename(out)  # atomic: `out` is either absent or complete
    durable.fsync_dir(out.parent)
    shutil.rmtree(work, ignore_errors=True)
    return out


def convert_on_rank0(tag_dir: Path, out_dir: Path | None = None, workers: int | None = None,
                     poll_s: float = 0.5, timeout_s: float = 6 * 3600) -> Path:
    """convert() on global rank 0 while every other rank waits; needs torch.distributed initialised.

    The others poll the filesystem rather than block in a collective, so a conversion longer than
    the process group's timeout (30 min by default) does not kill them. A failure on rank 0 is
    written next to the output and raised on every rank as the same one line.
    """
    tag_dir = Path(tag_dir)
    out = Path(out_dir) if out_dir is not None else universal_dir_for(tag_dir)
    failed = out.parent / f".{out.name}.failed"
    if dist.get_rank() == 0:
        failed.unlink(missing_ok=True)
    dist.barrier()  # nobody looks for `failed` before rank 0 has removed an old one
    if dist.get_rank() == 0:
        try:
            convert(tag_dir, out, workers)
        except Exception as e:  # any failure: the others must not wait for an output that never comes
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text((str(e) if isinstance(e, UsageError) else f"checkpoint {tag_dir}: {e!r}") + "\n")
            raise
    else:
        deadline = time.time() + timeout_s
        while not is_converted(tag_dir, out):
            if failed.is_file():
                raise UsageError(failed.read_text().strip())
            if time.time() > deadline:
                raise UsageError(f"checkpoint {tag_dir}: no universal conversion in {out} after {timeout_s:.0f} s;"
                                 " it must be on a filesystem shared with rank 0")
            time.sleep(poll_s)
    dist.barrier()
    return out


def ds_config_for_universal(ds_config: dict) -> dict:
    """A copy of `ds_config` that loads universal checkpoints (`checkpoint.load_universal`).

    DeepSpeed reads the flag only inside `load_checkpoint`, where it switches every load of this
    engine to the universal layout: a later reload of a regular checkpoint (e.g. a rollback to a
    tag saved after the resume) needs an engine without it.
    """
    out = dict(ds_config)
    out["checkpoint"] = {**(ds_config.get("checkpoint") or {}), "load_universal": True}
    return out


def load(engine, universal_tag_dir: Path) -> dict:
    """Load a converted tag into an engine built with ds_config_for_universal; returns the client_state.

    Restores the weights, Adam's moments and step count, the param groups' lr, the lr scheduler's
    state, `engine.global_steps`; the client_state is what rank 0 saved (under ZeRO-3 every rank
    reads rank 0's model-states file). The tag is always named: the converter's `latest_universal`
    pointer is not a completion marker.
    """
    if not engine.load_universal_checkpoint():
        raise RuntimeError("engine was not built with ds_config_for_universal(...): it would read the converted"
                           " directory as a regular checkpoint")
    universal_tag_dir = Path(universal_tag_dir)
    path, client_state = engine.load_checkpoint(str(universal_tag_dir.parent), tag=universal_tag_dir.name,
                                                load_optimizer_states=True, load_lr_scheduler_states=True,
                                                load_module_only=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load universal checkpoint {universal_tag_dir}")
    # ZeRO-Offload's CPU Adam: its bias correction continued as the saved run's (as checkpointer.load does)
    ds_compat.continue_cpu_adam_bias_correction(getattr(engine.optimizer, "optimizer", None))
    return client_state
