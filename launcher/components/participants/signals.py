"""SIGTERM / SIGINT (guards.SignalStop): each rank's flag rides on the step's gather (any rank's stops
every rank); a signal that arrived during an evaluation or a save is asked for once more (one tiny
all-reduce, at those steps only). The run saves and stops (signal, exit 6)."""
from __future__ import annotations

import torch

from zerotrain.launcher.components.guards import SignalStop
from zerotrain.launcher.components.participants.base import Field, Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class Signals(Participant):
    name = "signals"
    reads_logged = ("agreed", "val", "scores", "saved")

    def __init__(self, signals: SignalStop, dist, device):
        self.signals, self.dist, self.device = signals, dist, device

    @classmethod
    def from_run(cls, run: Run) -> "Signals":
        return cls(run.signals, run.dist, run.engine.device)

    def fields(self) -> list[Field]:
        return [Field("signal", "any", "flag")]

    def over_before(self) -> StopRun | None:
        """A signal during start-up (the handler is installed before the run directory is written): the run
        stops before its first step, every rank (one tiny all-reduce), nothing trained in this launch."""
        if self.seen():
            return StopRun("signal", f"stopped by {self.signals.requested or 'a signal on another rank'} during"
                                     " start-up, before this launch's first step; resume with --resume auto")
        return None

    def contribute(self, step: StepState) -> dict:
        return {"signal": self.signals.requested is not None}

    def logged(self, step: StepState) -> StopRun | None:
        signalled = step.agreed["signal"]
        if step.evaluated is not None or step.saved:
            signalled = signalled or self.seen()  # a signal during the evaluation or the save
        if signalled:
            return StopRun("signal", f"stopped by {self.signals.requested or 'a signal on another rank'}"
                                     f" at step {step.step}; resume with --resume auto")
        return None

    def seen(self) -> bool:
        """Any rank signalled? (one tiny all-reduce)"""
        flag = torch.tensor([float(self.signals.requested is not None)], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(flag)
        return flag.item() > 0
