"""A rank's exit code, left where `zerotrain launch` reads it: DeepSpeed's launcher loses a rank's own code (it
exits 1 when it forwards SIGTERM or when a rank exits non-zero), so each rank writes it to a file the launch names.
"""
from __future__ import annotations

import os
from pathlib import Path

RANK_ENDS = "ZEROTRAIN_RANK_ENDS"  # set by `zerotrain launch` (jobs.run_job): where each local rank leaves its code


def report_rank_end(code: int) -> None:
    """Every rank of a `zerotrain launch`, as it leaves: its exit code, in the RANK_ENDS directory under its
    RANK. The rank watch (components/launching/restarts.py RankWatch) reads it for a rank that its launcher
    reaped before the watch could read the status: a rank gone without one was killed or crashed."""
    ends = os.environ.get(RANK_ENDS)
    if ends:
        try:
            Path(ends, os.environ.get("RANK", "0")).write_text(f"{code}\n")
        except OSError:  # the launcher and its directory are gone: nobody reads it
            pass


def report_exit(code: int) -> None:
    """For `zerotrain launch` (launcher/commands/launch.py): DeepSpeed's launcher exits 1 when it forwards
    SIGTERM or when a rank exits non-zero, losing our code; the rank that decides the end (rank 0, or a
    rank's hang watchdog) leaves it in ZEROTRAIN_EXIT_FILE."""
    path = os.environ.get("ZEROTRAIN_EXIT_FILE")
    if path:
        Path(path).write_text(f"{code}\n")
