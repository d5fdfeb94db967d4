"""The project's exception types for dataio: the classes of zerotrain/errors.py (one of each), re-exported
so that data code names them from its own package."""
from zerotrain.errors import DataError, UsageError, ZerotrainError  # noqa: F401  (re-exported)
