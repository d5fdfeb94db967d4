"""--max-hours, --total-tokens, --budget-usd (guards.Budget): rank 0's clock decides before the gather
whether the next step still fits (with the last save's duration in reserve); the run stops after this
step's save-worthy work, on every rank at once (budget, exit 5)."""
from __future__ import annotations

import torch

from zerotrain.launcher.components.guards import Budget
from zerotrain.launcher.components.run_state import RunState
from zerotrain.launcher.components.participants.base import Field, Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class BudgetStop(Participant):
    name, saved_as = "budget", "budget"
    reads, reads_logged = ("step_time", "trained_at"), ("agreed",)  # contribute's, logged's

    def __init__(self, state: RunState, budget: Budget, tokens_per_step: int, dist=None, device=None):
        self.state, self.budget, self.tokens_per_step = state, budget, tokens_per_step
        self.dist, self.device = dist, device
        self.why: str | None = None
        # the last step's time and the save's, kept in the checkpoint: what the stop reserved, and what a run
        # started again after it reserves for its first step (0 s would let it train one step past the limit)
        self.step_time_s, self.save_s = 0.0, 0.0

    @classmethod
    def from_run(cls, run: Run) -> "BudgetStop":
        return cls(run.state, run.budget, run.tokens_per_step, run.dist, run.engine.device)

    def fields(self) -> list[Field]:
        return [Field("over_budget", "rank0", "flag")]

    def over_before(self) -> StopRun | None:
        """A resumed run whose next step would go over --total-tokens, or whose training time (its checkpoint's)
        plus the step and save times it kept is past --max-hours / --budget-usd: over, before any step (it
        stopped there). Every rank decides on the largest times any rank loaded (one tiny all-reduce)."""
        step_s, save_s = self._agreed_times()
        why = self.budget.exceeded_after_next(self.state.elapsed_before, step_s, self.state.tokens_seen,
                                              self.tokens_per_step, reserve_s=save_s)
        return StopRun("budget", f"budget reached before step {self.state.step + 1}: {why}") if why else None

    def _agreed_times(self) -> tuple[float, float]:
        times = [self.step_time_s, self.save_s]
        if self.dist is not None and (self.budget.max_hours is not None or self.budget.budget_usd is not None):
            t = torch.tensor(times, dtype=torch.float64, device=self.device)
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            times = t.tolist()
        return times[0], times[1]

    def contribute(self, step: StepState) -> dict:
        """The next step would end past the limit? Counted from now, the next step's batches fetched: it trains
        them (its compute, and its data wait as this step had) and fetches the step after's (a stop saves
        then), hence this step's compute and data wait from now."""
        tps = self.tokens_per_step
        self.step_time_s, self.save_s = step.step_time, self.state.last_save_s
        now = step.fetched_at if step.fetched_at is not None else step.trained_at
        self.why = self.budget.exceeded_after_next(self.state.elapsed(now), step.step_time,
                                                   self.state.tokens_seen + tps, tps, reserve_s=self.state.last_save_s)
        return {"over_budget": self.why is not None}

    def state_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "save_s": self.save_s}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.step_time_s, self.save_s = float(state.get("step_time_s", 0.0)), float(state.get("save_s", 0.0))

    def logged(self, step: StepState) -> StopRun | None:
        if step.agreed["over_budget"]:
            return StopRun("budget", f"budget reached at step {step.step}:"
                                     f" {self.why or 'rank 0 clock (--max-hours / --budget-usd)'}")
        return None
