"""When the loop saves (checkpointer.Checkpointer decides): every --save-every-steps, when rank 0's clock
says --save-every-hours (its flag rides on the gather), and at a new best validation loss, which is then
named in best.json. The last step is saved by the Trainer once the loop has ended (with the end's kind)."""
from __future__ import annotations

from zerotrain.launcher.components.checkpoints.checkpoint import tag_for
from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer
from zerotrain.launcher.components.run_state import RunState
from zerotrain.launcher.components.participants.base import Field, Participant, Run, StepState


class Checkpointing(Participant):
    name = "checkpointing"
    reads_logged = ("agreed", "last", "new_best", "best_value")
    writes_logged = ("saved",)

    def __init__(self, state: RunState, checkpointer: Checkpointer, is_main: bool):
        self.state, self.checkpointer, self.is_main = state, checkpointer, is_main

    @classmethod
    def from_run(cls, run: Run) -> "Checkpointing":
        return cls(run.state, run.checkpointer, run.is_main)

    def fields(self) -> list[Field]:
        return [Field("save_hours", "rank0", "flag")]

    def contribute(self, step: StepState) -> dict:
        return {"save_hours": self.checkpointer.hours_due(step.trained_at) if self.is_main else False}

    def logged(self, step: StepState) -> None:
        due = self.checkpointer.due(step.step, step.agreed["save_hours"], step.last) and not step.last
        if due or step.new_best:
            self.state.save(step.best_value if step.new_best else None)
            step.saved = True
        if step.new_best:
            self.checkpointer.mark_best(tag_for(step.step), step.step, step.best_value)
