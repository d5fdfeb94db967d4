"""Restarts: when a launched job may be started again, what its end was, and the ranks as the launcher sees them.

`zerotrain launch --max-restarts N` (launcher/commands/launch.py) runs DeepSpeed's runner in a loop
(launching/jobs.py); this module holds what that loop decides with, none of it touching the job itself:

- `Restarts`: the policy (`--max-restarts`, `--restart-backoff`), read from launch's own flags;
- `JobEnd`: how one launch ended: the code (rank 0's own, from ZEROTRAIN_EXIT_FILE, else the runner's), whether
  we were told to stop (SIGTERM/SIGINT to `zerotrain launch`: never restarted), and the first rank that exited;
  `restartable` is END_KINDS' (launcher/ends.py): hung and crash, a lost rank included: DeepSpeed's
  launch.py exits with a killed rank's negative return code, 256 - signal (247 for SIGKILL), a code no kind
  has, so a "crash";
- `RankWatch`: a thread that follows the local rank processes (/proc: the runner's descendants with RANK in
  their environment) to name the first rank that ended and how (read while it is a zombie, before launch.py
  reaps it), and to kill ranks that are stopped (SIGSTOP, a debugger) once another has ended: DeepSpeed's
  launch.py SIGTERMs the rest and waits 30 s before its SIGKILL, and a stopped process cannot act on SIGTERM;
- `with_resume_auto`: the train flags of a restart (`--resume auto`, whatever --resume was).

Remote ranks of a hostfile launch over ssh are not seen (the rank is then unknown); their launch.py ends them
before pdsh, and so the runner, returns.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zerotrain.launcher.ends import END_KINDS, kind_of_exit
from zerotrain.launcher.errors import UsageError

DEFAULT_BACKOFF_S = 10.0
STOPPED_GRACE_S = 2.0  # after a rank ended, before stopped ranks are killed: launch.py (polling each 1 s) has
#                        taken the first rank's code by then, not the code of the rank we kill


@dataclass(frozen=True)
class Restarts:
    max_restarts: int = 0  # 0: today's behaviour, the job ends as its ranks end
    backoff_s: float = DEFAULT_BACKOFF_S


RESTART_FLAGS = ("--max-restarts", "--restart-backoff")  # launch's own, before the train flags


def take_restart_flags(args: list[str]) -> tuple[Restarts, list[str]]:
    """`--max-restarts K` and `--restart-backoff S` (either as `--flag=V` too, or with underscores) taken out of
    launch's own flags: (the policy, the other flags in order). Bad values: a one-line UsageError."""
    values: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        name, _, inline = args[i].partition("=")
        name = name.replace("_", "-") if name.startswith("--") else name
        if name not in RESTART_FLAGS:
            rest.append(args[i])
            i += 1
            continue
        if not inline and i + 1 >= len(args):
            raise UsageError(f"launch {name}: expected a value")
        values[name] = inline or args[i + 1]
        i += 1 if inline else 2
    try:
        max_restarts = int(values.get("--max-restarts", 0))
    except ValueError:
        raise UsageError(f"launch --max-restarts {values['--max-restarts']!r}: not an integer") from None
    try:
        backoff = float(values.get("--restart-backoff", DEFAULT_BACKOFF_S))
    except ValueError:
        raise UsageError(f"launch --restart-backoff {values['--restart-backoff']!r}: expected seconds") from None
    if max_restarts < 0:
        raise UsageError(f"launch --max-restarts {max_restarts}: must be 0 or more")
    if not 0 <= backoff < float("inf"):
        raise UsageError(f"launch --restart-backoff {backoff:g}: must be 0 or more seconds")
    return Restarts(max_restarts, backoff), rest


def misplaced_restart_flag(train_args: list[str]) -> str | None:
    """A launch flag written among the train flags (the trainer would refuse it less helpfully)."""
    return next((a.split("=")[0] for a in train_args if a.split("=")[0].replace("_", "-") in RESTART_FLAGS), None)


