"""The process group, set up one way for training (the Trainer) and pre-flight (which then builds Trainers
that reuse it).

torch, deepspeed and the accelerator are imported inside the function: they are heavy, and this
module sits among components that `zerotrain runs`/`report` import without torch.
"""
from __future__ import annotations

import os


def init_process_group(zt: dict):
    """Join (or reuse) the process group and pin this rank's device; returns (torch.distributed, accelerator).

    `zt`: the profile's "zerotrain" section (its `dist_backend`, else the accelerator's own: nccl on
    CUDA, gloo on CPU). A group already initialised is reused: a notebook's second run(), or
    pre-flight's scratch Trainers. On a CPU node without OMP_NUM_THREADS the node's cores are shared
    between its ranks (torch would give each rank all of them, and the ranks would fight over them)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=zt.get("dist_backend") or accel.communication_backend_name())
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return dist, accel
