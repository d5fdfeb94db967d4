"""The health check as a participant: each rank's step work and data wait (from the phase clock, outside
the collectives where ranks wait for each other) ride on the next step's gather; rank 0's HealthCheck
(components/health.py) judges each window and names slow phases and stragglers. The window's figures go
into the step's record; its verdicts are said and logged after it."""
from __future__ import annotations

from typing import Callable

from zerotrain.launcher.components.observe.health import WAITS, HealthCheck
from zerotrain.launcher.components.observe.metrics import MetricsLogger
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import Field, Participant, Run, StepState
from zerotrain.modeling.model import flops_per_token


class HealthWatch(Participant):
    name = "health"
    reads, writes, reads_logged = ("agreed",), ("window",), ("window",)

    def __init__(self, clock: PhaseClock, build: Callable[[], HealthCheck] | None, say: Callable[[str], None],
                 metrics: MetricsLogger):
        self.clock, self.build, self.say, self.metrics = clock, build, say, metrics  # build: rank 0 only
        self.check: HealthCheck | None = None
        self.seconds = (0.0, 0.0)  # this rank's (step work, data wait) of its last step

    @classmethod
    def from_run(cls, run: Run) -> "HealthWatch":
        def build() -> HealthCheck:  # rank 0 judges; every rank's step times ride on the step's gather
            return HealthCheck.from_settings(run.plan.settings, world=run.world, tokens_per_step=run.tokens_per_step,
                                            flops_per_token=flops_per_token(run.plan.model_args, run.cfg.data.seq_len))
        return cls(run.clock, build if run.is_main else None, run.say, run.metrics)

    def fields(self) -> list[Field]:
        return [Field("step_work_s", "every"), Field("data_wait_s", "every")]

    def open(self) -> None:
        if self.build is not None:
            self.check = self.build()
            self.say(self.check.describe())

    def contribute(self, step: StepState) -> dict:
        return {"step_work_s": self.seconds[0], "data_wait_s": self.seconds[1]}

    def observe(self, step: StepState) -> None:
        wall, phases = self.clock.take_window()
        waits = sum(phases.get(p, 0.0) for p in WAITS)
        self.seconds = (wall - waits, phases.get("data", 0.0))
        if self.check is not None:
            every = list(zip(step.agreed["step_work_s"], step.agreed["data_wait_s"]))
            step.window = self.check.add_step(step.step, wall, phases, every)

    def logged(self, step: StepState) -> None:
        if not step.window:
            return
        with self.clock.phase("log"):
            for verdict in step.window[1]:
                self.say(f"zerotrain: health: {verdict['message']}")
                self.metrics.event("health", step.step, **verdict)
