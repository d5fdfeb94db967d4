"""The machine this process runs on, asked once: `Node.here()` (cached for the process), or
`Node.of_profile(hardware)` for a dry run, which is resolved against the hardware a profile was written for.

    device       "cuda" or "cpu": what DeepSpeed trains on (DS_ACCELERATOR if set, else CUDA when torch sees
                 a GPU; asked of torch rather than of deepspeed.accelerator, whose import logs a warning line
                 before a refusal's one line)
    count        CUDA devices on this node (0 on a CPU)
    name         the device's name ("NVIDIA H100 80GB HBM3", "cpu (16 cores)")
    memory       bytes of one device (this rank's: LOCAL_RANK's), None on a CPU (RAM is shared: the planner
                 divides what is available among the node's ranks when it asks)
    varlen       torch has the varlen attention kernel (modeling/sizes.py `varlen_available`)
    cpu_bf16     the CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)
    cuda_bf16    the GPU has bf16 tensor cores (compute capability 8.0 or later: Ampere, Ada, Hopper, ...)

Everything that asks "which device am I on?" reads a Node: profile auto-detection, the device checks and
the attention kernel of plan_run, the planner's fit check, pre-flight's device line, the optimizer
registry's kernel choice, the notebook's launch.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from zerotrain.modeling.sizes import varlen_available


@dataclass(frozen=True)
class Node:
    device: str
    count: int
    name: str
    memory: float | None
    varlen: bool
    cpu_bf16: bool
    probed: bool = True  # False: described from a profile's hardware (a dry run)
    cuda_bf16: bool = False

    @staticmethod
    @functools.cache
    def here() -> "Node":
        """This process's machine, probed once (torch is imported here: it is about to be used)."""
        import torch

        cpu_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                        or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
        cuda = torch.cuda.is_available()
        device = os.environ.get("DS_ACCELERATOR") or ("cuda" if cuda else "cpu")
        if device == "cuda" and cuda:
            count = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0)) % count)
            return Node("cuda", count, props.name, float(props.total_memory), varlen_available(), cpu_bf16,
                        cuda_bf16=props.major >= 8)
        return Node(device, 0, f"cpu ({os.cpu_count()} cores)", None, varlen_available(), cpu_bf16)

    @staticmethod
    def of_profile(hardware: dict) -> "Node":
        """The machine a profile's `zerotrain.hardware` describes: a CUDA machine with a torch that has the
        varlen kernel unless it says "cpu"."""
        device = hardware.get("accelerator", "cuda")
        gib = hardware.get("device_memory_gib")
        return Node(device, hardware.get("devices_per_node", 1) if device == "cuda" else 0,
                    ", ".join(hardware.get("name_contains", [])) or device, gib * 2**30 if gib else None,
                    varlen=True, cpu_bf16=False, probed=False)
