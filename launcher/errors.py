"""Bad input ends as exit status 2 and one line naming the input and what is wrong."""
import os
import sys


class UsageError(Exception):
    """A wrong config, profile, hostfile, mix or data file. str(e) is the one line shown."""


def fail(message: str, code: int = 2) -> "NoReturn":  # noqa: F821
    """Print one line (rank 0 only, so a 2-rank launch does not say it twice) and exit."""
    if os.environ.get("RANK", "0") == "0":
        print(f"zerotrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
