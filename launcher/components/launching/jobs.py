"""Running a launched job: DeepSpeed's runner under this interpreter, one job with our signals passed on and
rank 0's own exit code kept, and the loop that starts it again after a restartable end.

Used by `zerotrain launch` and `zerotrain slurm` (launcher/commands/launch.py), `zerotrain demo` and the
notebook's `finetune` (launcher/commands/finetune.py); none of them imports another command for it.

DeepSpeed's launcher (deepspeed/launcher/launch.py) forwards SIGTERM/SIGINT to its children, gives them 30 s,
kills them, and then exits 1 itself, so the driver's documented exit code (6: stopped by a signal, checkpoint
saved) would be lost. Rank 0 therefore also writes its exit code to a file named by ZEROTRAIN_EXIT_FILE, and
`run_job` returns that code when it exists. When ZEROTRAIN_EXIT_FILE is set for the launching process itself
(the Slurm script does, per node), the code it exits with is written there too.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zerotrain.launcher.components import manifest
from zerotrain.launcher.components.launching.launcher_watch import LAUNCHER, launcher_token
from zerotrain.launcher.components.launching.restarts import (JobEnd, RankWatch, Restarts, stat_fields,
                                                                with_resume_auto)
from zerotrain.launcher.ends import END_KINDS
from zerotrain.errors import ZerotrainError
from zerotrain.launcher.rank_ends import RANK_ENDS

# The driver runs as a module under every launcher (`deepspeed --module`, `torchrun -m`, `accelerate
# launch -m`): that form works the same for a checkout and for a wheel in site-packages, and never
# puts a folder of ours first on sys.path (running launcher/train.py as a script does; it is kept
# for users who type it).
TRAIN_MODULE = "zerotrain.launcher.train"
# Set by a launcher for its ranks; a notebook that ran a world of 1 has them too (zerotrain.launcher.trainer
# single_process_env) and must not hand them to the ranks of a launch it starts.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def deepspeed_runner() -> list[str]:
    """DeepSpeed's runner (what the `deepspeed` script runs) under this interpreter: the one whose
    zerotrain is running, whatever `deepspeed` comes first on PATH (or none: a venv not activated)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def deepspeed_command(nproc: int, train_args: list[str], port: int, addr: str | None = None) -> list[str]:
    """DeepSpeed's runner starting `nproc` local ranks that rendezvous on `port` (rendezvous_port)."""
    return [*deepspeed_runner(), "--num_gpus", str(nproc), "--master_port", str(port),
            *(["--master_addr", addr] if addr else []), "--module", TRAIN_MODULE, *train_args]


def run_preserving_exit_code(cmd: list[str], env: dict | None = None, relay=None) -> int:
    """Run a launcher command, pass our SIGTERM/SIGINT on to it, return rank 0's own exit code (run_job);
    with ZEROTRAIN_EXIT_FILE in `env`, the code is written there too."""
    code = run_job(cmd, env=env, relay=relay).exit_code
    _write_outer_exit_file(env, code)
    return code


