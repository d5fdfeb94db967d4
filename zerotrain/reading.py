"""Reading a JSON or YAML file a user hands zerotrain (a mix, a recipe, a profile, a golden record, a Hugging Face
config.json, scaling rules), with the one-line error every reader gives: "WHERE: invalid JSON (WHAT at line L
column C)", "WHERE: expected a JSON object", "WHERE: invalid YAML (WHAT)". `error`: the exception class the
caller's layer raises (UsageError by default; DataError for data, ValueError in modeling/). YAML is read with
safe_load (plain data only). In the root package, so dataio, modeling and launcher share it.
"""
from __future__ import annotations

import json
from pathlib import Path

from zerotrain.errors import UsageError


def read_json(path: str | Path, where: str, error: type[Exception] = UsageError, column: bool = True):
    """The JSON value in `path`; a syntax error is `error`, one line naming `where` (its line, and its column
    unless `column` is False)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        at = f"line {e.lineno} column {e.colno}" if column else f"line {e.lineno}"
        raise error(f"{where}: invalid JSON ({e.msg} at {at})") from None


def read_json_object(path: str | Path, where: str, error: type[Exception] = UsageError, column: bool = True) -> dict:
    """The JSON object in `path`; a syntax error or a non-object is `error` naming `where`."""
    raw = read_json(path, where, error, column)
    if not isinstance(raw, dict):
        raise error(f"{where}: expected a JSON object")
    return raw


def read_yaml(path: str | Path, where: str, error: type[Exception] = UsageError):
    """The YAML data in `path` (safe_load); a syntax error is `error` naming `where` and the parser's first line."""
    import yaml  # only the readers of YAML pay for it

    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise error(f"{where}: invalid YAML ({str(e).splitlines()[0]})") from None
