"""Two jobs on one machine: `zerotrain launch -n N` without a port rendezvous on 29500, or on a
free port when another job holds 29500, and says which; a --master_port the user gave that is busy is refused
before any rank starts (exit 2, one line naming the port and the flag, nothing written). The port is held by a
real listening socket, as another job's rendezvous holds it."""
import contextlib
import os
import socket
import subprocess
import sys

import pytest

from conftest import BIN, REPO, free_port, read_metrics
from zerotrain.launcher.components.launching import ports
from zerotrain.launcher.components.launching.ports import DEFAULT_PORT, port_is_free, rendezvous_port
from zerotrain.launcher.errors import UsageError


@contextlib.contextmanager
def held(port: int):
    """A socket listening on `port` for the block, as a running job's rendezvous store (if something else on this
    machine holds it already, it is busy all the same)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a rendezvous store binds: past a TIME_WAIT left
    try:  # by a launch that just ended here
        s.bind(("127.0.0.1", port))
        s.listen()
    except OSError:
        pass
    try:
        yield port
    finally:
        s.close()


def test_a_busy_default_port_gives_a_free_one_and_says_which():
    with held(DEFAULT_PORT):
        assert not port_is_free(DEFAULT_PORT)
        port, line = rendezvous_port(None)
        assert port != DEFAULT_PORT and port_is_free(port)
        assert line == (f"launch: port {DEFAULT_PORT} is busy (another job on this machine?); rendezvous on free port"
                        f" {port} (--master_port P to choose)")
        ports.release(port)  # this process is a test worker: later tests' launches may want it


@pytest.mark.launches  # a second process holds the first claim (a python -c, no ranks)
def test_two_launches_starting_at_once_take_two_ports(tmp_path):
    """Nothing listens on a launch's port until its rank 0 has imported (tens of seconds): a second launch started
    in that window used to take the same port, and its ranks died with EADDRINUSE. A launch claims its port
    (an flock held while its process lives): another process's launch takes another one, and the port is
    free to claim again once the first process is gone."""
    default = free_port()  # nothing listens on it: as 29500 on a quiet machine
    claims = tmp_path / "claims"
    first = subprocess.Popen([sys.executable, "-c", "import sys; from zerotrain.launcher.components.launching.ports"
                              f" import rendezvous_port as r; print(r(None, default={default},"
                              f" claims=__import__('pathlib').Path({str(claims)!r}))[0], flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert int(first.stdout.readline()) == default
        assert port_is_free(default)  # the race: nothing listens yet
        second, line = rendezvous_port(None, default=default, claims=claims)
        assert second != default and line.startswith(f"launch: port {default} is busy")
        with pytest.raises(UsageError) as err:  # the user's port, claimed by the other launch
            rendezvous_port(default, claims=claims)
        assert str(err.value) == (f"launch --master_port {default}: port {default} is claimed by another zerotrain"
                                  " launch starting on this machine; give a free port, or leave --master_port out"
                                  " to take one")
        ports.release(second)
        assert not (claims / str(second)).exists()  # a released claim leaves no file
    finally:
        first.communicate("", timeout=30)
    assert not (claims / str(default)).exists()  # the first launch's process ended: its claim went with it
    assert rendezvous_port(None, default=default, claims=claims) == (
        default, f"launch: rendezvous on port {default} (the default)")
    assert stat_mode(claims) == 0o1777  # every user's launches claim in the same directory
    ports.release(default)


def stat_mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_a_busy_port_the_user_gave_is_refused_in_one_line():
    with held(free_port()) as port:
        with pytest.raises(UsageError) as err:
            rendezvous_port(port)
        assert str(err.value) == (f"launch --master_port {port}: port {port} is busy (another job on this machine"
                                  f" listens on it); give a free port, or leave --master_port out to take one")
    with pytest.raises(UsageError, match="launch --master_port 70000: not a TCP port"):
        rendezvous_port(70000)


@pytest.mark.launches
def test_launch_refuses_a_busy_master_port_before_any_rank_starts(tmp_path, mix_path):
    out = tmp_path / "runs"
    with held(free_port()) as port:
        proc = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "-n", "2", "--master_port", str(port),
                               "--", "--data", str(mix_path), "--out", str(out), "--max-steps", "2"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == f"zerotrain: error: launch --master_port {port}: port {port} is busy (another job on this" \
                       " machine listens on it); give a free port, or leave --master_port out to take one"
    assert "Traceback" not in proc.stdout + proc.stderr and "deepspeed" not in proc.stdout.lower()
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.launches
def test_a_second_job_trains_while_another_holds_29500(tmp_path, mix_path):
    """The real thing: 2 ranks of the debug model under DeepSpeed's launcher, with 29500 held throughout."""
    out = tmp_path / "runs"
    with held(DEFAULT_PORT):
        proc = subprocess.run([str(BIN / "zerotrain"), "launch", "-n", "2", "--", "--data", str(mix_path),
                               "--out", str(out), "--run-id", "second", "--profile", "cpu", "--model", "debug",
                               "--max-steps", "2", "--log-data-every-steps", "0"],
                              capture_output=True, text=True, timeout=600, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"launch: port {DEFAULT_PORT} is busy")]
    assert len(said) == 1, proc.stdout[-3000:]
    port = int(said[0].split("rendezvous on free port ")[1].split()[0])
    assert port != DEFAULT_PORT and f"master_port={port}" in proc.stdout + proc.stderr  # DeepSpeed's own log
    assert "EADDRINUSE" not in proc.stdout + proc.stderr
    assert [m["step"] for m in read_metrics(out / "second")] == [1, 2]
