"""The cyclic collector paused over a process's start-up and back on at its work (launcher/components/
startup_gc.py): what start-up left in reference cycles is freed when it resumes, not frozen; in-process use
(the Python API, a notebook, these tests calling the CLI) never pauses."""
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


def test_paused_start_up_frees_its_cycles_then_freezes_the_rest_and_collects_again(collector, freezes):
    startup_gc.pause()
    assert not gc.isenabled()
    gone = cycle()
    startup_gc.resume()
    assert gone() is None  # garbage from start-up is collected, not frozen for the life of the process
    assert gc.isenabled() and len(freezes) == 1
    gc.disable()  # no automatic collection may free the cycle below: only a collection by resume() could
    kept = cycle()
    startup_gc.resume()  # once only: no second collection, no second freeze
    assert kept() is not None and len(freezes) == 1
    gc.enable()


def test_resume_without_a_pause_changes_nothing(collector, freezes):
    gc.disable()  # no automatic collection may free the cycle below: only a collection by resume() could
    kept = cycle()
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
