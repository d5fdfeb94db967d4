"""--max-hours, --total-tokens, --budget-usd (guards.Budget): rank 0's clock decides before the gather
whether the next step still fits (with the last save's duration in reserve); the run stops after this
step's save-worthy work, on every rank at once (budget, exit 5)."""
from __future__ import annotations

from zerotrain.launcher.components.guards import Budget
from zerotrain.launcher.components.run_state import RunState
from zerotrain.launcher.components.participants.base import Field, Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class BudgetStop(Participant):
    name = "budget"
    reads, reads_logged = ("step_time", "trained_at"), ("agreed",)  # contribute's, logged's

    def __init__(self, state: RunState, budget: Budget, tokens_per_step: int):
        self.state, self.budget, self.tokens_per_step = state, budget, tokens_per_step
        self.why: str | None = None

    @classmethod
    def from_run(cls, run: Run) -> "BudgetStop":
        return cls(run.state, run.budget, run.tokens_per_step)

    def fields(self) -> list[Field]:
        return [Field("over_budget", "rank0", "flag")]

    def over_before(self) -> StopRun | None:
        """A resumed run whose next step would go over --total-tokens, or whose training time (its checkpoint's:
        the same on every rank) is past --max-hours / --budget-usd: over, before any step (it stopped there)."""
        why = self.budget.exceeded_after_next(self.state.elapsed_before, 0.0, self.state.tokens_seen,
                                              self.tokens_per_step)
        return StopRun("budget", f"budget reached before step {self.state.step + 1}: {why}") if why else None

    def contribute(self, step: StepState) -> dict:
        tps = self.tokens_per_step
        self.why = self.budget.exceeded_after_next(self.state.elapsed(step.trained_at), step.step_time,
                                                   self.state.tokens_seen + tps, tps, reserve_s=self.state.last_save_s)
        return {"over_budget": self.why is not None}

    def logged(self, step: StepState) -> StopRun | None:
        if step.agreed["over_budget"]:
            return StopRun("budget", f"budget reached at step {step.step}:"
                                     f" {self.why or 'rank 0 clock (--max-hours / --budget-usd)'}")
        return None
