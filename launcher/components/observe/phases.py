"""Where this rank is, and where its wall time went: one clock the trainer moves, two readers.

The trainer wraps each part of a step in `clock.phase(name)`; nothing else is measured twice. The one phase
entered below the trainer is "all_to_all": the engine builder wraps each sequence-parallel exchange in the
phase the trainer hands it (components/engine.py EngineSpec.exchange_phase), inside "compute".
- The watchdog thread (components/observe/watchdog.py) reads `clock.now_state()` (step, phase, seconds in it)
  to decide that this rank has stopped making progress, and writes it as the rank's heartbeat.
- The health check (components/observe/health.py) takes `clock.take_window()` once per logging window: the
  seconds spent in each phase since the last window, measured, not estimated.

Phases nest (a save's all-gather inside "save" counts as "save"): entering an inner phase pauses the
outer one, so the window's seconds add up to its wall time. The state is one tuple assigned at once,
so a reader on another thread never sees a phase with another phase's start time. Cost: two
`time.monotonic()` calls and a dict add per phase, a few per step (no I/O, no collective).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

# What a step is made of, in the order a step meets them; the health event and the hang summary name these.
PHASES = {
    "start": "starting (building the engine, resuming)",
    "data": "data wait (the loader)",
    "compute": "forward/backward/optimizer",
    "all_to_all": "the sequence-parallel all-to-all around attention (inside compute, forward and backward)",
    "agree": "the step's agreement collective",
    "eval": "evaluation",
    "eval_tasks": "lm-evaluation-harness tasks (--eval-tasks)",
    "save": "saving a checkpoint",
    "mirror": "waiting for checkpoint completion or the mirror copy",
    "log": "logging",
    "end": "finishing",
}


def device_done(accel) -> None:
    """Wait until the device has run everything queued so far: an event recorded on the current stream (the
    accelerator's, e.g. torch.cuda.Event), waited on. A GPU step returns to the host as soon as its kernels
    are queued (with bf16 ZeRO-2 the fused AdamW update and the parameter all-gather would finish inside the
    next step's agreement); the trainer calls this once per step, at the end of "compute", so that step_s,
    tokens/s, MFU and the phase shares count the device's work where it happened. No-op on an accelerator
    without events (DeepSpeed's CPU accelerator, whose `Event` is None: its work is done when the call
    returns). `accel.Event` is the event class, a property in DeepSpeed's accelerators."""
    if accel.Event is not None:
        event = accel.Event()
        event.record()
        event.synchronize()


class PhaseClock:
    """The phase this rank is in, since when, at which step; and seconds per phase in the current window."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        now = clock()
        self.state = (0, "start", now)  # (step, phase, monotonic time the phase was entered): one assignment
        self._window: dict[str, float] = {}
        self._window_start = now
        self._lock = threading.Lock()  # take_window against a phase ending on the main thread
        self.longest: dict[str, float] = {}  # the longest single stay in each phase so far (hang-timeout default)
        self.last_stay = 0.0  # seconds of the last phase left (the trainer's data wait is its "data" stay)
        self.steps_done = 0  # steps finished in this process (set_step calls): the first step compiles

    def _account(self, phase: str, start: float, now: float) -> None:
        spent = now - start
        with self._lock:
            self._window[phase] = self._window.get(phase, 0.0) + spent
        if spent > self.longest.get(phase, 0.0):
            self.longest[phase] = spent

    @contextmanager
    def phase(self, name: str):
        """`with clock.phase("save"): ...`: the time inside counts as `name` (an outer phase is paused)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r} (known: {', '.join(PHASES)})")
        step, outer, outer_start = self.state
        now = self._clock()
        self._account(outer, outer_start, now)
        self.state = (step, name, now)
        try:
            yield
        finally:
            step, _, start = self.state
            now = self._clock()
            self._account(name, start, now)
            self.last_stay = now - start
            self.state = (step, outer, now)

    def set_step(self, step: int) -> None:
        """The trainer finished `step` (progress: the watchdog's clock of the current phase restarts)."""
        _, phase, start = self.state
        now = self._clock()
        self._account(phase, start, now)
        self.steps_done += 1
        self.state = (step, phase, now)

    def now_state(self) -> tuple[int, str, float]:
        """(step, phase, seconds spent in that phase so far): safe to call from any thread."""
        step, phase, start = self.state
        return step, phase, max(0.0, self._clock() - start)

    def take_window(self) -> tuple[float, dict[str, float]]:
        """(wall seconds, {phase: seconds}) since the last call, the current phase's time so far included;
        starts a new window."""
        step, phase, start = self.state
        now = self._clock()
        with self._lock:
            window = dict(self._window)
            window[phase] = window.get(phase, 0.0) + (now - start)
            self._window = {}
            wall, self._window_start = now - self._window_start, now
        self.state = (step, phase, now)
        return wall, {k: v for k, v in window.items() if v > 0}
