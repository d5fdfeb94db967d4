"""Bad input ends as exit status 2 and one line naming the input and what is wrong."""
import json
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """A wrong config, profile, hostfile, mix or data file. str(e) is the one line shown."""


def fail(message: str, code: int = 2) -> "NoReturn":  # noqa: F821
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
