"""--early-stop-patience (guards.EarlyStopping): fed every evaluation's agreed val_loss before the step
is saved (its state travels in the checkpoint under "early_stop"); stops last, after a signal or a
budget would have (early-stop, exit 4). The stop is known at observe (`step.ending`), so that the tasks
scored at a run's end are scored at this step too."""
from __future__ import annotations

from zerotrain.launcher.components.guards import EarlyStopping
from zerotrain.launcher.components.participants.base import Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class EarlyStop(Participant):
    name, saved_as = "early-stop", "early_stop"
    reads, writes = ("val",), ("ending",)

    def __init__(self, patience: int | None):
        self.early = EarlyStopping(patience) if patience else None

    @classmethod
    def from_run(cls, run: Run) -> "EarlyStop":
        return cls(run.cfg.eval.early_stop_patience)

    def over_before(self) -> StopRun | None:
        """A resumed run that stopped early: its patience (restored from the checkpoint) is still spent."""
        if self.early is not None and self.early.should_stop:
            return StopRun("early-stop", f"early stop (resumed): {self.early.message()}")
        return None

    def observe(self, step: StepState) -> None:
        if self.early is not None and step.val is not None and "val_loss" in step.val:
            self.early.update(step.val["val_loss"])
            if self.early.should_stop:
                step.ending = "early-stop"  # the run's end, known before the tasks score (participants.ORDER)

    def logged(self, step: StepState) -> StopRun | None:
        if self.early is not None and self.early.should_stop:
            return StopRun("early-stop", f"early stop at step {step.step}: {self.early.message()}")
        return None

    def state_dict(self) -> dict | None:
        return self.early.state_dict() if self.early is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.early is not None and state:
            self.early.load_state_dict(state)
