"""Test hooks: faults and delays the end-to-end tests plant in real launched ranks.

The tests launch real ranks (deepspeed, torchrun, python), so the environment is how a hook reaches
those processes. It is read ONCE, at start (`TestHooks.from_env()`, built by the Trainer and by
pre-flight), never in the step loop; with no ZEROTRAIN_TEST_* variable set the object is `NO_HOOKS`. The faults
are planted by stand-ins that exist only when their variable is set (components/faults.py: a clock, a
checkpointer, the step's compute; here: the loaders), so the production step, checkpointer and evaluation have
no test branch. This module stays light (no torch): pre-flight and the plan read it.

    ZEROTRAIN_TEST_SPIKE=RANK:FIRST-LAST:FACTOR      the loss that rank reports for steps FIRST..LAST is
                                                     multiplied by FACTOR (the spike detector's input only;
                                                     not again after a rollback)
    ZEROTRAIN_TEST_FAIL_SAVE=RANK:STEP[,RANK:STEP]   that rank's first write of that save half-writes a file
                                                     and raises OSError(ENOSPC)
    ZEROTRAIN_TEST_SLOW_SAVE=S                       sleep S s inside every save after each rank's first file
                                                     (a half-written tag on disk, for the kill tests)
    ZEROTRAIN_TEST_SLOW_MIRROR=S                     delay each mirror copy by S s
    ZEROTRAIN_TEST_PREFLIGHT_READBACK=perturb        pre-flight v1 changes one value of the read-back state
    ZEROTRAIN_TEST_SLOW_LOADER=S                     pre-flight's data loaders sleep S s per batch
    ZEROTRAIN_TEST_PREFLIGHT_OOM=RANK:MICRO          in pre-flight's micro-batch sweep, that rank's candidate at
                                                     micro-batch MICRO raises torch.OutOfMemoryError when it
                                                     fetches its second batch (the other ranks go on into the
                                                     step's collectives, as after an OOM mid-backward)
    ZEROTRAIN_TEST_OOM=RANK:STEP                     that rank's training loader raises torch.OutOfMemoryError
                                                     when it fetches the first micro-batch of STEP (fetched
                                                     ahead, during step STEP-1): a rank out of memory mid-run
                                                     (the OOM end's tests)
    ZEROTRAIN_TEST_SLOW_DATA=S[,RANK:S...]           the training loader sleeps S s per micro-batch on every rank
                                                     (RANK:S: that rank sleeps S instead), inside the
                                                     trainer's data phase as a slow source would (the
                                                     health check's data-wait and straggler tests)
    ZEROTRAIN_TEST_HANG=RANK:PHASE:STEP[,...]        that rank blocks forever on entering PHASE (save or eval)
                                                     at STEP (the step just trained): the main thread sleeps in
                                                     C (time.sleep, woken only to run signal handlers), as a
                                                     rank stuck in a driver call or a dead file system is; the
                                                     other ranks then block in their next collective (the
                                                     hang watchdog's tests); each once per run directory: a
                                                     job restarted after that hang was reported goes past it
    ZEROTRAIN_TEST_SLOW_START=S                      every rank sleeps S s once the run directory is written, before
                                                     the engine is built (a large model's build or load: a
                                                     preemption during start-up, for the signal tests)
    ZEROTRAIN_TEST_DIE_AFTER_END=RANK                that rank SIGKILLs itself once the run's last checkpoint
                                                     is complete, before the end is recorded (a rank lost in
                                                     teardown: `zerotrain launch --max-restarts` restarts a
                                                     finished run)

A malformed value is a UsageError naming the variable (exit 2 before anything is built). Any ZEROTRAIN_TEST_*
variable set, known or not, is said at start-up in one warning line (`describe()`) and recorded in the
launch's segment of manifest.json (`test_hooks`): a user who exported one by mistake sees it.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from zerotrain.launcher.errors import UsageError

PREFIX = "ZEROTRAIN_TEST_"
SPIKE, FAIL_SAVE, SLOW_SAVE, SLOW_MIRROR, PREFLIGHT_READBACK, SLOW_LOADER = (
    PREFIX + name for name in ("SPIKE", "FAIL_SAVE", "SLOW_SAVE", "SLOW_MIRROR", "PREFLIGHT_READBACK", "SLOW_LOADER"))
SLOW_DATA = PREFIX + "SLOW_DATA"
HANG = PREFIX + "HANG"
DIE_AFTER_END = PREFIX + "DIE_AFTER_END"
SLOW_START = PREFIX + "SLOW_START"
PREFLIGHT_OOM = PREFIX + "PREFLIGHT_OOM"
OOM = PREFIX + "OOM"
KNOWN = (SPIKE, FAIL_SAVE, SLOW_SAVE, SLOW_MIRROR, PREFLIGHT_READBACK, SLOW_LOADER, SLOW_DATA, HANG, DIE_AFTER_END,
         PREFLIGHT_OOM, OOM, SLOW_START)
HANG_PHASES = ("save", "eval")  # the phases FaultyClock blocks in (TestHooks.hang_here)


@dataclass(frozen=True)
class TestHooks:
    __test__ = False  # pytest: not a test class

    spike: tuple[int, int, int, float] | None = None  # (rank, first step, last step, factor)
    fail_save: frozenset[tuple[int, int]] = frozenset()  # (rank, step)
    slow_save_s: float = 0.0
    slow_mirror_s: float = 0.0
    preflight_readback: str | None = None  # "perturb"
    slow_loader_s: float = 0.0
    slow_start_s: float = 0.0
    slow_data: frozenset[tuple[int | None, float]] = frozenset()  # (rank or None for every rank, seconds)
    hang: frozenset[tuple[int, str, int]] = frozenset()  # (rank, phase, step) each
    die_after_end: int | None = None  # the rank
    preflight_oom: tuple[int, int] | None = None  # (rank, micro-batch)
    oom: tuple[int, int] | None = None  # (rank, step)
    variables: tuple[tuple[str, str], ...] = ()  # every ZEROTRAIN_TEST_* variable set, sorted: said and recorded

    @classmethod
    def from_env(cls, environ=None) -> "TestHooks":
        env = os.environ if environ is None else environ
        if not any(k.startswith(PREFIX) for k in env):
            return NO_HOOKS
        hooks = {"variables": tuple(sorted((k, v) for k, v in env.items() if k.startswith(PREFIX)))}
        try:
            if env.get(SPIKE):
                rank, steps, factor = env[SPIKE].split(":")
                first, last = (int(x) for x in steps.split("-"))
                hooks["spike"] = (int(rank), first, last, float(factor))
        except ValueError:
            raise UsageError(f"{SPIKE}={env[SPIKE]}: expected RANK:FIRST-LAST:FACTOR") from None
        try:
            hooks["fail_save"] = frozenset(tuple(map(int, s.split(":"))) for s in env.get(FAIL_SAVE, "").split(",")
                                           if s)
            if any(len(pair) != 2 for pair in hooks["fail_save"]):
                raise ValueError
        except ValueError:
            raise UsageError(f"{FAIL_SAVE}={env[FAIL_SAVE]}: expected RANK:STEP[,RANK:STEP...]") from None
        for field, name in (("slow_save_s", SLOW_SAVE), ("slow_mirror_s", SLOW_MIRROR),
                            ("slow_loader_s", SLOW_LOADER), ("slow_start_s", SLOW_START)):
            try:
                hooks[field] = float(env.get(name) or 0.0)
            except ValueError:
                raise UsageError(f"{name}={env[name]}: expected seconds") from None
        try:
            hooks["slow_data"] = frozenset((None, float(s)) if ":" not in s else (int(s.split(":")[0]),
                                                                                 float(s.split(":")[1]))
                                           for s in env.get(SLOW_DATA, "").split(",") if s)
        except ValueError:
            raise UsageError(f"{SLOW_DATA}={env[SLOW_DATA]}: expected S[,RANK:S...] (seconds)") from None
        if env.get(HANG):
            try:
                hangs = [s.split(":") for s in env[HANG].split(",")]
                hooks["hang"] = frozenset((int(rank), phase, int(step)) for rank, phase, step in hangs)
                if any(phase not in HANG_PHASES for _, phase, _ in hooks["hang"]):
                    raise ValueError
            except ValueError:
                raise UsageError(f"{HANG}={env[HANG]}: expected RANK:PHASE:STEP[,RANK:PHASE:STEP...], PHASE one"
                                 f" of {', '.join(HANG_PHASES)}") from None
        if env.get(DIE_AFTER_END):
            try:
                hooks["die_after_end"] = int(env[DIE_AFTER_END])
            except ValueError:
                raise UsageError(f"{DIE_AFTER_END}={env[DIE_AFTER_END]}: expected RANK") from None
        for field, name, form in (("preflight_oom", PREFLIGHT_OOM, "RANK:MICRO"), ("oom", OOM, "RANK:STEP")):
            if env.get(name):
                try:
                    first, second = (int(x) for x in env[name].split(":"))
                except ValueError:
                    raise UsageError(f"{name}={env[name]}: expected {form}") from None
                hooks[field] = (first, second)
        hooks["preflight_readback"] = env.get(PREFLIGHT_READBACK) or None
        return cls(**hooks)

    def describe(self) -> str | None:
        """The start-up warning naming every ZEROTRAIN_TEST_* variable set (None: none)."""
        if not self.variables:
            return None
        shown = ", ".join(f"{k}={v}" + ("" if k in KNOWN else " (not a hook: ignored)") for k, v in self.variables)
        return (f"zerotrain: warning: test hooks active: {shown} (faults and delays planted by the test suite;"
                " unset them for a real run)")

    def spike_factor(self, rank: int, step: int) -> float:
        """What the loss `rank` reports at `step` is multiplied by (1.0: no spike planted)."""
        if self.spike is None:
            return 1.0
        r, first, last, factor = self.spike
        return factor if r == rank and first <= step <= last else 1.0

    def fails_save(self, rank: int, step: int) -> bool:
        return (rank, step) in self.fail_save

    @staticmethod
    def sleep(seconds: float) -> None:
        if seconds:
            time.sleep(seconds)

    def hang_here(self, rank: int, phase: str, step: int, run_dir: Path | None = None) -> None:
        """ZEROTRAIN_TEST_HANG: never returns on that rank, in that phase, at that step, once per run
        directory: not when RUN_DIR/hangs/ already holds that hang reported (a job restarted after it goes on)."""
        if (rank, phase, step) in self.hang and not (run_dir is not None and hang_reported(run_dir, phase, step)):
            while True:
                time.sleep(3600)

    def die_after_end_here(self, rank: int) -> None:
        """ZEROTRAIN_TEST_DIE_AFTER_END: that rank is SIGKILLed here (the run's last checkpoint complete)."""
        if self.die_after_end == rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_training_data(self, loader, rank: int, grad_accum: int = 1):
        """The trainer's loader, slowed per ZEROTRAIN_TEST_SLOW_DATA for `rank`, out of memory at ZEROTRAIN_TEST_OOM's
        step (its micro-batches counted from this launch's first step); unchanged without either."""
        seconds = dict(self.slow_data)
        seconds = seconds.get(rank, seconds.get(None, 0.0))
        loader = SlowLoader(loader, seconds) if seconds else loader
        if self.oom is not None and self.oom[0] == rank:
            loader = OomLoader(loader, at_batch=(self.oom[1] - 1) * grad_accum + 1)
        return loader


    def preflight_loader(self, loader, rank: int, micro_batch: int):
        """A sweep candidate's loader: unchanged, or (ZEROTRAIN_TEST_PREFLIGHT_OOM) one that runs out of memory."""
        return OomLoader(loader) if self.preflight_oom == (rank, micro_batch) else loader


class OomLoader:
    """A loader whose batch number `at_batch` (the second by default) raises torch.OutOfMemoryError
    (ZEROTRAIN_TEST_PREFLIGHT_OOM, ZEROTRAIN_TEST_OOM)."""

    def __init__(self, inner, at_batch: int = 2):
        self.inner, self.batches, self.at_batch = inner, 0, at_batch

    def next(self):
        import torch  # heavy: only a test that plants the fault pays for it here

        self.batches += 1
        if self.batches == self.at_batch:
            raise torch.OutOfMemoryError("CUDA out of memory (a ZEROTRAIN_TEST_ hook)")
        return self.inner.next()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SlowLoader:
    """A loader S seconds slower per batch (ZEROTRAIN_TEST_SLOW_DATA, and pre-flight's SLOW_LOADER)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def next(self):
        time.sleep(self.seconds)
        return self.inner.next()

    def __getattr__(self, name):
        return getattr(self.inner, name)


NO_HOOKS = TestHooks()


def hang_reported(run_dir: Path, phase: str, step: int) -> bool:
    """Whether the watchdog has reported this run's hang in `phase` at `step` (a hangs/<time>-step<S>/
    directory whose summary.json names them)."""
    hangs = Path(run_dir) / "hangs"
    for summary in hangs.glob("*/summary.json") if hangs.is_dir() else ():
        try:
            said = json.loads(summary.read_text())
        except (OSError, ValueError):
            continue  # a summary being written: not reported yet
        if (said.get("phase"), said.get("step")) == (phase, step):
            return True
    return False
