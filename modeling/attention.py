"""The attention kernels, one registry entry each: where a kernel runs, the document-mask form it takes, whether it
runs under sequence parallelism, what it adds to activation memory, and what the planner may suggest instead.

Every consumer reads KERNELS: modeling/model.py (the kernel function and the document layout it builds),
modeling/sizes.py (`ATTENTION_BACKENDS`, `choose_attention`, `math_kernel`), launcher/planning (activation
memory, the alternatives a plan lists) and launcher/resolution.py (the run's attention checks). Adding a kernel
is its function in model.py (named by `function`) plus one entry here (tests/test_attention_registry.py checks
that each consumer sees the same names). Nothing here imports torch: `zerotrain plan` decides without it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionKernel:
    """One attention kernel. Refusal texts are the one-line reasons `choose_attention` gives (ValueError)."""
    name: str
    function: str  # modeling/model.py's function: q (B, T, H, hd), k/v (B, T, KV, hd), DocumentLayout -> (B, T, H, hd)
    layout: str  # the document form DocumentLayout.from_positions builds for it: "mask", "block_mask" or "cu_seqlens"
    auto_rank: int | None = None  # auto takes the lowest-ranked kernel that can run here; None: never auto
    devices: tuple[str, ...] = ()  # device types it runs on; () any
    device_refusal: str = ""  # {device_type}: the device asked
    precisions: tuple[str, ...] = ()  # activation precisions ("fp32", "bf16", "fp16") it takes; () any
    precision_refusal: str = ""  # {precision}: the precision asked
    module: str = ""  # a torch module it needs (found without importing it)
    module_refusal: str = ""
    sequence_parallel: bool = True  # runs on the whole row after the Ulysses exchange (heads split over ranks)
    # memory terms (launcher/planning/activations.py activation_bytes has the formulas):
    row_mask: bool = False  # keeps the (T x T) document mask of every row: a float one per layer, a boolean once
    block_mask: bool = False  # keeps flex's BlockMask for the micro-batch (flex_block_mask_bytes)
    accelerator_workspace: bool = False  # on an accelerator, backward keeps fp32 4·H bytes a token of workspace
    math_on_cuda_gqa: bool = False  # PyTorch runs its math kernel on CUDA with packed rows and GQA (sizes.math_kernel)
    math_refusal: str = ""  # why that kernel, named explicitly, is refused there
    compile_on_cpu_refusal: str = ""  # why --compile on a CPU is refused with it (launcher/resolution.py)
    lighter: str = ""  # the kernel the planner suggests instead when memory is short (planning/alternatives.py)


KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel(
        "sdpa", function="sdpa_kernel", layout="mask", auto_rank=1, row_mask=True, math_on_cuda_gqa=True,
        math_refusal="on CUDA, sdpa with packed documents and fewer kv heads than heads (GQA) falls to PyTorch's"
                     " math kernel, (B, H, T, T) fp32 scores per layer (the flash kernel takes no mask, the"
                     " memory-efficient one no GQA): use varlen (bf16/fp16) or flex",
        lighter="flex"),
    AttentionKernel(
        "flex", function="flex_kernel", layout="block_mask", block_mask=True, accelerator_workspace=True,
        # torch 2.13 compiles flex_attention for a CPU without a backward (inductor's CPU lowering fails on
        # the eager operator model.py calls there, and the public function refuses gradients on a CPU)
        compile_on_cpu_refusal="torch cannot compile flex attention with a backward on a CPU (drop --compile, or use"
                               " sdpa)"),
    AttentionKernel(
        "varlen", function="varlen_kernel", layout="cu_seqlens", auto_rank=0,
        devices=("cuda",),
        device_refusal="varlen runs PyTorch's flash kernels, CUDA only; this run is on {device_type} (use sdpa or flex)",
        precisions=("bf16", "fp16"),
        precision_refusal="varlen runs flash kernels, which take bf16 or fp16; this run computes in {precision}"
                          " (enable bf16 in the profile, or use sdpa or flex)",
        module="torch.nn.attention.varlen",
        module_refusal="varlen needs torch.nn.attention.varlen (torch >= 2.9), which this torch lacks (use sdpa or"
                       " flex)"),
)}
