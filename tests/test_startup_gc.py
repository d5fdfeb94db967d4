"""The cyclic collector paused over a process's start-up and back on at its work (launcher/components/
startup_gc.py): imports and the plan frozen before the engine (never scanned again), the engine build's garbage
collected when the loop resumes, what follows collected as usual; in-process use (the Python API, a notebook,
these tests calling the CLI) never pauses. That a rank's trainer freezes before it builds the engine and turns
collection back on: tests/test_step_overheads.py."""
import gc
import weakref

import pytest

from zerotrain.launcher.cli import main as cli
from zerotrain.launcher.components import startup_gc


@pytest.fixture
def collector():
    """The worker's collector as it was: on, nothing frozen by the test left frozen."""
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    yield
    startup_gc._paused = False
    gc.enable()
    if gc.get_freeze_count() != frozen:
        gc.unfreeze()


class Node:
    pass


@pytest.fixture
def freezes(monkeypatch):
    """How many times gc.freeze is called (the freeze count itself moves whenever a frozen object is freed)."""
    calls = []
    real = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append(1), real())[1])
    return calls


def cycle() -> weakref.ref:
    node = Node()
    node.me = node
    return weakref.ref(node)


def test_start_up_frozen_before_the_engine_then_the_engines_garbage_collected_at_resume(collector, freezes):
    startup_gc.pause()
    assert not gc.isenabled()
    imports = cycle()  # what imports and the plan leave
    startup_gc.freeze()
    assert not gc.isenabled() and len(freezes) == 1
    gc.collect()  # a full collection (DeepSpeed's, in a ZeRO-3 build) no longer scans start-up's objects
    assert imports() is not None
    engine = cycle()  # what the engine build leaves (a loaded checkpoint's discarded tensors)
    startup_gc.resume()
    assert engine() is None  # collected, not frozen for the life of the process
    assert imports() is not None and gc.isenabled() and len(freezes) == 2
    later = cycle()  # made in the loop: collected as usual
    gc.collect()
    assert later() is None
    gc.disable()  # no automatic collection may free the cycle below: only a collection by resume() could
    kept = cycle()
    startup_gc.resume()  # once only: no second collection, no third freeze
    startup_gc.freeze()
    assert kept() is not None and len(freezes) == 2
    gc.enable()


def test_freeze_and_resume_without_a_pause_change_nothing(collector, freezes):
    gc.disable()  # no automatic collection may free the cycle below: only a collection by resume() could
    kept = cycle()
    startup_gc.freeze()
    startup_gc.resume()
    assert kept() is not None and not freezes
    gc.enable()


@pytest.mark.parametrize("argv", [["params", "debug"], ["train", "--help"], ["nope"]])
def test_the_cli_called_in_process_leaves_the_collector_as_it_was(argv, collector, freezes, capsys):
    try:
        cli(argv)
    except SystemExit:
        pass
    assert gc.isenabled() and not freezes and not startup_gc._paused
