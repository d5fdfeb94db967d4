"""The `zerotrain` command.

    zerotrain train ARGS            the driver in this process (one rank), same flags as launcher/train.py
    zerotrain launch -n N ARGS      the driver on N local ranks under the deepspeed launcher
    zerotrain demo                  build the offline demo mix and train `debug` on 2 CPU ranks
    zerotrain params PRESET...      parameter counts and training FLOPs per token
    zerotrain profiles              the hardware profiles in ds_configs/
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from launcher.errors import UsageError, fail

TRAIN_PY = Path(__file__).resolve().parent / "train.py"


def deepspeed_command(nproc: int, train_args: list[str]) -> list[str]:
    exe = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    return [exe, "--num_gpus", str(nproc), str(TRAIN_PY), *train_args]


def cmd_launch(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("-n", "--nproc"):
        raise UsageError("usage: zerotrain launch -n N [train flags]")
    try:
        nproc = int(argv[1])
    except ValueError:
        raise UsageError(f"launch -n {argv[1]!r}: not an integer") from None
    cmd = deepspeed_command(nproc, argv[2:])
    os.execv(cmd[0], cmd)


def cmd_params(argv: list[str]) -> None:
    from modeling.model import PRESETS, count_params, flops_per_token, preset

    names = argv or list(PRESETS)
    print(f"{'preset':<14}{'layers':>7}{'dim':>6}{'heads':>6}{'kv':>4}{'total':>14}{'non-emb':>14}{'FLOPs/tok@2048':>16}")
    for name in names:
        try:
            args = preset(name)
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        n = count_params(args)
        print(f"{name:<14}{args.n_layers:>7}{args.dim:>6}{args.n_heads:>6}{args.n_kv_heads:>4}"
              f"{n['total']:>14,}{n['non_embedding']:>14,}{flops_per_token(args, 2048):>16.3e}")


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
            cmd_launch(rest)
        elif command == "demo":
            from launcher.demo import main as demo_main

            demo_main(rest)
        elif command == "params":
            cmd_params(rest)
        elif command == "profiles":
            cmd_profiles(rest)
        else:
            raise UsageError(f"unknown command {command!r} (train, launch, demo, params, profiles)")
    except UsageError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
