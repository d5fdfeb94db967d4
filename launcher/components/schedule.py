"""Learning-rate schedule: linear warmup then cosine decay to min_lr, as a torch LambdaLR.

Written here rather than taken from DeepSpeed's WarmupCosineLR because that one trains its first
two optimizer steps at lr 0 (it reports 0 before it has started, then starts warmup from
`warmup_min_ratio` at iteration 0); here step 1 already uses lr / warmup_steps.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """Multiplier of the peak lr for the optimizer step with 0-based index `s`."""

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, max_steps: int):
        self.min_ratio, self.warmup, self.total = min_lr / lr, warmup_steps, max_steps

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(cfg):
    """A callable for deepspeed.initialize(lr_scheduler=...): optimizer -> LambdaLR."""
    return lambda optimizer: LambdaLR(optimizer, WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps))
