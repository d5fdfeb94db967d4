"""Optimizers written here in plain PyTorch, handed to `deepspeed.initialize(optimizer=...)`.

The family of client optimizers of launcher/optimizers.py (the registry decides when each is
used, with which hyper-parameters, and sets `zero_allow_untested_optimizer`). Each is elementwise
on purpose: under ZeRO-1/2/3 DeepSpeed hands the optimizer flat 1-D fp32 partitions, so a rule
that needs a parameter's matrix shape would be silently wrong there.

- `AdamWDecayingWD` (`adamw-decaying-wd`): AdamW whose weight decay follows the learning-rate
  schedule and decays on its own timescale. The decay is *independent* of the peak lr (the
  convention of the research registry our users bring: a weight decay fitted at one lr stays put
  when the lr is swept): theta <- theta * (1 - wd * (lr_t / lr_peak) / (1 + t / wd_timescale)),
  then the Adam step. Without a timescale it is AdamW with lambda = wd / lr_peak.
- `AdEMAMix` (`ademamix`): Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better,
  Faster, Older", Algorithm 1: a fast EMA m1 (beta1) and a slow EMA m2 (beta3) of the gradient,
  update (m1_hat + alpha_t * m2) / (sqrt(nu_hat) + eps), AdamW-style decoupled weight decay, and
  the paper's warm-up of alpha (linear) and beta3 (log-space, equation 3) over `warmup_steps`.
- `sign_zero_safe(DeepSpeed's Lion class)` (`lion`): DeepSpeed's own Lion kernels with Lion's
  sign(0) = 0 put back (see there why).

The peak lr is kept in each param group (`peak_lr`) rather than read from `initial_lr`: the
schedule (launcher/components/schedule.py) is a LambdaLR created by DeepSpeed after this optimizer, and the
key must survive a checkpoint's param_groups round trip whoever created it.
"""
from __future__ import annotations

import math

import torch


class AdamWDecayingWD(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 3e-4,
                 wd_timescale: float | None = None):
        defaults = dict(lr=lr, peak_lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        wd_timescale=wd_timescale)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            schedule = lr / group["peak_lr"]  # the schedule's factor at this step, 1 at the peak
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                decay = group["weight_decay"] * schedule
                if group["wd_timescale"]:
                    decay /= 1 + t / group["wd_timescale"]
                p.mul_(1 - decay)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq / (1 - beta2 ** t)).sqrt_().add_(eps)
                p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** t))
        return loss


def ademamix_alpha_beta3(t: int, alpha: float, beta1: float, beta3: float, warmup_steps: int | None):
    """alpha_t and beta3_t at step t (1-based) under the paper's warm-up (no warm-up: the final values)."""
    if not warmup_steps:
        return alpha, beta3
    frac = min(1.0, t / warmup_steps)
    # Equation 3: beta3 moves from beta1 to beta3 so that the EMA's half-life grows linearly.
    log_b1, log_b3 = math.log(beta1), math.log(beta3)
    beta3_t = min(math.exp(log_b1 * log_b3 / ((1 - frac) * log_b3 + frac * log_b1)), beta3)
    return alpha * frac, beta3_t


class AdEMAMix(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999, 0.9999), alpha: float = 5.0,
                 warmup_steps: int | None = None, eps: float = 1e-8, weight_decay: float = 0.1):
        defaults = dict(lr=lr, betas=tuple(betas), alpha=alpha, warmup_steps=warmup_steps, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2, beta3), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg_fast"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_slow"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                alpha_t, beta3_t = ademamix_alpha_beta3(t, group["alpha"], beta1, beta3, group["warmup_steps"])
                fast, slow, sq = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]
                fast.lerp_(p.grad, 1 - beta1)
                slow.lerp_(p.grad, 1 - beta3_t)
                sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (sq / (1 - beta2 ** t)).sqrt_().add_(eps)
                update = (fast / (1 - beta1 ** t)).add_(slow, alpha=alpha_t).div_(denom)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr)
        return loss


def sign_zero_safe(base: type) -> type:
    """DeepSpeed's Lion kernel class `base` (FusedLion, DeepSpeedCPULion), with sign(0) = 0 restored.

    Lion's update is -lr * sign(c), c = beta1 * m + (1 - beta1) * g, and sign(0) = 0 (Chen et al.
    2023; torch.sign). DeepSpeed's kernels move an element whose c is exactly 0 by a full step
    anyway: the CPU one by -lr (copysign(lr, +0.0)), the CUDA one by +lr (`c > 0 ? -lr : lr`).
    c is exactly 0 where the gradient and the momentum are: the embedding rows of every token not
    seen yet, which then drift by lr per step (3 per element after 10k steps at 3e-4) until the
    token first appears. Measured on the debug model: the embedding's change was 2.8x off Lion's.
    The kernel still does the work; those elements are put back, with the weight decay applied.
    Under ZeRO the optimizer sees a few flat partitions, so the masks are a few tensors per step.
    """

    class ZeroSafeLion(base):
        @torch.no_grad()
        def step(self, closure=None):
            held = []
            for group in self.param_groups:
                beta1 = group["betas"][0]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    m = self.state[p].get("exp_avg")
                    c = p.grad.float() * (1 - beta1)
                    if m is not None:
                        c += m.float() * beta1
                    mask = c == 0
                    held.append((p, mask, p[mask].clone(), 1 - group["lr"] * group["weight_decay"]))
            loss = super().step(closure)
            for p, mask, before, decay in held:
                p[mask] = before * decay
            return loss

    ZeroSafeLion.__name__ = ZeroSafeLion.__qualname__ = f"SignZeroSafe{base.__name__}"
    return ZeroSafeLion
