"""A non-finite loss or gradient norm ends the run (diverged, exit 3) before anything of the step is
logged or saved: the last checkpoint is the last good state."""
from __future__ import annotations

import math

from zerotrain.launcher.components.run_state import RunState
from zerotrain.launcher.components.participants.base import Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class Finite(Participant):
    name = "finite"
    reads = ("loss", "grad_norm")

    def __init__(self, state: RunState):
        self.state = state

    @classmethod
    def from_run(cls, run: Run) -> "Finite":
        return cls(run.state)

    def observe(self, step: StepState) -> StopRun | None:
        bad = None if math.isfinite(step.loss) else f"loss is {step.loss}"
        if bad is None and step.grad_norm is not None and not math.isfinite(float(step.grad_norm)):
            bad = f"gradient norm is {float(step.grad_norm)}"  # rank 0's, from the step's collective
        if bad:
            return StopRun("diverged", f"step {step.step}: {bad}; stopping. Last checkpoint:"
                                       f" {self.state.last_saved or 'none'}")
        return None
