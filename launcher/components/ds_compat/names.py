"""What every part of ds_compat lists: one `PrivateName` per DeepSpeed name it relies on, and the releases
every part was read against (`VERIFIED`). ds_compat/__init__.py gathers the parts' NAMES into PRIVATE_NAMES
and checks them (`check_deepspeed_version`)."""
from __future__ import annotations

from dataclasses import dataclass

VERIFIED = ">=0.19.8,<0.20"  # every function below was read against these releases' source


@dataclass(frozen=True)
class PrivateName:
    """One DeepSpeed name we rely on: `module` imported, then `name` (dotted) looked up in it; or, with
    `file`, that file of the installed package read. `source_has`: text the name's source must contain."""
    module: str
    name: str
    needed_for: str
    correctness: bool  # True: a result is wrong (or a launch hangs) without it; False: an optimisation
    source_has: str = ""
    file: str = ""

