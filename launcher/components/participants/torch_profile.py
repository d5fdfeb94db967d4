"""--torch-profile START:COUNT: torch.profiler over COUNT steps from step START, on every rank, and what it saw
in a few lines (observe/torch_profile.py summarize: the kernels that took the device's time, the host syncs).
Rank 0 writes RUN/torch_profile/summary.txt and trace.json (Chrome's trace format: chrome://tracing, Perfetto);
the other ranks profile too, so that every rank's step costs the same while rank 0 is measured."""
from __future__ import annotations

import torch

from zerotrain.launcher.components.participants.base import Participant, Run, StepState
from zerotrain.launcher.config import torch_profile_window


class TorchProfile(Participant):
    name = "torch_profile"

    def __init__(self, run: Run, start: int, count: int):
        self.run, self.start, self.count = run, start, count
        self.profiler = None

    @classmethod
    def from_run(cls, run: Run) -> "TorchProfile | None":
        if not run.cfg.observe.torch_profile:
            return None
        return cls(run, *torch_profile_window(run.cfg.observe.torch_profile))

    def open(self) -> None:
        if self.run.state.step >= self.start:  # a resume past the window: nothing to profile
            return
        self.run.say(f"torch.profiler: steps {self.start}-{self.start + self.count - 1}, written to"
                     f" {self.run.plan.run_dir / 'torch_profile'}")
        if self.start == self.run.state.step + 1:
            self._begin()

    def _begin(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def logged(self, step: StepState) -> None:
        if self.profiler is None and step.step == self.start - 1:
            self._begin()
        elif self.profiler is not None and step.step == self.start + self.count - 1:
            self._end()
        return None

    def _end(self) -> None:
        from zerotrain.launcher.components.observe.torch_profile import summarize

        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        if not self.run.is_main:
            return
        out = self.run.plan.run_dir / "torch_profile"
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text(f"steps {self.start}-{self.start + self.count - 1}\n" + summarize(profiler, steps=self.count))
        profiler.export_chrome_trace(str(out / "trace.json"))
        self.run.say(f"torch.profiler: {out / 'summary.txt'}")

    def close(self) -> None:
        if self.profiler is not None:  # the run ended inside the window: what was seen is still written
            self._end()
