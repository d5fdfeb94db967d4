"""The rendezvous port of a launch on this node: the user's, DeepSpeed's default 29500, or a free one.

A port is checked when the launch starts, but rank 0's rendezvous store binds it only after the ranks' imports
(tens of seconds). Two launches started inside that window would both see 29500 free and the second one's
ranks would die with EADDRINUSE. So a launch also claims its port among zerotrain launches on this machine: an
flock on a file named by the port in a shared directory, held by the launching process for as long as it lives
(the kernel drops it when that process ends, however it ends). Neither the socket nor DeepSpeed's runner has
such a claim (hence written here); jobs that are not zerotrain's are seen once they listen.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import socket
import tempfile
from pathlib import Path

from zerotrain.launcher.errors import UsageError

DEFAULT_PORT = 29500  # DeepSpeed's and torch's rendezvous port when none is given (TORCH_DISTRIBUTED_DEFAULT_PORT)
CLAIMS = Path(tempfile.gettempdir()) / "zerotrain-ports"  # one directory for every user of the machine
_claimed: dict[int, tuple[int, Path]] = {}  # port -> (the open file whose flock claims it, its path)


def free_port() -> int:
    """A TCP port of this host that nothing listens on now: the rendezvous port (MASTER_PORT) of a launch we
    start, or of a world of one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether this host can listen on `port` now, on every interface as torch's TCPStore does: a job holding
    it (another launch's rendezvous) would make every rank die with EADDRINUSE. SO_REUSEADDR as the store sets
    it, so a port left in TIME_WAIT by a job that ended is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def claim(port: int, claims: Path = CLAIMS) -> bool:
    """Claim `port` for this process among zerotrain launches on this machine (the module docstring). False: a
    live launch claimed it. A claims directory this user cannot use claims nothing (True: the socket check alone,
    as without claims)."""
    if port in _claimed:
        return True
    path = claims / str(port)
    try:
        if not claims.is_dir():
            claims.mkdir(exist_ok=True)
            os.chmod(claims, 0o1777)  # every user's launches claim here (sticky: none removes another's file)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o444)  # an flock needs no write access
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = os.fstat(fd).st_ino == os.stat(path).st_ino  # not a file its last holder removed meanwhile
    except OSError:
        held = False
    if not held:
        os.close(fd)
        return False
    _claimed[port] = fd, path
    return True


def release(port: int) -> None:
    """Give up this process's claim on `port` (a port claimed, then found busy; a notebook's finished launch; every
    claim at exit). Its file goes too (a claim checks it holds the file the path names, so removing it under the
    lock is safe); a process killed before it could leaves its file, free to claim again."""
    fd, path = _claimed.pop(port, (None, None))
    if fd is not None:
        with contextlib.suppress(OSError):  # another user's file in the sticky directory stays
            os.unlink(path)
        os.close(fd)


@atexit.register
def _release_all() -> None:
    for port in list(_claimed):
        release(port)


def _take(port: int, claims: Path) -> bool:
    """Claim `port` and check nothing listens on it; keep the claim only if both hold."""
    if not claim(port, claims):
        return False
    if port_is_free(port):
        return True
    release(port)
    return False


def rendezvous_port(given: int | None, flag: str = "--master_port", default: int = DEFAULT_PORT,
                    claims: Path = CLAIMS) -> tuple[int, str]:
    """(the port a launch of ours on this node rendezvous on, the start-up line that says which), claimed for
    this process. `given`: the user's port, refused in one line (UsageError) if busy or claimed by another
    launch, before any rank starts; None: `default` (29500), or a free port when another job holds or claimed
    it (two jobs on one machine)."""
    if given is not None:
        if not 1 <= given <= 65535:
            raise UsageError(f"launch {flag} {given}: not a TCP port (1 to 65535)")
        if not claim(given, claims):
            raise UsageError(f"launch {flag} {given}: port {given} is claimed by another zerotrain launch starting"
                             f" on this machine; give a free port, or leave {flag} out to take one")
        if not port_is_free(given):
            release(given)
            raise UsageError(f"launch {flag} {given}: port {given} is busy (another job on this machine listens on"
                             f" it); give a free port, or leave {flag} out to take one")
        return given, f"launch: rendezvous on port {given} ({flag})"
    if _take(default, claims):
        return default, f"launch: rendezvous on port {default} (the default)"
    for _ in range(100):  # a free port another launch claimed since (rare): the next one
        port = free_port()
        if _take(port, claims):
            return port, (f"launch: port {default} is busy (another job on this machine?); rendezvous on free port"
                          f" {port} ({flag} P to choose)")
    raise UsageError(f"launch: no free port found to rendezvous on (port {default} is busy); give {flag} P")
