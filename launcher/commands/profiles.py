"""`zerotrain profiles`: the shipped hardware profiles (package data zerotrain.ds_configs), one line each."""
from __future__ import annotations

import json

from zerotrain.launcher.profiles import PROFILE_DIR, list_profiles


def main(argv: list[str]) -> None:
    for name in list_profiles():
        prof = json.loads((PROFILE_DIR / f"{name}.json").read_text())
        print(f"{name:<26} ZeRO-{prof.get('zero_optimization', {}).get('stage', 0)}  "
              f"{prof.get('zerotrain', {}).get('description', '')}")
