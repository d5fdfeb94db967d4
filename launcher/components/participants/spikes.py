"""--on-spike: a loss spike (guards.SpikeDetector on the agreed loss) warns, stops (diverged, exit 3) or
rolls the run back to its last checkpoint (the Trainer reloads it; the data of the window that spiked
is skipped). The detector keeps what it learnt across a rollback (spike steps never enter it) and
travels in the checkpoint under "spike"."""
from __future__ import annotations

from typing import Callable

from zerotrain.launcher.components.guards import SpikeDetector
from zerotrain.launcher.components.run_state import RunState
from zerotrain.launcher.components.participants.base import REWOUND, Participant, Run, StepState
from zerotrain.launcher.errors import StopRun

ROLLBACKS_MAX = 3  # --on-spike rollback gives up (exit 3) after this many rollbacks in one run


class Spikes(Participant):
    name, saved_as = "spikes", "spike"
    reads = ("loss",)

    def __init__(self, state: RunState, on_spike: str, say: Callable[[str], None],
                 detector: SpikeDetector | None = None):
        self.state, self.on_spike, self.say = state, on_spike, say
        self.detector = detector if detector is not None else SpikeDetector()

    @classmethod
    def from_run(cls, run: Run) -> "Spikes":
        return cls(run.state, run.cfg.observe.on_spike, run.say)

    def observe(self, step: StepState):
        if not self.detector.update(step.loss):
            return None
        what = f"loss spike at step {step.step}: {self.detector.explain()}"
        last = self.state.last_saved
        if self.on_spike == "warn":
            self.say(f"zerotrain: warning: {what}")
            return None
        if self.on_spike == "stop":
            return StopRun("diverged", f"{what}; stopping (--on-spike stop). Last checkpoint: {last or 'none'}")
        if last is None or self.state.rollbacks >= ROLLBACKS_MAX:
            why = "no checkpoint to roll back to" if last is None else f"{ROLLBACKS_MAX} rollbacks already"
            return StopRun("diverged", f"{what}; {why}; stopping. Last checkpoint: {last or 'none'}")
        self.state.rollback(what)
        return REWOUND

    def state_dict(self) -> dict:
        return self.detector.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.detector.load_state_dict(state)