def run_job(cmd: list[str], env: dict | None = None, relay=None, restarting: bool = False) -> JobEnd:
    """Run a launcher command once, pass our SIGTERM/SIGINT on to it; how it ended (rank 0's own exit code).

    The `deepspeed` runner (deepspeed/launcher/runner.py) installs no signal handler for a local
    launch: a SIGTERM sent to it alone kills it and orphans launch.py and the ranks. So the runner
    gets a process group of its own and a signal goes to the whole group (every rank handles it at
    its next step boundary; launch.py's own forward arrives within SignalStop's grace window), and
    we wait until nothing of the group is left.

    `env`: the environment (default ours). `relay`: a callable given the output as it arrives
    (a notebook cell shows what is written to sys.stdout, not to file descriptor 1); by default
    the output goes straight to our stdout/stderr. The local ranks are watched (RankWatch: the first to
    end; a stopped one, which launch.py's SIGTERM cannot reach, killed 2 s after a rank ended rather than at
    launch.py's SIGKILL 30 s later). `restarting` (--max-restarts): after a restartable end what is left of
    the group is killed at once rather than given launch.py's 30 s.
    """
    env = dict(os.environ if env is None else env)
    signalled = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-exit-") as tmp:
        exit_file = Path(tmp) / "exit_code"
        ends = Path(tmp) / "rank_ends"  # each local rank's own exit code (rank_ends.report_rank_end), for the watch
        ends.mkdir()
        pipe = subprocess.PIPE if relay is not None else None
        # the ranks watch us (launcher_watch.py): a kill -9 of this process ends the job within seconds
        proc = subprocess.Popen(cmd, env={**env, "ZEROTRAIN_EXIT_FILE": str(exit_file), RANK_ENDS: str(ends),
                                          LAUNCHER: launcher_token()},
                                start_new_session=True, stdout=pipe, stderr=subprocess.STDOUT if relay is not None else None)
        watch = RankWatch(proc.pid, ends=ends)

        # DeepSpeed's runner of a local job handles no signal: a SIGINT ends it in a KeyboardInterrupt traceback
        # (its child launch.py, which handles SIGINT, and the ranks stop as they should). It is left out of a
        # forwarded SIGINT and exits with launch.py's code; a multi-node runner handles it (it ends the remote ranks).
        local = not any(a in ("--hostfile", "-H") or a.startswith("--hostfile=") for a in cmd)

        def forward(signum, frame):
            signalled.append(signum)
            _signal_group(proc.pid, signum, but_leader=local and signum == signal.SIGINT)

        old = {}
        try:
            old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread: signals cannot be forwarded from here
            pass
        try:
            watch.start()
            if relay is not None:
                _relay_output(proc.stdout, relay)
            code = proc.wait()
            code = code if code >= 0 else 128 - code
            end = _job_end(code, exit_file, signalled, watch, started)
            if restarting and end.restartable:
                _kill_group(proc.pid)  # nothing of this job may outlive it: the restart needs its ports and files
            deadline = time.time() + 60  # launch.py gives the ranks 30 s after a signal
            while _group_alive(proc.pid) and time.time() < deadline:
                time.sleep(0.2)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            watch.stop()
        return _job_end(code, exit_file, signalled, watch, started)  # rank 0 may have written it while we waited


def _job_end(code: int, exit_file: Path, signalled: list, watch: RankWatch | None, started: float) -> JobEnd:
    left = None  # the code a rank left (rank 0's own; a hang watchdog's)
    if exit_file.is_file():
        try:
            left = int(exit_file.read_text().strip())
        except ValueError:
            pass
    return JobEnd(exit_code=code if left is None else left, from_exit_file=left is not None,
                  signalled=bool(signalled), first_exit=watch.first_exit if watch is not None else None,
                  seconds=round(time.monotonic() - started, 1))


def _write_outer_exit_file(env: dict | None, code: int) -> None:
    outer_exit_file = (os.environ if env is None else env).get("ZEROTRAIN_EXIT_FILE")
    if outer_exit_file:
        Path(outer_exit_file).write_text(f"{code}\n")


def run_with_restarts(command, train_args: list[str], env: dict, restarts: Restarts, find_run_dir=None) -> int:
    """The job (`command(train_args)`: the runner's argv), started again after each restartable end, at most
    `restarts.max_restarts` times, with --resume auto; returns the last job's code. `find_run_dir`: given the
    train flags, the run directory whose manifest.json records the restarts (None: found at the first restart);
    None: this launcher records none (another node's does)."""
    args, attempt, run_dir = list(train_args), 0, None
    while True:
        end = run_job(command(args), env=env, restarting=restarts.max_restarts > 0)
        if restarts.max_restarts == 0 or not end.restartable:
            if restarts.max_restarts and not end.signalled and END_KINDS[end.kind].failed:  # why no restart, said
                print(f"zerotrain launch: job ended {end.cause()}; not restarted ({end.kind}: a fresh start would end"
                      " the same way)", flush=True)
            _record_lost_end(end, run_dir, find=None if find_run_dir is None else lambda: find_run_dir(train_args))
            break
        if find_run_dir is not None and attempt == 0:
            run_dir = find_run_dir(train_args)
        behind = hang_behind(run_dir, end.seconds) if run_dir is not None and end.kind == "hung" else None
        cause = end.cause(behind)
        if attempt >= restarts.max_restarts:
            print(f"zerotrain launch: job ended {cause}; not restarted: {attempt} restart(s) used of --max-restarts"
                  f" {restarts.max_restarts}", flush=True)
            _record_lost_end(end, run_dir, cause)
            break
        attempt += 1
        print(f"zerotrain launch: job ended {cause}; restart {attempt} of {restarts.max_restarts} in"
              f" {restarts.backoff_s:g} s with --resume auto", flush=True)
        if run_dir is not None:
            record = {"attempt": attempt, "max_restarts": restarts.max_restarts, "kind": end.kind,
                      "exit_code": end.exit_code, "cause": cause, "rank": end.rank(behind),
                      **({"behind": behind} if behind else {}), "job_s": end.seconds, "backoff_s": restarts.backoff_s}
            try:
                manifest.record_restart(run_dir, record)
            except OSError as e:  # the run goes on; only its record is missing
                print(f"zerotrain launch: warning: restart not recorded in {run_dir / manifest.MANIFEST}: {e}",
                      file=sys.stderr, flush=True)
        if _interrupted_within(restarts.backoff_s):
            print("zerotrain launch: stopped by a signal during the backoff; not restarted", flush=True)
            break
        args = with_resume_auto(train_args)
    _write_outer_exit_file(env, end.exit_code)
    return end.exit_code


