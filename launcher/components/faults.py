"""Test faults planted in a run: stand-ins for the run's pieces, built in their place only when a ZEROTRAIN_TEST_*
variable asks for one (components/hooks.py parses them, once, at start). Without a hook each builder hands back
the plain piece, so the production step, checkpointer and evaluation carry no test branch.

    clock(hooks, ...)         FaultyClock (ZEROTRAIN_TEST_HANG: entering that phase at that step never returns;
                              ZEROTRAIN_TEST_DIE_AFTER_END: leaving the end's "mirror" phase SIGKILLs the rank),
                              else PhaseClock
    checkpointer(hooks, ...)  FaultyCheckpointer (ZEROTRAIN_TEST_FAIL_SAVE, _SLOW_SAVE: its writes go through
                              FaultyWrites; _SLOW_MIRROR), else Checkpointer; in-process tests build theirs here too
    spiked(hooks, ...)        the step's compute with its loss sum multiplied (ZEROTRAIN_TEST_SPIKE), else the
                              compute itself
The loaders' faults (ZEROTRAIN_TEST_SLOW_DATA, _OOM, and pre-flight's) wrap the loader: hooks.py's SlowLoader and
OomLoader.
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.observe.phases import PhaseClock

if TYPE_CHECKING:
    from zerotrain.launcher.components.run_state import RunState


def clock(hooks: TestHooks, rank: int, run_dir: Path, step_of: Callable[[], int]) -> PhaseClock:
    """The run's phase clock: FaultyClock with ZEROTRAIN_TEST_HANG or ZEROTRAIN_TEST_DIE_AFTER_END (`step_of`: the
    step just trained), else a plain one."""
    if not hooks.hang and hooks.die_after_end is None:
        return PhaseClock()
    return FaultyClock(hooks, rank, run_dir, step_of)


def checkpointer(hooks: TestHooks, *args, **kwargs) -> Checkpointer:
    """Checkpointer(*args, **kwargs), or with ZEROTRAIN_TEST_FAIL_SAVE, _SLOW_SAVE or _SLOW_MIRROR its faulty
    stand-in."""
    if not (hooks.fail_save or hooks.slow_save_s or hooks.slow_mirror_s):
        return Checkpointer(*args, **kwargs)
    return FaultyCheckpointer(hooks, *args, **kwargs)


def spiked(hooks: TestHooks, compute: Callable[[list], torch.Tensor], rank: int,
           state: RunState) -> Callable[[list], torch.Tensor]:
    """The step's compute (step_runner.StepRunner.compute), its loss sum multiplied per ZEROTRAIN_TEST_SPIKE at
    `rank`'s spiked steps (not after a rollback: the window is skipped); `compute` itself without the hook."""
    if hooks.spike is None:
        return compute

    def spiked_compute(batches) -> torch.Tensor:
        loss_sum = compute(batches)
        return loss_sum * (hooks.spike_factor(rank, state.step + 1) if not state.rollbacks else 1.0)
    return spiked_compute


class FaultyClock(PhaseClock):
    """The phase clock of a run with ZEROTRAIN_TEST_HANG (entering that phase at that step never returns: the
    save's, or the evaluation's) or ZEROTRAIN_TEST_DIE_AFTER_END (leaving the end's "mirror" phase, the wait for the
    run's last checkpoint to be complete, SIGKILLs that rank before the end is recorded)."""

    def __init__(self, hooks: TestHooks, rank: int, run_dir: Path, step_of: Callable[[], int]):
        super().__init__()
        self.hooks, self.rank, self.run_dir, self.step_of = hooks, rank, run_dir, step_of

    @contextmanager
    def phase(self, name: str):
        with super().phase(name):
            self.hooks.hang_here(self.rank, name, self.step_of(), self.run_dir)
            yield
        if name == "mirror":
            self.hooks.die_after_end_here(self.rank)


class FaultyCheckpointer(Checkpointer):
    """A Checkpointer whose saves write through FaultyWrites (ZEROTRAIN_TEST_FAIL_SAVE, ZEROTRAIN_TEST_SLOW_SAVE) and
    whose mirror copies start ZEROTRAIN_TEST_SLOW_MIRROR seconds late."""

    def __init__(self, hooks: TestHooks, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hooks = hooks

    def writer(self, inner, step: int):
        return FaultyWrites(inner, self.hooks.fails_save(self.rank, step), self.hooks.slow_save_s)

    def _mirror_tag(self, tag: str) -> None:
        TestHooks.sleep(self.hooks.slow_mirror_s)
        super()._mirror_tag(tag)


class FaultyWrites:
    """One save's writes through DeepSpeed's checkpoint engine `inner`: with `fail`, the first write half-writes its
    file and raises OSError(ENOSPC); after the first file written, a sleep of `slow_save_s` (a half-written tag on
    disk, for the kill tests)."""

    def __init__(self, inner, fail: bool, slow_save_s: float):
        self.inner, self.fail, self.slow_save_s, self.written = inner, fail, slow_save_s, 0

    def save(self, state_dict, path: str) -> None:
        if self.fail:
            self.fail = False
            with open(path, "wb") as f:
                f.write(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (ZEROTRAIN_TEST_FAIL_SAVE)", path)
        self.inner.save(state_dict, path)
        self.written += 1
        if self.written == 1:
            TestHooks.sleep(self.slow_save_s)

    def __getattr__(self, name):  # makedirs, load, ...: DeepSpeed's own
        return getattr(self.inner, name)
