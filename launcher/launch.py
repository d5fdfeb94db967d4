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
from pathlib import Path

from launcher.errors import UsageError

TRAIN_PY = Path(__file__).resolve().parent / "train.py"


def deepspeed_command(nproc: int, train_args: list[str]) -> list[str]:
    exe = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    return [exe, "--num_gpus", str(nproc), str(TRAIN_PY), *train_args]


def run_preserving_exit_code(cmd: list[str]) -> int:
    """Run a launcher command, pass our SIGTERM/SIGINT on to it, return rank 0's own exit code."""
    with tempfile.TemporaryDirectory(prefix="zerotrain-exit-") as tmp:
        exit_file = Path(tmp) / "exit_code"
        proc = subprocess.Popen(cmd, env={**os.environ, "ZEROTRAIN_EXIT_FILE": str(exit_file)})
        forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = proc.wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if exit_file.is_file():
            try:
                return int(exit_file.read_text().strip())
            except ValueError:
                pass
        return code


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
