"""The project's exception types, in a module that imports nothing (OLMo's `exceptions.py` habit).

It lives in the lowest layer so `dataio`, `modeling` and `launcher` can all raise them without a
lower layer importing a higher one. Exit codes are chosen only in `zerotrain.launcher.train.main()`.
"""


class ZerotrainError(Exception):
    """Base of every error zerotrain reports as one line; str(e) is that line."""


class UsageError(ZerotrainError):
    """A wrong config, profile, hostfile, mix or data file (exit status 2)."""


class DataError(UsageError, ValueError):
    """Bad data input; the message names the input and what is wrong, on one line."""
