"""The one argparse subclass every `zerotrain` command parses its flags with.

    p = Parser(prog="zerotrain export", description=...)
    p.add_argument("--max-shard-size", default="5GB", help="...")
    ns = p.parse_args(argv)

What it adds to argparse, for every command alike:
- bad usage raises zerotrain.errors.UsageError("PROG: what is wrong"): one line, and the command's
  `main` exits 2 with it, instead of argparse's usage block and its own exit;
- `-h/--help` prints the usage and exits 0 (argparse's own), before the command does anything;
- help shows each option's default where it has one (not None, not an unset switch) and its choices;
- every `type=int` option is read by `integer` (the registry's "int" type): an exact integer, also in
  e-notation (`1e6`), never one past int64 (`1e400` would otherwise end in an OverflowError downstream);
- every dashed long flag also answers to its underscore spelling (`--micro_batch 4`, `--micro_batch=4`
  == `--micro-batch 4`), as recipe keys do and as DeepSpeed and Hugging Face users type them. The
  alias is resolved before parsing, so help lists each flag once.

A count of tokens (`--total-tokens`, `--warmup-tokens`, `--global-batch-tokens`, `--eval-tokens`: flags,
recipe values, the notebook's keywords) is read by `token_count`: `4096`, `11e9`, `11B`, `500M`, `2T`, `1.5B`,
exact integers only (`2.5`, `1.5e0` refused), the same function for every surface (launcher/config.py).

It lives in the root package and imports only zerotrain.errors, so dataio and launcher both use it.
"""
from __future__ import annotations

import argparse
import decimal
import math
import re
import sys

from zerotrain.errors import UsageError


class HelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, but only where a default exists and the text does not
    already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default is argparse.SUPPRESS
                or default == [] or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


MAX_INT = 2**63 - 1  # what an int64 holds (numpy, torch, the tokenizers' Rust): no count of ours goes past it
TOKEN_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}  # decimal, as token counts are written
TOKEN_COUNT_FORMS = "11e9, 11B, 500M, 2T or 4096"
_NUMBER = re.compile(r"([+-]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]?)")


def exact_integer(value, suffixes: bool = False) -> int:
    """`value` (a flag's text, a JSON number, a keyword's int or float) as an int; ValueError saying why not:
    not a number, not a whole number (2.5, 1.5e0), beyond int64 (1e400). `suffixes`: K, M, B, T (thousand,
    million, billion, trillion: decimal) after the number, as in 11B. Decimal arithmetic, so 1.5B is exactly
    1500000000 and 1e400 neither rounds nor overflows before it is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("not a number")
    if isinstance(value, int):
        number = decimal.Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        number = decimal.Decimal(value)
    else:
        m = _NUMBER.fullmatch(value.strip())
        scale = TOKEN_SUFFIXES.get(m.group(2).upper()) if m and suffixes else (1 if m and not m.group(2) else None)
        if m is None or scale is None:
            raise ValueError("not a number" + (f" (a count is written {TOKEN_COUNT_FORMS})" if suffixes else ""))
        number = decimal.Decimal(m.group(1).replace("_", ""))
        if not number.is_zero() and number.adjusted() > 40:  # before any arithmetic: 1e999999999 would trap
            raise ValueError(f"too large (at most {MAX_INT:,})")
        if not number.is_zero() and number.adjusted() < -40:  # 1e-999999999 would round to 0
            raise ValueError("not a whole number")
        with decimal.localcontext() as exact:
            exact.prec = len(value) + 60  # enough digits that the scaling never rounds
            number = number * scale
    if abs(number) > MAX_INT:
        raise ValueError(f"too large (at most {MAX_INT:,})")
    if number != number.to_integral_value():
        raise ValueError("not a whole number")
    return int(number)


def integer(text: str) -> int:
    """argparse's `type=int`, as every Parser reads it: exact integers, e-notation too, never past int64."""
    try:
        return exact_integer(text)
    except ValueError as e:
        if str(e).startswith("not a number"):
            raise  # argparse's own words: "invalid int value: 'x'"
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def token_count(text: str) -> int:
    """A count of tokens on a command line: 11e9, 11B, 500M, 2T, 4096 (exact integers; the sign is checked
    where the value is, launcher/config.py, with the same words for a flag and a recipe)."""
    try:
        return exact_integer(text, suffixes=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self.register("type", int, integer)  # argument groups share the registry: every type=int of this parser

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")

    def parse_known_args(self, args=None, namespace=None):
        args = self.dashed(list(sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def dashed(self, args: list[str]) -> list[str]:
        """`args` with `--an_option[=V]` spelled `--an-option[=V]` where only the dashed one is an option
        of this parser; nothing after a bare `--` (it belongs to another command) is touched."""
        known = {s for action in self._actions for s in action.option_strings}
        out = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            name, eq, value = arg.partition("=") if isinstance(arg, str) else ("", "", "")
            if name.startswith("--") and "_" in name and name not in known:
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in known:
                    arg = dashed + eq + value
            out.append(arg)
        return out
