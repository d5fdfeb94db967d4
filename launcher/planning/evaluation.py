"""What `--eval-tasks` costs a run: how many scorings, and the time of one from its FLOPs.

    every_steps(every, tokens)    --eval-tasks-every in optimizer steps
    scorings(start, end, every)   the steps a run scores its tasks at over (start, end]: every `every` steps
                                  (components/participants/eval_tasks.py `due`) and the last step, once
    eval_cost(...)                per scoring: the requests, the busiest rank's forward positions, and the seconds
                                  = positions x forward FLOPs per position / (MFU x peak FLOP/s); per run: x scorings

A scoring is forward-only: a third of the training FLOPs per position (modeling/sizes.py `flops_per_token`
counts 6N + attention; the forward is 2N + its third of attention), at the model's length (an upper bound: the
attention term is counted at full length). The positions are what the busiest rank runs, padding included
(components/tasks `forward_positions`); they are known once the tasks are loaded (the start-up and --dry-run);
`zerotrain plan` does not load tasks, so it gives the number of scorings and leaves the time to the first
scoring's `eval_tasks_s`. lm-eval's own request building and metric computation are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalCost:
    scorings: int | None  # None: the run's length is not known in steps (a --max-hours budget)
    every: int  # steps between scorings (0: only at the end)
    requests: int | None = None  # per scoring (after --eval-limit); None: the tasks are not loaded
    positions: int | None = None  # the busiest rank's forward positions per scoring
    seconds: float | None = None  # per scoring, from the FLOPs; None without a peak FLOP/s and an MFU

    @property
    def total_seconds(self) -> float | None:
        return self.seconds * self.scorings if self.seconds is not None and self.scorings is not None else None

    def as_dict(self) -> dict:
        return {"scorings": self.scorings, "every_steps": self.every, "requests_per_scoring": self.requests,
                "forward_positions_per_scoring": self.positions, "seconds_per_scoring": self.seconds,
                "seconds": self.total_seconds}


def every_steps(every: tuple[int, str] | None, tokens_per_step: int) -> int:
    """The cadence in optimizer steps (0: only at the end); a token cadence rounds up to whole steps."""
    if every is None:
        return 0
    n, unit = every
    return n if unit == "steps" else max(1, math.ceil(n / tokens_per_step))


def scorings(start: int, end: int | None, every: int) -> int | None:
    """Scorings over the steps (start, end]: each multiple of `every`, and `end` when it is not one."""
    if end is None:
        return None
    if end <= start:
        return 0
    n = end // every - start // every if every else 0
    return n + (0 if every and end % every == 0 else 1)


def eval_cost(start: int, end: int | None, every: int, requests: int | None = None, positions: int | None = None,
              forward_flops_per_position: float | None = None, peak_flops: float | None = None,
              mfu: float | None = None) -> EvalCost:
    seconds = None
    if positions is not None and forward_flops_per_position and peak_flops and mfu:
        seconds = positions * forward_flops_per_position / (mfu * peak_flops)
    return EvalCost(scorings(start, end, every), every, requests, positions, seconds)


def describe_cost(cost: EvalCost, mfu: float | None = None) -> str:
    """The cost as the start-up, --dry-run and `zerotrain plan` say it."""
    when = f"every {cost.every} steps and at the end" if cost.every else "at the end"
    count = f"{cost.scorings} scoring(s) ({when})" if cost.scorings is not None else f"scored {when}"
    if cost.requests is None:
        return (f"eval tasks cost: {count}; the time per scoring is measured at the first scoring (eval_tasks_s in"
                " metrics.jsonl): the tasks are loaded at start-up, not by the plan")
    size = f"{cost.requests:,} requests per scoring ({cost.positions:,} forward positions on the busiest rank)"
    if cost.seconds is None:
        return (f"eval tasks cost: {count}, {size}; no peak FLOP/s or MFU in the profile: the time per scoring is"
                " measured at the first scoring")
    total = f", {cost.total_seconds:.3g} s per run" if cost.total_seconds is not None else ""
    return (f"eval tasks cost: {count}, {size}: ~{cost.seconds:.3g} s per scoring at MFU {mfu:g} (forward"
            f" FLOPs){total}")
