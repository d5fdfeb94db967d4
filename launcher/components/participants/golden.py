"""--golden: each step's record against the pre-flight rehearsal's golden steps (golden.GoldenCheck;
rank 0's verdict is broadcast at golden steps only, which every rank knows); a warning, or with
--golden-strict the end of the run (golden, exit 8)."""
from __future__ import annotations

from typing import Callable

from zerotrain.launcher.components.observe.golden import GoldenCheck
from zerotrain.launcher.components.observe.metrics import MetricsLogger
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import Participant, Run, StepState
from zerotrain.launcher.errors import StopRun


class GoldenWatch(Participant):
    name = "golden"
    reads_logged = ("record",)

    def __init__(self, golden: GoldenCheck, strict: bool, dist, *, clock: PhaseClock, say: Callable[[str], None],
                 metrics: MetricsLogger):
        self.golden, self.strict, self.dist = golden, strict, dist
        self.clock, self.say, self.metrics = clock, say, metrics

    @classmethod
    def from_run(cls, run: Run) -> "GoldenWatch | None":
        if run.plan.golden is None:  # no --golden
            return None
        return cls(run.plan.golden, run.cfg.observe.golden_strict, run.dist, clock=run.clock, say=run.say,
                   metrics=run.metrics)

    def logged(self, step: StepState) -> StopRun | None:
        with self.clock.phase("log"):
            off = self.golden.check(step.step, step.record, self.dist)
            if off:
                self.say(f"zerotrain: warning: {off}")
                self.metrics.event("golden", step.step, message=off)
        if off and self.strict:
            return StopRun("golden", f"{off}; stopping (--golden-strict)")
        return None