def with_resume_auto(train_args: list[str]) -> list[str]:
    """The train flags of a restart: any --resume dropped, `--resume auto` appended (the newest verified
    checkpoint of the run; a restart of a job started with --resume never or a path continues, not restarts)."""
    out, skip = [], False
    for a in train_args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    return out + ["--resume", "auto"]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class RankExit:
    """The first local rank process seen to end other than with exit 0."""
    rank: int
    how: str  # "exit 11", "killed by SIGKILL", or "ended" (reaped before we could read its status)
    code: int | None  # its exit code, None when killed by a signal or not read


@dataclass(frozen=True)
class JobEnd:
    exit_code: int  # the code a rank left in ZEROTRAIN_EXIT_FILE (rank 0's, a hang's), else the runner's
    from_exit_file: bool  # a rank wrote its code (rank 0, or the rank whose hang watchdog fired)
    signalled: bool  # `zerotrain launch` was sent SIGTERM/SIGINT: a stop, never restarted
    first_exit: RankExit | None  # None: not watched (no restarts asked for, remote ranks) or none seen
    seconds: float  # how long the job ran

    @property
    def kind(self) -> str:
        return kind_of_exit(self.exit_code)

    @property
    def restartable(self) -> bool:
        return not self.signalled and END_KINDS[self.kind].restartable

    def cause(self, behind: list[int] | None = None) -> str:
        """In words, for the one-line announcement and manifest.json: "hung (exit 11; rank 1 behind)".
        `behind`: the ranks a hang summary names as behind (RUN_DIR/hangs/), if any."""
        first = self.first_exit
        if first is not None and first.how.startswith("killed by"):  # seen as it ended: whatever code followed
            return f"a rank lost (rank {first.rank} {first.how}; exit {self.exit_code})"
        if self.kind == "crash" and self.exit_code != END_KINDS["crash"].exit_code:
            signum = 256 - self.exit_code  # launch.py: sys.exit(a killed rank's -signal)
            how = f"killed by {signal_name(signum)}" if 0 < signum < 65 else "lost"
            return f"a rank lost ({f'rank {first.rank} ' if first else ''}{how}; exit {self.exit_code})"
        if behind:
            return f"{self.kind} (exit {self.exit_code}; rank {', '.join(map(str, behind))} behind)"
        where = f", rank {first.rank} first to exit" if first is not None else ""
        return f"{self.kind} (exit {self.exit_code}{where})"

    def rank(self, behind: list[int] | None = None) -> int | None:
        """Which rank, for manifest.json: the first rank behind in a hang, else the first that exited."""
        return behind[0] if behind else (self.first_exit.rank if self.first_exit else None)


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def rank_of(pid: int) -> int | None:
    """The RANK in a process's environment (None: none, or not readable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    value = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
    return int(value) if value is not None and value.isdigit() else None


def rank_processes(root: int) -> dict[int, int]:
    """{pid: rank} of the rank processes under `root` (the topmost process with a RANK on each branch: a rank's
    data-loader workers inherit RANK and are not ranks)."""
    kids = _children_map()
    found, todo = {}, list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        rank = rank_of(pid)
        if rank is not None:
            found[pid] = rank
        else:
            todo += kids.get(pid, [])
    return found


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...] (the start time at index 19); None once the
    process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _how_it_ended(fields: list[str] | None) -> tuple[str, int | None]:
    # A zombie's wait status is field 52 of /proc/PID/stat (Linux 3.5+), index 49 after the name.
    if fields is None or fields[0] != "Z" or len(fields) < 50:
        return "ended", None
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return f"killed by {signal_name(os.WTERMSIG(status))}", None
    code = os.WEXITSTATUS(status)
    return f"exit {code}", code


class RankWatch(threading.Thread):
    """Follows the rank processes under `root` (local launches) until stopped; see the module docstring."""

    def __init__(self, root: int, interval_s: float = 0.2, discover_s: float = 2.0, ends: Path | None = None):
        super().__init__(name="zerotrain-rank-watch", daemon=True)
        # every `interval_s` the known ranks' /proc/PID/stat (a few reads); every `discover_s` the whole of
        # /proc for ranks not seen yet (a read per process of the node)
        self.root, self.interval_s, self.discover_s = root, interval_s, discover_s
        # where each rank leaves its exit code as it leaves (rank_ends.report_rank_end): for a rank its launcher
        # reaped before its status was read, that code; none there, it was killed or crashed (a failure)
        self.ends = ends
        self._discovered_at = float("-inf")
        self.ranks: dict[int, int] = {}  # pid -> rank, every rank process seen
        self._failed: RankExit | None = None  # the first rank seen to fail (a signal, a nonzero exit)
        self._unread: RankExit | None = None  # the first rank gone before its status could be read
        self.killed_stopped: list[int] = []  # ranks we killed because they were stopped
        self._first_exit_at: float | None = None
        # ranks seen to exit 0: a rank that finished while another failed after it (rank 0 lost after the final
        # save, rank 1 already gone) is not the first exit the restart names
        self._ended_ok: set[int] = set()
        self._done = threading.Event()

    @property
    def first_exit(self) -> RankExit | None:
        """The first rank seen to fail, else the first whose status could not be read; None while none has."""
        return self._failed or self._unread

    def _left(self, rank: int) -> tuple[str, int | None]:
        """How a rank reaped before its status was read ended, from the code it left (report_rank_end)."""
        try:
            code = int((self.ends / str(rank)).read_text())
        except (OSError, ValueError):
            return "ended without leaving its exit code (killed or crashed)", None
        return f"exit {code}", code

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self.poll()
            except OSError:  # /proc raced with a process ending: the next poll sees it
                pass

    def poll(self) -> None:
        if self._first_exit_at is None and time.monotonic() - self._discovered_at >= self.discover_s:
            self._discovered_at = time.monotonic()
            for pid, rank in rank_processes(self.root).items():
                self.ranks.setdefault(pid, rank)
        alive, failed_now = {}, []  # failed_now: (reaped before its status was read, how it ended)
        for pid, rank in self.ranks.items():
            fields = stat_fields(pid)
            if fields is None or fields[0] in "ZX":
                how, code = _how_it_ended(fields)
                if how == "ended" and self.ends is not None:
                    how, code = self._left(rank)
                if code == 0:  # it finished its part (seen before its launcher reaped it): not the job's cause
                    self._ended_ok.add(pid)
                elif pid not in self._ended_ok:
                    if self._first_exit_at is None:
                        self._first_exit_at = time.monotonic()
                    if how == "ended":  # reaped before its status was read: named only if no known failure is
                        self._unread = self._unread or RankExit(rank, how, code)
                    elif self._failed is None:
                        failed_now.append((fields is None, RankExit(rank, how, code)))
            else:
                alive[pid] = (rank, fields[0])
        if failed_now:  # ranks that failed within one interval: one killed (no exit code: a signal, or gone without
            # leaving its code) is the cause of another's error exit (a rank SIGKILLed, its peer's collective
            # failing at once: seen together in a fresh-clone run). Of two without a code, the one its launcher
            # already reaped went first: DeepSpeed's launch.py kills the other ranks only after it has reaped a
            # failed one (a rank SIGKILLed and reaped, its peer a zombie of launch.py's SIGTERM in the same
            # interval: the peer was named once in a fresh-clone run)
            self._failed = min(failed_now, key=lambda f: (f[1].code is not None, not f[0], f[1].rank))[1]
        if self._first_exit_at is not None and time.monotonic() - self._first_exit_at >= STOPPED_GRACE_S:
            for pid, (rank, state) in alive.items():
                if state in "Tt" and rank not in self.killed_stopped:  # stopped, or stopped by a tracer
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                    self.killed_stopped.append(rank)
