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


def test_paused_start_up_frees_its_cycles_then_freezes_the_rest_and_collects_again(collector):
    startup_gc.pause()
    assert not gc.isenabled()
    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    startup_gc.resume()
    assert gone() is None  # garbage from start-up is collected, not frozen for the life of the process
    assert gc.isenabled() and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    startup_gc.resume()  # once only
    assert gc.get_freeze_count() == frozen and gc.isenabled()


def test_resume_without_a_pause_changes_nothing(collector):
    frozen = gc.get_freeze_count()
    startup_gc.resume()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


@pytest.mark.parametrize("argv", [["params", "debug"], ["train", "--help"], ["nope"]])
def test_the_cli_called_in_process_leaves_the_collector_as_it_was(argv, collector, capsys):
    frozen = gc.get_freeze_count()
    try:
        cli(argv)
    except SystemExit:
        pass
    assert gc.isenabled() and gc.get_freeze_count() == frozen and not startup_gc._paused
