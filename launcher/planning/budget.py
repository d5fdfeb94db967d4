"""Time and money: tokens/s = MFU × peak FLOP/s × GPUs / FLOPs per token (model FLOPs: recomputation under
activation checkpointing is not counted, so an AC profile's expected MFU is lower), slowed by the seconds per step
not overlapped with compute (the host link's with offload, the sequence-parallel all-to-all's). The MFU default is
the profile's `zerotrain.expected_mfu`; `zerotrain.mfu_threshold` (0.75 × expected) is pre-flight's.
Compute-optimal (Chinchilla): C = 6·N·D with the plan's N and D, D_opt = 20·N_opt, so N_opt = √(C/120).
"""
from __future__ import annotations

import math

CHINCHILLA_TOKENS_PER_PARAM = 20


def budget(params: int, fpt: float, tokens_per_step: int, world: int, peak: float | None, mfu: float | None,
           total_tokens, max_hours, budget_usd, gpu_hour_usd, max_steps, tokens_set_length=False,
           comm_s_per_step: float = 0.0) -> dict:
    """Steps, tokens, hours and dollars; the binding limit is the one that allows the fewest tokens.
    `comm_s_per_step`: the seconds per step not overlapped with compute (the host link's with offload, the
    sequence-parallel all-to-all's), added to the compute's."""
    out = {"mfu": mfu, "tokens_per_s": None}
    tps = mfu * peak * world / fpt if peak and mfu else None
    if tps is not None and comm_s_per_step:
        tps = tokens_per_step / (tokens_per_step / tps + comm_s_per_step)
    limits = {}
    if total_tokens is not None:
        limits["total_tokens"] = total_tokens
    if tps is not None:
        if max_hours is not None:
            limits["max_hours"] = max_hours * 3600 * tps
        if budget_usd is not None and gpu_hour_usd:
            limits["budget_usd"] = budget_usd / (gpu_hour_usd * world) * 3600 * tps
    if limits:
        binding = min(limits, key=limits.get)
        steps = int(limits[binding] // tokens_per_step)
        if binding == "total_tokens" and tokens_set_length:  # the run's length: rounded up to a whole last step
            steps = -(-total_tokens // tokens_per_step)
    else:
        binding, steps = "max_steps", max_steps or 0
    tokens = steps * tokens_per_step
    out.update(binding=binding, steps=steps, tokens=tokens, tokens_per_param=round(tokens / params, 3),
               chinchilla_tokens_per_param=CHINCHILLA_TOKENS_PER_PARAM)
    if tps is not None:
        hours = tokens / tps / 3600
        out.update(tokens_per_s=round(tps, 1), hours=round(hours, 2),
                   usd=round(hours * world * gpu_hour_usd, 2) if gpu_hour_usd else None)
    else:
        out.update(hours=None, usd=None)
    compute = 6 * params * tokens  # Chinchilla's C = 6 N D on the plan's own N and D
    n_opt = math.sqrt(compute / (6 * CHINCHILLA_TOKENS_PER_PARAM)) if compute else 0
    out["compute_optimal"] = {"flops": compute, "params": round(n_opt),
                              "tokens": round(CHINCHILLA_TOKENS_PER_PARAM * n_opt)}
    return out
