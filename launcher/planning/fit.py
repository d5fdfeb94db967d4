"""The driver asks the planner first: `fit_check` refuses, before anything is built or written, a resolved run that
cannot fit on this node's device (or, offloaded, in its RAM); `planned_here` is what an out-of-memory end names as
the planned peak; `offload_lines` the start-up's and --dry-run's host lines; `size_auto_micro_batch` the micro-batch
of a profile --profile auto built."""
from __future__ import annotations

import os
from dataclasses import replace

from zerotrain.launcher.errors import UsageError
import zerotrain.launcher.planning.hardware as hardware
from zerotrain.launcher.planning.alternatives import alternatives
from zerotrain.launcher.planning.hardware import Setup
from zerotrain.launcher.planning.host import host_check, offload_devices, offload_summary
from zerotrain.launcher.planning.memory import Memory, max_micro_batch, memory, stage_key
from zerotrain.launcher.planning.report import render_offload, verdict
from zerotrain.launcher.planning.units import GiB, gib
from zerotrain.launcher.profiles import AUTO_ROWS


def planned_here(cfg, model_args, ds_config: dict, knobs: dict, world: int,
                 attention: str | None = None) -> tuple[Memory, Setup, str]:
    """(the run's planned memory per rank by component, the Setup, what the device is in words) on this node's
    device: what fit_check refuses on, and what an out-of-memory end names as the planned peak."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    hw = knobs.get("hardware") or {}
    device_bytes, accel, what = hardware.device_memory_here(hw.get("accelerator", "cuda"), local_world)
    nodes = max(1, world // max(1, local_world))
    here = {**hw, "accelerator": accel}
    setup = hardware.setup_from(ds_config, {**knobs, "hardware": here}, world=max(1, world // nodes) * nodes,
                                nodes=nodes, device_bytes=device_bytes, optimizer=cfg.schedule.optimizer,
                                args=model_args, attention=attention)
    ac = bool(knobs.get("activation_checkpointing"))
    micro = ds_config["train_micro_batch_size_per_gpu"]
    return memory(model_args, setup, stage_key(ds_config), micro, cfg.data.seq_len, ac), setup, what


def fit_check(cfg, model_args, ds_config: dict, knobs: dict, world: int, attention: str | None = None) -> Memory:
    """Refuse (UsageError, the planner's one-line verdict) a resolved run that cannot fit on this device.

    Called by launcher/run_plan.py plan_run before anything is built or written; skipped with
    --no-fit-check. `attention`: the kernel the driver resolved for this node (None: the profile's, else
    auto); `knobs`: the run's resolved settings (hardware, activation_checkpointing). Returns the chosen
    stage's memory by component (bytes).
    """
    m, setup, what = planned_here(cfg, model_args, ds_config, knobs, world, attention)
    device_bytes, accel = setup.device_bytes, setup.accelerator
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    ac = bool(knobs.get("activation_checkpointing"))  # resolved once (launcher/settings.py): flag | profile | off
    micro = ds_config["train_micro_batch_size_per_gpu"]
    if m.total > device_bytes:
        plan = {"hardware": {"world": setup.world, "device_memory_gib": gib(device_bytes), "accelerator": accel},
                "zero_stage": stage, "activation_checkpointing": ac, "micro_batch": micro, "seq_len": cfg.data.seq_len,
                "memory_per_gpu_gib": gib(m.total), "fits": False,
                "headroom_gib": round(gib(device_bytes) - gib(m.total), 2),
                "would_fit": alternatives(model_args, setup, stage, micro, cfg.data.seq_len, ac)}
        raise UsageError(f"{verdict(plan)} [{what}; `zerotrain plan` for the table; --no-fit-check to try anyway]")
    host_check(model_args, replace(setup, host_bytes=hardware.available_ram()), stage_key(ds_config), micro,
               cfg.data.seq_len, ac, ds_config.get("gradient_accumulation_steps", 1), "this node's RAM available now")
    return m


def offload_lines(args, ds_config: dict, knobs: dict, world: int, seq_len: int, attention: str | None,
                  refuse: bool) -> list[str]:
    """The start-up's and --dry-run's host-memory and traffic lines for an offloaded run, on the profile's
    hardware (none without offload); `refuse` (a dry run): UsageError, one line, when the profile's host memory
    (zerotrain.hardware.host_memory_gib) cannot hold it."""
    hw = knobs.get("hardware") or {}
    if not offload_devices(stage_key(ds_config), ds_config.get("zero_optimization") or {}):
        return []
    nodes = hw.get("nodes", 1)
    setup = hardware.setup_from(ds_config, knobs, world=world, nodes=nodes if world % nodes == 0 else 1,
                                device_bytes=float(hw.get("device_memory_gib", 1)) * GiB, attention=attention)
    micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config.get("gradient_accumulation_steps", 1)
    ac = bool(knobs.get("activation_checkpointing"))
    stage = stage_key(ds_config)
    if refuse:
        host_check(args, setup, stage, micro, seq_len, ac, accum, "a node (zerotrain.hardware.host_memory_gib)")
    return render_offload({"hardware": {"accelerator": setup.accelerator},
                           **offload_summary(args, setup, stage, micro, seq_len, ac, accum)}, rows=False)


def size_auto_micro_batch(profile: dict, cfg, model_args, knobs: dict, world: int) -> dict:
    """The micro-batch of a profile --profile auto built (train_micro_batch_size_per_gpu "auto": profiles.build_profile)
    when no --micro-batch is given: the largest power of two up to AUTO_ROWS whose memory fits the profile's device
    (the node's own memory, recorded when it was built), and grad accum making up AUTO_ROWS rows per device per step,
    so a step trains the same rows on a 24 GiB and an 8 GiB GPU, only split differently. Any other profile: unchanged.
    The run (run_plan.plan), --dry-run and `zerotrain plan` all size it here."""
    if profile.get("train_micro_batch_size_per_gpu") != "auto" or profile.get("gradient_accumulation_steps") != "auto" \
            or cfg.schedule.micro_batch is not None:
        return profile
    setup = hardware.setup_from(profile, knobs, world=world, nodes=1, optimizer=cfg.schedule.optimizer,
                                args=model_args, attention=cfg.parallel.attention)
    fits = max_micro_batch(model_args, setup, stage_key(profile), cfg.data.seq_len,
                           bool(knobs.get("activation_checkpointing")))
    micro = 1
    while micro * 2 <= min(fits, AUTO_ROWS):
        micro *= 2
    return {**profile, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": "auto" if cfg.schedule.grad_accum is not None or cfg.schedule.global_batch_tokens is not None
            else AUTO_ROWS // micro}
