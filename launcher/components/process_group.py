"""The process group, set up one way for training (the Trainer) and pre-flight (which then builds Trainers
that reuse it).

deepspeed and its accelerator are imported inside the function: importing deepspeed takes seconds, and
only a process that joins a group pays for it.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

COMM_TIMEOUT_S = 1800.0  # torch's own default for gloo; DeepSpeed's init_distributed would give 10 minutes


def comm_timeout_s(zt: dict, hang_timeout: float | None = None) -> float:
    """How long one collective may wait before the backend fails it: the profile's `comm_timeout_s`, else
    the larger of 30 minutes and twice the hang timeout given (`--hang-timeout`, `zerotrain.hang_timeout`).
    Longer than the hang watchdog's (default 600 s) on purpose: on gloo, where a blocked collective only
    raises "timed out" once this expires, the watchdog fires first and says where every rank was
    (components/observe/watchdog.py); this is the backstop when the watchdog is off. NCCL: docs/hangs.md."""
    given = zt.get("comm_timeout_s")
    return float(given) if given else max(COMM_TIMEOUT_S, 2.0 * (hang_timeout or 0.0))


def init_process_group(zt: dict, hang_timeout: float | None = None):
    """Join (or reuse) the process group and pin this rank's device; returns (torch.distributed, accelerator).

    `zt`: the profile's "zerotrain" section (its `dist_backend`, else the accelerator's own: nccl on
    CUDA, gloo on CPU; the collectives' timeout: `comm_timeout_s`). A group already initialised is
    reused: a notebook's second run(), or pre-flight's scratch Trainers. On a CPU node without
    OMP_NUM_THREADS the node's cores are shared between its ranks (torch would give each rank all of
    them, and the ranks would fight over them)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=zt.get("dist_backend") or accel.communication_backend_name(),
                                   timeout=timedelta(seconds=comm_timeout_s(zt, hang_timeout)))
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return dist, accel
