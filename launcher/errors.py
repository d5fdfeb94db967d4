"""The launcher's errors: the exception types of `zerotrain.errors` (a module with no imports, so every package
can use them) re-exported, how a run stops by kind (`StopRun`, its exit code from launcher/ends.py's END_KINDS), a
failed checkpoint save, and `fail`, the one-line error exit.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from zerotrain.errors import DataError, UsageError, ZerotrainError  # noqa: F401  (re-exported)
from zerotrain.launcher.ends import EXIT_USAGE, end_kind


class StopRun(Exception):
    """How a run ends, by kind: raised inside the training loop (and returned by it), recorded in manifest.json.
    The exit code and whether a checkpoint is saved come from END_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.end = end_kind(kind)
        self.kind, self.message = kind, message

    @property
    def exit_code(self) -> int:
        return self.end.exit_code

    @property
    def save(self) -> bool:
        return self.end.saves


class CheckpointError(ZerotrainError):
    """A checkpoint save failed on some rank; every rank raises it (exit EXIT_SAVE_FAILED)."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print one line (rank 0 only, so a 2-rank launch does not say it twice) and exit."""
    if os.environ.get("RANK", "0") == "0":
        print(f"zerotrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
