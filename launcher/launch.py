"""`zerotrain launch -n N [train flags]`: the driver on N local ranks under DeepSpeed's launcher.

DeepSpeed's launcher (deepspeed/launcher/launch.py) forwards SIGTERM/SIGINT to its children,
gives them 30 s, kills them, and then exits 1 itself, so the driver's documented exit code (6:
stopped by a signal, checkpoint saved) would be lost. Rank 0 therefore also writes its exit code
to a file named by ZEROTRAIN_EXIT_FILE, and this command exits with that code when it exists.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.errors import UsageError

TRAIN_PY = Path(__file__).resolve().parent / "train.py"


def deepspeed_command(nproc: int, train_args: list[str]) -> list[str]:
    exe = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    return [exe, "--num_gpus", str(nproc), str(TRAIN_PY), *train_args]


def run_preserving_exit_code(cmd: list[str]) -> int:
    """Run a launcher command, pass our SIGTERM/SIGINT on to it, return rank 0's own exit code.

    The `deepspeed` runner (deepspeed/launcher/runner.py) installs no signal handler for a local
    launch: a SIGTERM sent to it alone kills it and orphans launch.py and the ranks. So the runner
    gets a process group of its own and a signal goes to the whole group (every rank handles it at
    its next step boundary; launch.py's own forward arrives within SignalStop's grace window), and
    we wait until nothing of the group is left.
    """
    with tempfile.TemporaryDirectory(prefix="zerotrain-exit-") as tmp:
        exit_file = Path(tmp) / "exit_code"
        proc = subprocess.Popen(cmd, env={**os.environ, "ZEROTRAIN_EXIT_FILE": str(exit_file)},
                                start_new_session=True)
        forward = lambda signum, frame: _signal_group(proc.pid, signum)  # noqa: E731
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = proc.wait()
            deadline = time.time() + 60  # launch.py gives the ranks 30 s after a signal
            while _group_alive(proc.pid) and time.time() < deadline:
                time.sleep(0.2)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if exit_file.is_file():
            try:
                return int(exit_file.read_text().strip())
            except ValueError:
                pass
        return code if code >= 0 else 128 - code


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def launch_main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("-n", "--nproc"):
        raise UsageError("usage: zerotrain launch -n N [train flags]")
    try:
        nproc = int(argv[1])
    except ValueError:
        raise UsageError(f"launch -n {argv[1]!r}: not an integer") from None
    if nproc < 1:
        raise UsageError(f"launch -n {nproc}: must be at least 1")
    sys.exit(run_preserving_exit_code(deepspeed_command(nproc, argv[2:])))
