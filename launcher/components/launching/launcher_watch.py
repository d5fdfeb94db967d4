"""The job dies with its launcher: every rank watches the `zerotrain launch` that started it.

`zerotrain launch` starts DeepSpeed's runner in a session of its own (so that a signal reaches the whole
job), which also means a `kill -9` of `zerotrain launch` alone (an out-of-memory killer, a cluster agent,
a closed notebook kernel) would leave the runner and the ranks training to the end, holding the devices
and the run lock. A parent-death signal (prctl PR_SET_PDEATHSIG) cannot help: a rank's parent is
DeepSpeed's launch.py, not us. So the launcher names itself to the job (`launcher_token()`, in the
environment as ZEROTRAIN_LAUNCHER=HOST:PID:START, START being the process's start time in clock ticks,
so that a reused pid is not taken for it) and every rank on the same host runs `watch_launcher()`: a
daemon thread that looks once a second, and once the launcher is gone (no such process, another process
with its pid, or a zombie nobody reaped yet) says so in one line (rank 0) and leaves at once with the
hard-signal exit code: nothing is saved past the last checkpoint, as after a second signal. When the ranks
end, DeepSpeed's launch.py and runner end with them. Ranks on other hosts (an ssh launch) do not watch:
their host's own launcher (`--no_ssh`: one `zerotrain launch` per node) names itself to them.
"""
from __future__ import annotations

import os
import socket
import sys
import threading

from zerotrain.launcher.components.launching.restarts import stat_fields
from zerotrain.launcher.errors import EXIT_SIGNAL_HARD

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
    token = (os.environ if environ is None else environ).get(LAUNCHER)
    if not token or token.count(":") < 2 or token.rsplit(":", 2)[0] != socket.gethostname():
        return None

    def watch():
        while alive(token):
            threading.Event().wait(interval_s)
        if rank == 0:
            print(f"zerotrain: error: the launcher of this job (pid {token.rsplit(':', 2)[1]}) is gone; every rank"
                  " exits now (nothing saved past the last checkpoint)", file=sys.stderr, flush=True)
        exit_fn(EXIT_SIGNAL_HARD)

    thread = threading.Thread(target=watch, name="zerotrain-launcher-watch", daemon=True)
    thread.start()
    return thread


def _start_time(pid: int) -> str:
    fields = stat_fields(pid)
    return fields[19] if fields else "0"