def _lost(end: JobEnd) -> bool:
    """A crash no rank recorded (rank 0 left no exit code: a traceback, a lost rank, a kill)."""
    return not end.from_exit_file and not end.signalled and end.kind == "crash"


def _record_lost_end(end: JobEnd, run_dir: Path | None, cause: str | None = None, find=None) -> None:
    """Such an end closes the run's last segment in manifest.json (`zerotrain runs`: "failed (crashed)" with the
    code and cause, not "no end recorded"); `find()`: the run directory when not known yet. A warning if it
    cannot be written."""
    if not _lost(end):
        return
    try:
        run_dir = run_dir if run_dir is not None or find is None else find()
        if run_dir is not None:
            manifest.record_lost_end(run_dir, end.kind, end.exit_code, cause or end.cause(), time.time() - end.seconds)
    except (OSError, ValueError, ZerotrainError) as e:  # the job's own output said what went wrong
        where = f" in {Path(run_dir) / manifest.MANIFEST}" if run_dir is not None else ""
        print(f"zerotrain launch: warning: the job's end not recorded{where}: {e}", file=sys.stderr, flush=True)


def hang_behind(run_dir: Path, job_s: float) -> list[int] | None:
    """The ranks the newest hang summary (RUN_DIR/hangs/*/summary.json, written by the watchdog of the job
    that just ended) names as behind; None without one."""
    newest = max(Path(run_dir).glob("hangs/*/summary.json"), key=lambda p: p.stat().st_mtime, default=None)
    if newest is None or time.time() - newest.stat().st_mtime > job_s + 5:  # an older job's hang
        return None
    try:
        behind = json.loads(newest.read_text()).get("behind")
    except (OSError, ValueError, AttributeError):
        return None
    ranks = [b.get("rank") if isinstance(b, dict) else b for b in behind] if isinstance(behind, list) else []
    return sorted(r for r in ranks if isinstance(r, int)) or None


def _interrupted_within(seconds: float) -> bool:
    """Sleep `seconds`; True if a SIGTERM/SIGINT arrived meanwhile (it ends the sleep)."""
    got = threading.Event()
    old = {}
    try:
        old = {s: signal.signal(s, lambda signum, frame: got.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread
        pass
    try:
        return got.wait(seconds)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _relay_output(stream, relay) -> None:
    # Chunks, not lines: a progress bar redraws with carriage returns and no newline.
    fd = stream.fileno()
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        relay(chunk.decode("utf-8", errors="replace"))


def _signal_group(pgid: int, signum: int, but_leader: bool = False) -> None:
    """`signum` to every process of group `pgid` (`but_leader`: not to its leader, the process `pgid`)."""
    if not but_leader:
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass
        return
    for pid in _group_members(pgid) - {pgid}:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _group_members(pgid: int) -> set[int]:
    """The processes of group `pgid` (their /proc stat's process group)."""
    members = set()
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields and len(fields) > 2 and fields[2] == str(pgid):
            members.add(int(entry.name))
    return members


def _kill_group(pgid: int, timeout_s: float = 60) -> None:
    """SIGCONT then SIGKILL to the whole group (a SIGSTOPped rank dies too), then wait until none of it is left."""
    for signum in (signal.SIGCONT, signal.SIGKILL):
        _signal_group(pgid, signum)
    deadline = time.time() + timeout_s
    while _group_alive(pgid) and time.time() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        print(f"zerotrain launch: warning: process group {pgid} still alive {timeout_s:g} s after SIGKILL"
              " (a process in uninterruptible I/O?)", file=sys.stderr, flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
