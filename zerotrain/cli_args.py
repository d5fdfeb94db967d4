"""The one argparse subclass every `zerotrain` command parses its flags with.

    p = Parser(prog="zerotrain export", description=...)
    p.add_argument("--max-shard-size", default="5GB", help="...")
    ns = p.parse_args(argv)

What it adds to argparse, for every command alike:
- bad usage raises zerotrain.errors.UsageError("PROG: what is wrong"): one line, and the command's
  `main` exits 2 with it, instead of argparse's usage block and its own exit;
- `-h/--help` prints the usage and exits 0 (argparse's own), before the command does anything;
- help shows each option's default where it has one (not None, not an unset switch) and its choices;
- every dashed long flag also answers to its underscore spelling (`--micro_batch 4`, `--micro_batch=4`
  == `--micro-batch 4`), as recipe keys do and as DeepSpeed and Hugging Face users type them. The
  alias is resolved before parsing, so help lists each flag once.

It lives in the root package and imports only zerotrain.errors, so dataio and launcher both use it.
"""
from __future__ import annotations

import argparse
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


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

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
