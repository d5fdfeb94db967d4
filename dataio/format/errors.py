"""The project's exception types for dataio: the classes of zerotrain/errors.py (one of each), re-exported
so that data code names them from its own package; and `first_line`, how a library's exception becomes
the one line a DataError quotes."""
from zerotrain.errors import DataError, DataNotHere, UsageError, ZerotrainError  # noqa: F401  (re-exported)


def first_line(e: Exception) -> str:
    """The first line of an exception's message (datasets, pyarrow and numpy write several), else its type's name."""
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
