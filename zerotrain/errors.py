"""The project's exception types, in a module that imports nothing (OLMo's `exceptions.py` habit).

It lives in the root package, below every layer, so `dataio`, `modeling`, `launcher` and the shared
argparse subclass (zerotrain/cli_args.py) raise the same classes. `zerotrain.dataio.format.errors` and
`zerotrain.launcher.errors` re-export them. Exit codes are chosen only in the commands' `main()`s
(zerotrain.launcher.errors has the table).
"""


class ZerotrainError(Exception):
    """Base of every error zerotrain reports as one line; str(e) is that line."""


class UsageError(ZerotrainError):
    """A wrong command line, config, profile, hostfile, mix or data file (exit status 2)."""


class DataError(UsageError, ValueError):
    """Bad data input; the message names the input and what is wrong, on one line."""


class DataNotHere(DataError):
    """Data named but not on this machine yet: a data file not written, a hub dataset not cached while
    offline. A run refuses it like any DataError; `zerotrain plan` plans without it (epochs unknown)."""
