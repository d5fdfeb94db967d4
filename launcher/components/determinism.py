"""Deterministic kernels, and what a resume can promise on this hardware.

On a CPU every kernel torch runs here accumulates in a fixed order: a resumed run's losses equal the
uninterrupted run's bit for bit (tests/test_resume_exact.py). On a GPU the flash/varlen and memory-efficient
attention backward, atomics in scatter/index kernels and cuBLAS's split-K choices accumulate in a varying
order: a resume gets the same data and the same states, and losses equal to within those reductions. With
--deterministic (profile key zerotrain.deterministic) the run asks torch for deterministic algorithms
(`torch.use_deterministic_algorithms(True)`, not warn-only: torch picks the deterministic flash and
memory-efficient attention backward, varlen's included, only then; aten/src/ATen/native/transformers/cuda/
attention_backward.cu reads `deterministicAlgorithmsWarnOnly()`, and warn-only keeps the non-deterministic
kernel with a warning. An operator without a deterministic kernel raises at the first step, naming itself,
instead of silently breaking the promise), a fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, set
before cuBLAS starts) and no cuDNN autotuning; attention `auto` keeps varlen. The cost is the GPU's: the
deterministic backward and the fixed workspace are slower (not measured).
"""
from __future__ import annotations

import os

CUBLAS_WORKSPACE = ":4096:8"


def describe_resume(device: str, deterministic: bool) -> str:
    """One line for start-up and --dry-run: whether a resume on `device` will be bit-identical."""
    if device == "cpu":
        return "resume: bit-identical (CPU kernels accumulate in a fixed order)"
    if deterministic:
        return f"resume: bit-identical on {device} (--deterministic: deterministic kernels, slower)"
    return (f"resume: same data, same states, losses equal to within nondeterministic reductions on {device}"
            " (--deterministic for bit-identical, slower)")


def apply(torch, deterministic: bool) -> None:
    """Before the engine is built (cuBLAS reads its workspace setting when it starts)."""
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)  # warn_only would keep flash attention's non-deterministic backward
    torch.backends.cudnn.benchmark = False
