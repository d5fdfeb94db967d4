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

from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.settings import COMM_TIMEOUT_S


def init_process_group(dist_backend: str | None = None, comm_timeout_s: float = COMM_TIMEOUT_S):
    """Join (or reuse) the process group and pin this rank's device; returns (torch.distributed, accelerator).

    The resolved settings (launcher/settings.py): `dist_backend` (None: the accelerator's own, nccl on
    CUDA, gloo on CPU) and `comm_timeout_s`, how long one collective may wait before the backend fails
    it (the profile's, else the larger of 30 minutes and twice the hang timeout; the same for pre-flight
    and the run, as pre-flight's Trainers reuse this group; a test harness: the defaults). A group already initialised is
    reused: a notebook's second run(), or pre-flight's scratch Trainers. On a CPU node without
    OMP_NUM_THREADS the node's cores are shared between its ranks (torch would give each rank all of
    them, and the ranks would fight over them)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist_backend or accel.communication_backend_name(),
                                   timeout=timedelta(seconds=comm_timeout_s))
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return dist, accel
    # DeepSpeed's CPU all-reduce maps one ~66 MB /dev/shm file per rank and never removes it: every process
    # that joins here (the driver, pre-flight, a harness, a notebook, a benchmark) drops its own file's name
    # once every rank has mapped every file (each rank maps them all inside init_distributed, so a barrier
    # is enough). The mappings stay valid; a killed rank leaves nothing behind.
    if dist.get_world_size() > 1:
        dist.barrier()
    ds_compat.unlink_shm_buffer(dist.get_rank())
    if "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return dist, accel


def rendezvous_store(timeout_s: float):
    """A client of the launch's rendezvous store (MASTER_ADDR:MASTER_PORT, hosted by rank 0's launcher-given
    TCPStore): a channel between the ranks that still works while the process group is stuck inside a
    collective (pre-flight's out-of-memory agreement)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
