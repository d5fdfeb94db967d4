"""The one exception the data path raises for bad input (a mix, a source, a data file)."""


class DataError(ValueError):
    """Bad data input; the message names the input and what is wrong, on one line."""
