"""Errors and exit codes of the driver.

The exception types live in `zerotrain.dataio.errors` (a module with no imports, so every package can use
them); they are re-exported here. Exit codes are chosen only in `zerotrain.launcher.train.main()` and
`zerotrain.launcher.cli.main()` from the table below (also in README.md, "Long runs").
"""
import json
import os
import sys
from pathlib import Path

from zerotrain.dataio.errors import DataError, UsageError, ZerotrainError  # noqa: F401  (re-exported)

# Exit status of `zerotrain train` / `launch`: a scheduler can tell every way a run ends apart.
EXIT_OK = 0            # finished: --max-steps reached, or a "stop" data source ran out
EXIT_CRASH = 1         # an unexpected error (a traceback)
EXIT_USAGE = 2         # bad input: config, profile, mix, data, checkpoint to resume (nothing written)
EXIT_DIVERGED = 3      # non-finite loss or grad norm, or a loss spike with --on-spike stop
EXIT_EARLY_STOP = 4    # --early-stop-patience: validation loss stopped improving (checkpoint saved)
EXIT_BUDGET = 5        # --max-hours / --total-tokens / --budget-usd reached (checkpoint saved)
EXIT_SIGNAL = 6        # SIGTERM / SIGINT: stopped at a step boundary, checkpoint saved; resume with --resume auto
EXIT_SAVE_FAILED = 7   # a checkpoint could not be written (disk full, I/O error): the previous one is intact
EXIT_GOLDEN = 8        # --golden-strict: tokens/s or peak memory more than 10% off the rehearsal (checkpoint saved)
EXIT_SIGNAL_HARD = 130  # a second signal: exited at once, nothing saved


class CheckpointError(ZerotrainError):
    """A checkpoint save failed on some rank; every rank raises it (exit EXIT_SAVE_FAILED)."""


def fail(message: str, code: int = EXIT_USAGE) -> "NoReturn":  # noqa: F821
    """Print one line (rank 0 only, so a 2-rank launch does not say it twice) and exit."""
    if os.environ.get("RANK", "0") == "0":
        print(f"zerotrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def read_json_object(path: Path, where: str) -> dict:
    """The JSON object in `path`; a syntax error or a non-object is a UsageError naming `where`."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object")
    return raw
