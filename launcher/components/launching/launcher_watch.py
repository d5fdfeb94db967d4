"""The job dies with its launcher: every rank watches the `zerotrain launch` that started it.

`zerotrain launch` starts DeepSpeed's runner in a session of its own (so that a signal reaches the whole
job), which also means a `kill -9` of `zerotrain launch` alone (an out-of-memory killer, a cluster agent,
a closed notebook kernel) would leave the runner and the ranks training to the end, holding the devices
and the run lock. A parent-death signal (prctl PR_SET_PDEATHSIG) cannot help: a rank's parent is
DeepSpeed's launch.py, not us. So the launcher names itself to the job (`launcher_token()`, in the
environment as ZEROTRAIN_LAUNCHER=HOST:PID:START, START being the process's start time in clock ticks,
so that a reused pid is not taken for it) and every rank on the same host runs `watch_launcher()`: a
daemon thread that looks once a second, and once the launcher is gone (no such process, another process
with its pid, or a zombie nobody reaped yet) says so in one line (the first rank of the host to see it)
and leaves at once with the hard-signal exit code: nothing is saved past the last checkpoint, as after a
second signal. A rank whose collective fails first (a peer's watch saw the launcher gone before its own
did) leaves the same way (`leave_if_launcher_gone`, from the driver's command), not with a traceback.
When the ranks end, DeepSpeed's launch.py and runner end with them. Ranks on other hosts (an ssh launch)
do not watch: their host's own launcher (`--no_ssh`: one `zerotrain launch` per node) names itself to them.
"""
from __future__ import annotations

import os
import socket
import sys
import threading

from zerotrain.launcher.components.launching.restarts import stat_fields
from zerotrain.launcher.ends import EXIT_SIGNAL_HARD
from zerotrain.launcher.rank_ends import RANK_ENDS

LAUNCHER = "ZEROTRAIN_LAUNCHER"
INTERVAL_S = 1.0


def launcher_token(pid: int | None = None) -> str:
    """HOST:PID:START of process `pid` (default this one): what ZEROTRAIN_LAUNCHER holds."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def alive(token: str) -> bool:
    """Whether the process a token names still runs (a zombie does not)."""
    _, pid, start = token.rsplit(":", 2)
    fields = stat_fields(int(pid))
    return fields is not None and fields[0] != "Z" and fields[19] == start


def watch_launcher(rank: int, environ=None, interval_s: float = INTERVAL_S, exit_fn=os._exit) -> threading.Thread | None:
    """Start the watch when ZEROTRAIN_LAUNCHER names a process on this host; None otherwise (a rank started
    by hand, by torchrun or accelerate, or on another node of an ssh launch)."""
    environ = os.environ if environ is None else environ
    token = _token(environ)
    if token is None:
        return None

    def watch():
        while alive(token):
            threading.Event().wait(interval_s)
        leave(rank, token, environ, exit_fn)

    thread = threading.Thread(target=watch, name="zerotrain-launcher-watch", daemon=True)
    thread.start()
    return thread


def leave_if_launcher_gone(rank: int, environ=None, exit_fn=os._exit) -> None:
    """For a rank whose step failed (an exception on its way out): when the launcher is gone, the failure is
    the job ending (a peer's watch saw it first and left, and this rank's collective lost that peer), so this
    rank leaves as the watch would, not with a communication traceback. Returns when the launcher still runs
    (or none was named): the failure is the rank's own."""
    environ = os.environ if environ is None else environ
    token = _token(environ)
    if token is not None and not alive(token):
        leave(rank, token, environ, exit_fn)


def leave(rank: int, token: str, environ, exit_fn=os._exit) -> None:
    """The one line, from whichever rank of this host saw the launcher gone first (not always rank 0: its
    launch.py may SIGTERM rank 0 in its start-up, once a peer has left), then the hard-signal exit."""
    if _first_to_say(rank, environ):
        print(f"zerotrain: error: the launcher of this job (pid {token.rsplit(':', 2)[1]}) is gone; every rank"
              " exits now (nothing saved past the last checkpoint)", file=sys.stderr, flush=True)
    exit_fn(EXIT_SIGNAL_HARD)


def _first_to_say(rank: int, environ) -> bool:
    """Claims the launcher's rank-ends directory's `launcher-gone` entry (O_EXCL: one rank wins); rank 0
    says it where there is no such directory."""
    ends = environ.get(RANK_ENDS)
    if not ends:
        return rank == 0
    try:
        os.close(os.open(os.path.join(ends, "launcher-gone"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return rank == 0


def _token(environ) -> str | None:
    """ZEROTRAIN_LAUNCHER when it names a process on this host."""
    token = environ.get(LAUNCHER)
    if not token or token.count(":") < 2 or token.rsplit(":", 2)[0] != socket.gethostname():
        return None
    return token


def _start_time(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[19] if fields else "0"

