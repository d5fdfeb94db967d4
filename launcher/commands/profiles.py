"""`zerotrain profiles`: the shipped hardware profiles (package data zerotrain.ds_configs), one line each."""
from __future__ import annotations

import json

from zerotrain.cli_args import Parser
from zerotrain.launcher.profiles import PROFILE_DIR, list_profiles


def main(argv: list[str]) -> None:
    Parser(prog="zerotrain profiles", description="The hardware profiles shipped in ds_configs/, one line each:"
           " name, ZeRO stage, what it is for. --profile takes a name, or a path to your own JSON.").parse_args(argv)
    for name in list_profiles():
        prof = json.loads((PROFILE_DIR / f"{name}.json").read_text())
        print(f"{name:<26} ZeRO-{prof.get('zero_optimization', {}).get('stage', 0)}  "
              f"{prof.get('zerotrain', {}).get('description', '')}")
