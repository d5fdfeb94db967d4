"""The run directory's lock: one live process per run directory (RUN_DIR/zerotrain.lock), shared by
training (the Trainer) and pre-flight (RUN_DIR/preflight/), and read by `zerotrain runs`/`report`.

    take_lock(run_dir, dist, is_main, say, still)   collective: rank 0 takes it, every rank learns the verdict
    refuse_if_live(run_dir)                  the lock's refusal, before a launch plans anything on the directory
    live_holder(run_dir)                     {"host", "pid", ...} of a live holder, or None (no torch)

Plain files and /proc: nothing here imports torch (`zerotrain runs` reads locks on a login node).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from zerotrain.launcher.errors import UsageError

LOCK = "zerotrain.lock"


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # a killed rank whose parent died too stays a zombie where PID 1 does not reap (containers)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def in_use(run_dir: Path, holder: dict, age: float | None) -> str:
    """The refusal of a run directory whose lock a live process holds."""
    seen = "" if holder.get("host") == socket.gethostname() or age is None else f", heartbeat {age / 60:.0f} min ago"
    return (f"run directory {run_dir} is in use by pid {holder.get('pid')} on host {holder.get('host')} (since"
            f" {holder.get('started')}{seen}); wait for it to end, pick another --run-id, or delete"
            f" {Path(run_dir) / LOCK} if that run is dead")


class RunLock:
    """RUN_DIR/zerotrain.lock: one live process per run directory.

    The lock holds host, pid, the pid's start time and the start time, as JSON. On this host, a
    lock whose process is gone (or whose pid now belongs to another process) is stale and taken
    over, saying so. A lock from another host cannot be checked that way, so the holder refreshes
    the file's mtime every `heartbeat_s` and another host's lock is taken over only once its mtime
    is `stale_after_s` old (default 15 minutes: a dead node's run can be restarted elsewhere after
    that, or at once by deleting the file; clock skew between hosts of a few minutes is harmless).
    Take it on rank 0 only (the pid is that process's).
    """

    def __init__(self, run_dir: Path, say=print, stale_after_s: float = 900.0, heartbeat_s: float = 60.0):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK
        self.say, self.stale_after_s, self.heartbeat_s = say, stale_after_s, heartbeat_s
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "RunLock":
        """Take the lock; UsageError (one line naming host and pid) if a live process holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LOCK}.{self.mine['host']}.{os.getpid()}")
        tmp.write_text(json.dumps(self.mine) + "\n")
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)  # atomic create-if-absent, with the content already in place
                    break
                except FileExistsError:
                    pass
                holder, age = self._holder()
                if holder is None and age is None:
                    continue  # released between our attempts: try again
                why = self._stale(holder, age)
                if why is None:
                    raise UsageError(in_use(self.run_dir, holder, age))
                self.say(f"taking over the lock of {self.run_dir} from pid {(holder or {}).get('pid')} on host"
                         f" {(holder or {}).get('host')}: {why}")
                os.replace(tmp, self.path)
                tmp = None
                break
            else:
                raise UsageError(f"run directory {self.run_dir}: could not take {self.path} (it keeps changing)")
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        if self._holder()[0] != self.mine:  # two takers of one stale lock: the one whose file stayed wins
            raise UsageError(f"run directory {self.run_dir}: another process took {self.path} at the same time")
        self._thread = threading.Thread(target=self._heartbeat, name="zerotrain-lock", daemon=True)
        self._thread.start()
        return self

    def _holder(self) -> tuple[dict | None, float | None]:
        """(the lock's JSON or None if unreadable, its age in seconds); (None, None) if there is none."""
        try:
            age = time.time() - self.path.stat().st_mtime
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, age
        return (holder if isinstance(holder, dict) else None), age

    def _stale(self, holder: dict | None, age: float) -> str | None:
        """Why the lock is stale, or None if its holder may be alive."""
        if holder is None:
            return "the lock file is unreadable"
        if holder.get("host") == self.mine["host"]:
            pid = holder.get("pid")
            if not isinstance(pid, int) or not _pid_alive(pid):
                return "that process is gone"
            if holder.get("pid_start") and holder.get("pid_start") != _pid_start(pid):
                return "that pid now belongs to another process"
            return None
        if age > self.stale_after_s:
            return f"no heartbeat for {age / 60:.0f} min"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._holder()[0] == self.mine:
            self.path.unlink(missing_ok=True)


def take_lock(run_dir: Path, dist, is_main: bool, say=print, still=None) -> RunLock | None:
    """Rank 0 takes the lock of `run_dir`; every rank learns the verdict from one broadcast, so every
    rank raises the same UsageError (one line, exit 2) when a live process holds it. `dist`: an
    initialised torch.distributed (None or a world of 1: no broadcast). `still`: called by rank 0 once the lock
    is held, the refusal (the lock given back) when the directory is no longer what the run was planned on
    (another launch wrote it meanwhile), else None. Returns rank 0's RunLock (release it at the end), None on
    the other ranks."""
    verdict, lock = [None], None
    if is_main:
        try:
            lock = RunLock(run_dir, say=say).acquire()
        except UsageError as e:
            verdict[0] = str(e)
        changed = still() if lock is not None and still is not None else None
        if changed:
            lock.release()
            lock, verdict[0] = None, changed
    if dist is not None and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UsageError(verdict[0])
    return lock


def refuse_if_live(run_dir: Path) -> None:
    """UsageError (the lock's own line) while another live process holds the run directory: a launch refuses
    before it plans its resume on checkpoints that live run is writing and rotating."""
    holder, age = _live(run_dir)
    if holder is not None and (holder.get("host"), holder.get("pid")) != (socket.gethostname(), os.getpid()):
        raise UsageError(in_use(run_dir, holder, age))


def live_holder(run_dir: Path) -> dict | None:
    """The live process holding the run's lock ({"host", "pid", ...}), or None (no lock, or a stale one)."""
    return _live(run_dir)[0]


def _live(run_dir: Path) -> tuple[dict | None, float | None]:
    """(the lock's holder, the lock's age) when that holder may be alive, else (None, None)."""
    lock = RunLock(run_dir, say=lambda *a: None)  # not acquired: only its staleness test is used
    holder, age = lock._holder()
    return (holder, age) if holder is not None and lock._stale(holder, age) is None else (None, None)
