"""Whether a run is as fast as its profile says it should be, and if not, where its time goes.

A policy object fed numbers (no torch, no process group; rank 0 owns one, tests feed it by hand):

    health = HealthCheck.from_settings(plan.settings, world, tokens_per_step, flops_per_token)
    closed = health.add_step(step, wall_s, phases, rank_seconds)   # every step: None, or (Window, verdicts)

- `wall_s, phases` is the step's `PhaseClock.take_window()` (components/observe/phases.py): seconds per phase,
  measured where the trainer spends them (data, compute, all_to_all inside compute with --sequence-parallel,
  agree, eval, save, mirror, log; "start" after
  the first step is the time between the measured phases, shown as "other").
- `rank_seconds` is every rank's (step work, data wait) of its previous step, carried on the step's one
  collective (StepRunner.agree): step work is the rank's wall time outside the collectives where ranks
  wait for each other (the step's agreement, evaluation, saving, mirror waits), so a rank that makes
  the others wait shows more of it. Under ZeRO, waits inside DeepSpeed's own collectives (forward,
  backward) are counted as compute on every rank: a rank slow *there* shows only in part.

A window closes at the end of the first step after `window_s` seconds of wall time (default 60 s; a
step longer than that is a window of its own). Its figures (`Window.figures()`: `time_shares/<phase>`,
`window_mfu`, `window_s`) go into that step's metrics record, so metrics.jsonl, TensorBoard and W&B
plot them. The first window (start-up: allocator, caches, compilation) is logged but not judged.

Verdicts, each at most once per diagnosis (again only when it changes, or after `repeat_s` of wall
time, default 30 min, while it stands):
- slow: the MFU over the window's wall time (tokens trained x model FLOPs / wall / peak / ranks, so
  evaluations and saves count against it) stays below the profile's `mfu_threshold` (launcher/settings.py:
  else 0.75 x `expected_mfu`) for `windows` consecutive windows (default 3): one
  event naming the largest share of those windows' wall time and what to do about it (REMEDIES).
- straggler: a rank whose step work is more than `straggler_ratio` (default 1.2) times the median of
  the other ranks' for `windows` consecutive windows is named, with how much of the gap is data wait.
- recovered / no straggler: after a verdict, `windows` consecutive windows without its cause.
Each verdict is a dict for `MetricsLogger.event("health", step, **verdict)`: topic ("throughput" or
"stragglers"), verdict (slow, recovered, straggler, no-straggler), ok, message (one line), summary (a
few words for `zerotrain runs`), and its figures. `standing(events)` is what `runs` and `report` show.

The knobs are a profile's optional `zerotrain.health` object (window_s, windows, straggler_ratio,
repeat_s; validated in launcher/profiles.py). Cost per step: a dict merge and a few additions; a
window's verdict is a few dozen arithmetic operations: 14-39 us a step measured in place, none
measurable in the step time (benchmarks/RESULTS.md, 2026-11-24, "the health check's cost").
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from zerotrain.launcher.settings import HEALTH_DEFAULTS as DEFAULTS

# What a phase is called in a verdict, and what to do when it holds the largest share of a slow run's time.
LABELS = {"data": "data wait", "compute": "compute (forward/backward/optimizer)",
          "all_to_all": "sequence-parallel all-to-all (waiting for the row's other ranks included)",
          "agree": "agreement (the step's collective: waiting for the other ranks)", "eval": "evaluation",
          "eval_tasks": "lm-evaluation-harness tasks", "save": "saving", "mirror": "checkpoint completion / mirror waits", "log": "logging",
          "start": "other (between the measured phases)", "end": "finishing"}
REMEDIES = {
    "data": "the loader cannot keep up; raise the profile's zerotrain.dataloader.workers or prepare shards"
            " (zerotrain prepare) on a fast local disk",
    "compute": "the step itself is slow: expected_mfu may be too high for this model size (small models keep"
               " the device idle), or activation checkpointing recomputes the forward; try a larger micro batch",
    "all_to_all": "the exchange around attention is slow: a straggler in the row group (see the per-rank verdict),"
                  " a slow link between the ranks sharing a row (keep them on one node), or rows too short for"
                  " the exchange to pay: lower --sequence-parallel",
    "agree": "ranks wait for each other at the step's collective: a straggler (see the per-rank verdict) or a"
             " slow interconnect",
    "eval": "evaluating too often or on too much: raise --eval-every-steps or lower --eval-tokens",
    "eval_tasks": "scoring tasks too often or on too many examples: raise --eval-tasks-every or lower --eval-limit",
    "save": "saving blocks the loop: save less often (--save-every-steps, --save-every-hours) or to a faster disk",
    "mirror": "waiting for checkpoint completion or the mirror copy: a slow --mirror target, or saves too close"
              " together",
    "log": "a slow metrics sink (W&B, TensorBoard on a network disk) or --log-data-every-steps too small",
    "start": "time outside the measured phases: a profiler, a debugger or a slow callback",
    "end": "finishing",
}
WAITS = ("agree", "all_to_all", "eval", "eval_tasks", "save", "mirror")  # phases where ranks wait for each other: not a rank's
# step work (the all-to-all's own transfer time too: it cannot be told apart from the wait on a CPU)


def label(phase: str) -> str:
    return LABELS.get(phase, phase)


@dataclass
class Window:
    """One closed window: its step, wall time, steps, seconds per phase and per-rank sums."""
    step: int
    wall_s: float
    steps: int
    phases: dict[str, float]
    mfu: float | None
    rank_work_s: list[float] | None = None  # per rank: step work, summed over the window's steps
    rank_data_s: list[float] | None = None  # per rank: data wait, summed

    @property
    def shares(self) -> dict[str, float]:
        return {p: s / self.wall_s for p, s in self.phases.items()} if self.wall_s > 0 else {}

    def figures(self) -> dict:
        """What the step record carries (metrics.jsonl keys; TensorBoard/W&B scalars `time_shares/data`...)."""
        out = {"time_shares": {p: round(s, 4) for p, s in sorted(self.shares.items())},
               "window_s": round(self.wall_s, 3)}
        if self.mfu is not None:
            out["window_mfu"] = round(self.mfu, 5)
        return out


class HealthCheck:
    """Rank 0's verdicts, window by window (see the module docstring)."""

    def __init__(self, *, world: int, tokens_per_step: int, flops_per_token: float, peak_flops: float | None,
                 expected_mfu: float | None, threshold: float, threshold_source: str = "",
                 window_s: float = DEFAULTS["window_s"], windows: int = DEFAULTS["windows"],
                 straggler_ratio: float = DEFAULTS["straggler_ratio"], repeat_s: float = DEFAULTS["repeat_s"]):
        self.world, self.tokens_per_step, self.flops_per_token = world, tokens_per_step, flops_per_token
        self.peak, self.expected, self.threshold, self.threshold_source = peak_flops, expected_mfu, threshold, \
            threshold_source
        self.window_s, self.windows, self.straggler_ratio, self.repeat_s = window_s, windows, straggler_ratio, repeat_s
        self.closed = 0  # windows closed so far (the first is not judged)
        self.run_s = 0.0  # wall time seen so far: the clock of repeat_s
        self.recent: deque[Window] = deque(maxlen=windows)  # the last judged windows
        self._open()
        self.slow_streak = self.fast_streak = 0
        self.said_slow: tuple[str, float] | None = None  # (phase, run_s when said) of the standing slow verdict
        self.rank_streaks = [0] * world
        self.clear_streak = 0
        self.said_stragglers: tuple[tuple[int, ...], float] | None = None

    @classmethod
    def from_settings(cls, settings, *, world: int, tokens_per_step: int, flops_per_token: float) -> "HealthCheck":
        """From the run's resolved settings (launcher/settings.py): health, mfu_threshold, expected_mfu, peak."""
        knobs = settings.health
        return cls(world=world, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                   peak_flops=settings.peak_flops_per_device, expected_mfu=settings.expected_mfu,
                   threshold=settings.mfu_threshold, threshold_source=settings.sources["mfu_threshold"],
                   window_s=float(knobs["window_s"]),
                   windows=int(knobs["windows"]), straggler_ratio=float(knobs["straggler_ratio"]),
                   repeat_s=float(knobs["repeat_s"]))

    def describe(self) -> str:
        if self.peak:
            what = (f"MFU against the threshold {self.threshold:.1%} ({self.threshold_source}; expected"
                    f" {self.expected:.1%})" if self.expected else
                    f"MFU against the threshold {self.threshold:.1%} ({self.threshold_source})")
        else:
            what = "time shares only (the profile has no zerotrain.peak_flops_per_device: no MFU verdict)"
        return (f"health: windows of {self.window_s:g} s, {what}; a verdict after {self.windows} windows"
                + (f", stragglers above {self.straggler_ratio:g}x the other ranks' median" if self.world > 1 else ""))

    # -- feeding ------------------------------------------------------------------------------------
    def _open(self) -> None:
        self.acc_wall, self.acc_steps, self.acc_phases = 0.0, 0, {}
        self.acc_work = [0.0] * self.world
        self.acc_data = [0.0] * self.world

    def add_step(self, step: int, wall_s: float, phases: dict[str, float],
                 rank_seconds: list[tuple[float, float]] | None = None) -> tuple[Window, list[dict]] | None:
        """One step's wall time and seconds per phase (this rank's), and every rank's (step work, data wait)
        of its previous step. Returns (the window, its verdicts) when a window closed at this step."""
        self.acc_wall += wall_s
        self.acc_steps += 1
        for phase, seconds in phases.items():
            self.acc_phases[phase] = self.acc_phases.get(phase, 0.0) + seconds
        if rank_seconds is not None and len(rank_seconds) == self.world:
            for r, (work, data) in enumerate(rank_seconds):
                self.acc_work[r] += work
                self.acc_data[r] += data
        if self.acc_wall < self.window_s:
            return None
        mfu = (self.acc_steps * self.tokens_per_step * self.flops_per_token / self.acc_wall
               / (self.peak * self.world)) if self.peak else None
        window = Window(step, self.acc_wall, self.acc_steps, self.acc_phases, mfu,
                        self.acc_work if any(self.acc_work) else None, self.acc_data if any(self.acc_work) else None)
        self._open()
        self.run_s += window.wall_s
        self.closed += 1
        if self.closed == 1:
            return window, []  # start-up: logged, not judged
        self.recent.append(window)
        return window, [v for v in (self._judge_throughput(window), self._judge_ranks(window)) if v]

    # -- verdicts -----------------------------------------------------------------------------------
    def _combined(self) -> tuple[float, dict[str, float], float | None]:
        """(wall, seconds per phase, MFU) over the recent windows."""
        wall = sum(w.wall_s for w in self.recent)
        phases: dict[str, float] = {}
        for w in self.recent:
            for p, s in w.phases.items():
                phases[p] = phases.get(p, 0.0) + s
        mfus = [w.mfu * w.wall_s for w in self.recent if w.mfu is not None]
        return wall, phases, (sum(mfus) / wall if mfus and wall else None)

    def _due(self, said: tuple | None, key) -> bool:
        return said is None or said[0] != key or self.run_s - said[1] >= self.repeat_s

    def _judge_throughput(self, window: Window) -> dict | None:
        if window.mfu is None:
            return None
        if window.mfu < self.threshold:
            self.slow_streak, self.fast_streak = self.slow_streak + 1, 0
        else:
            self.slow_streak, self.fast_streak = 0, self.fast_streak + 1
        if self.slow_streak >= self.windows:
            wall, phases, mfu = self._combined()
            shares = {p: s / wall for p, s in phases.items()}
            largest = max(shares, key=shares.get)
            if not self._due(self.said_slow, largest):
                return None
            self.said_slow = (largest, self.run_s)
            others = ", ".join(f"{label(p).split(' (')[0]} {s:.0%}" for p, s in
                               sorted(shares.items(), key=lambda kv: -kv[1]) if p != largest and s >= 0.05)
            expected = f"expected {self.expected:.0%}, " if self.expected else ""
            message = (f"MFU {mfu:.1%} over the last {self.windows} windows ({expected}below the threshold"
                       f" {self.threshold:.1%}); {label(largest)} {shares[largest]:.0%} of wall time"
                       + (f" (then {others})" if others else "") + f": {REMEDIES.get(largest, '')}")
            return {"topic": "throughput", "verdict": "slow", "ok": False, "message": message,
                    "summary": f"slow: {label(largest).split(' (')[0]} {shares[largest]:.0%}", "phase": largest,
                    "mfu": round(mfu, 5), "threshold": self.threshold, "expected_mfu": self.expected,
                    "time_shares": {p: round(s, 4) for p, s in sorted(shares.items())}, "windows": self.windows}
        if self.said_slow is not None and self.fast_streak >= self.windows:
            self.said_slow = None
            mfu = self._combined()[2]
            return {"topic": "throughput", "verdict": "recovered", "ok": True, "summary": "ok", "mfu": round(mfu, 5),
                    "threshold": self.threshold, "windows": self.windows,
                    "message": f"MFU {mfu:.1%} over the last {self.windows} windows, back above the threshold"
                               f" {self.threshold:.1%}"}
        return None

    def _judge_ranks(self, window: Window) -> dict | None:
        work, data = window.rank_work_s, window.rank_data_s
        if self.world < 2 or work is None:
            return None
        ratios = []
        for r in range(self.world):
            others = statistics.median(work[:r] + work[r + 1:])
            ratios.append(work[r] / others if others > 0 else 1.0)
            slow = ratios[r] > self.straggler_ratio
            self.rank_streaks[r] = self.rank_streaks[r] + 1 if slow else 0
        named = tuple(r for r in range(self.world) if self.rank_streaks[r] >= self.windows)
        if named:
            self.clear_streak = 0
            if not self._due(self.said_stragglers, named):
                return None
            self.said_stragglers = (named, self.run_s)
            steps = window.steps
            parts = []
            for r in named:
                med_work = statistics.median(work[:r] + work[r + 1:]) / steps
                med_data = statistics.median(data[:r] + data[r + 1:]) / steps
                gap, data_gap = work[r] / steps - med_work, data[r] / steps - med_data
                why = ("mostly data wait: that rank's loader or disk is slow" if gap > 0 and data_gap >= 0.5 * gap
                       else "not data wait: a slower device or host (throttling, another job on it)")
                parts.append(f"rank {r} is {ratios[r]:.1f}x slower than the median of the other ranks (step work"
                             f" {work[r] / steps:.3g} s vs {med_work:.3g} s a step, data wait {data[r] / steps:.3g} s"
                             f" vs {med_data:.3g} s; {why})")
            return {"topic": "stragglers", "verdict": "straggler", "ok": False, "message": "; ".join(parts),
                    "summary": "straggler: " + ", ".join(f"rank {r} {ratios[r]:.1f}x" for r in named),
                    "ranks": list(named), "ratios": {str(r): round(ratios[r], 3) for r in named},
                    "windows": self.windows}
        self.clear_streak += 1
        if self.said_stragglers is not None and self.clear_streak >= self.windows:
            was = self.said_stragglers[0]
            self.said_stragglers = None
            return {"topic": "stragglers", "verdict": "no-straggler", "ok": True, "summary": "ok", "ranks": list(was),
                    "windows": self.windows,
                    "message": f"no rank slower than {self.straggler_ratio:g}x the others' median for {self.windows}"
                               f" windows (was: {', '.join(f'rank {r}' for r in was)})"}
        return None


def standing(events: list[dict]) -> list[dict]:
    """The health verdicts that still stand at the end of these metrics.jsonl events (oldest first): the
    latest of each topic unless it says ok; a resume starts afresh (that launch's check had no history)."""
    latest: dict[str, dict] = {}
    for e in events:
        if e.get("event") == "resume":
            latest = {}
        elif e.get("event") == "health":
            latest[e.get("topic", "")] = e
    return [e for e in latest.values() if not e.get("ok")]
