"""The `zerotrain` command.

    zerotrain train ARGS            the driver in this process (one rank), same flags as launcher/train.py
    zerotrain launch -n N ARGS      the driver on N local ranks under the deepspeed launcher
    zerotrain demo                  build the offline demo mix and train `debug` on 2 CPU ranks
    zerotrain params [PRESET...] [--depth D] [--scaling-rule NAME --heads H] [--vocab-size V]
                                    parameter counts and training FLOPs per token
    zerotrain export RUN_DIR|CHECKPOINT --to DIR    a checkpoint as a Hugging Face Llama directory
    zerotrain profiles              the hardware profiles in ds_configs/
    zerotrain prepare --data MIX.json --tokenizer T --out DIR     tokenize a mix into verified shards
    zerotrain verify DIR            check a prepared shard directory, measure read speed
    zerotrain data-bench --data MIX.json|DIR [--seq-len N --micro-batch N]    the loader alone, tokens/s
    zerotrain tokenizer train --data MIX.json --vocab-size N --out DIR       byte-level BPE, HF format
"""
from __future__ import annotations

import json
import sys

from launcher.errors import UsageError, fail

DATA_COMMANDS = {"prepare": "prepare_main", "verify": "verify_main", "data-bench": "data_bench_main",
                 "tokenizer": "tokenizer_main"}


def cmd_profiles(argv: list[str]) -> None:
    from launcher.profiles import PROFILE_DIR, list_profiles

    for name in list_profiles():
        prof = json.loads((PROFILE_DIR / f"{name}.json").read_text())
        print(f"{name:<26} ZeRO-{prof.get('zero_optimization', {}).get('stage', 0)}  "
              f"{prof.get('zerotrain', {}).get('description', '')}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            from launcher.train import main as train_main

            train_main(rest)
        elif command == "launch":
            from launcher.launch import launch_main

            launch_main(rest)
        elif command == "demo":
            from launcher.demo import main as demo_main

            demo_main(rest)
        elif command == "params":
            from launcher.model_spec import params_main

            params_main(rest)
        elif command == "export":
            from launcher.export import main as export_main

            export_main(rest)
        elif command == "profiles":
            cmd_profiles(rest)
        elif command in DATA_COMMANDS:  # prepare, verify, data-bench, tokenizer: dataio/commands.py
            import dataio.commands

            getattr(dataio.commands, DATA_COMMANDS[command])(rest)
        else:
            raise UsageError(f"unknown command {command!r} (train, launch, demo, params, export, profiles,"
                             f" {', '.join(DATA_COMMANDS)})")
    except UsageError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
