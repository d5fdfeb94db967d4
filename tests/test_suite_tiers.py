"""The suite's own tiers and clean-up (tests/conftest.py): the `launches` marker that `make test-fast` leaves out,
kept honest by an audit hook that fails an unmarked test starting a launch, and the `launched` fixture's end,
which kills a job's whole process group. Nothing here starts Python or ranks: a launch is shown to the hook as
the audit event Python raises for it, and the process group is made of `sleep`s."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import conftest
from conftest import Launched, end_launched, group_members, starts_a_launch
from zerotrain.launcher.components.launching.ports import DEFAULT_PORT, port_is_free, release, rendezvous_port


def test_launch_commands_are_told_from_cheap_ones():
    assert starts_a_launch([sys.executable, "-c", "pass"])
    assert starts_a_launch(["nice", "-n", "10", sys.executable, "-c", "pass"])
    assert starts_a_launch(["bash", "-c", "deepspeed --num_gpus 2 train.py"])
    assert starts_a_launch("zerotrain train --data m.json")
    assert starts_a_launch([f"{sys.prefix}/bin/torchrun", "--nproc_per_node", "2", "x.py"])
    assert not starts_a_launch(["git", "-C", "/home/me/zerotrain", "rev-parse", "HEAD"])  # a clone named zerotrain
    assert not starts_a_launch(["sleep", "30"])
    assert not starts_a_launch([])


def test_an_unmarked_test_starting_a_launch_is_recorded_and_a_cheap_command_is_not():
    """The hook itself, as installed: this test is unmarked, so it is being watched. Python raises the same
    audit event before it starts a process; raised here by hand, no process starts. What it recorded is taken
    back, or this test would fail as an unmarked launch (which is what the hook is for)."""
    assert conftest._watching and not conftest.unmarked_launches
    subprocess.run(["true"], check=True)
    assert conftest.unmarked_launches == []
    sys.audit("subprocess.Popen", sys.executable, [sys.executable, "-m", "zerotrain", "train"], None, None)
    sys.audit("os.system", b"deepspeed --num_gpus 2 x.py")
    recorded, conftest.unmarked_launches[:] = list(conftest.unmarked_launches), []
    assert recorded == [f"{sys.executable} -m zerotrain train", "deepspeed --num_gpus 2 x.py"]


def test_the_launched_fixtures_end_kills_the_whole_session_of_each_launch():
    """A job whose launcher leaves children behind (as a launcher whose watch failed would leave its ranks):
    end_launched kills every process of the session, children included, and waits until none is left."""
    job = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    procs = Launched()
    procs.append((job, 1))
    for _ in range(600):  # until bash has started its two sleeps (at most 30 s)
        if len(group_members(job.pid)) == 3:
            break
        time.sleep(0.05)
    assert len(group_members(job.pid)) == 3
    end_launched(procs)
    # the sleeps' zombies wait for whoever reaps orphans here; none of the group runs any more
    assert job.returncode == -9 and group_members(job.pid) == []


def test_a_launch_outside_a_session_of_its_own_is_refused_and_killed():
    """Its ranks would be in pytest's own process group, where killpg cannot reach them alone."""
    stray = subprocess.Popen(["sleep", "300"])
    with pytest.raises(ValueError, match="start_new_session=True"):
        Launched().append((stray, 1))
    assert stray.wait(timeout=30) != 0


def test_the_default_rendezvous_port_is_held_so_that_launches_take_free_ports():
    """Under `make test`'s two xdist workers the controller holds 29500 (conftest.hold_default_port), so a `zerotrain
    launch -n N` without a port takes a free one of its own instead of racing the other worker's for 29500.
    Held here by this process if nothing holds it yet, and let go after."""
    held = len(conftest._held_port)
    conftest.hold_default_port()
    try:
        assert not port_is_free(DEFAULT_PORT)
        port, line = rendezvous_port(None)
        assert port != DEFAULT_PORT and line.startswith(f"launch: port {DEFAULT_PORT} is busy")
        release(port)  # a test worker: its claim would outlive the test
    finally:
        for s in conftest._held_port[held:]:
            s.close()
        del conftest._held_port[held:]


def dry_run(goal: str) -> str:
    """What `make GOAL` would run on a fresh venv (its install stamp out of date), without running it."""
    return subprocess.run(["make", "-n", "-W", "setup.cfg", goal], cwd=conftest.REPO, capture_output=True, text=True,
                          check=True).stdout


def test_a_fresh_make_test_builds_the_suites_ops_while_pip_installs_the_rest():
    """`make test` on a fresh venv installs DeepSpeed (setup.cfg's line for it) before the rest, then starts
    tests/helpers/build_ops.py in a session of its own, in the suite's environment (the compiler the conftest
    sets, no GPU), and only then the install of everything else. `make test-fast` and `make demo` build no op."""
    recipe = dry_run("test")
    early = next(line for line in recipe.splitlines() if "build_ops.py" in line)
    assert "setup.cfg" in early and "startswith('deepspeed')" in early and "pip install" in early
    assert f'CXX="${{CXX:-{conftest.NO_DEBUG_INFO_CXX}}}"' in early and "CUDA_VISIBLE_DEVICES= " in early
    assert f"setsid -f .venv/bin/python {conftest.BUILD_OPS.relative_to(conftest.REPO)}" in early
    assert recipe.index("build_ops.py") < recipe.index('-e ".[test]"')
    for goal in ("test-fast", "demo"):
        assert "build_ops.py" not in dry_run(goal), goal


def test_build_ops_takes_its_parts_by_name():
    from helpers import build_ops

    with pytest.raises(SystemExit, match="unknown part"):
        build_ops.main(["everything"])
    assert list(build_ops.BACKGROUND_OPS) == ["cpu_adam", "cpu_lion", "async_io"]
