"""The `zerotrain` command.

    zerotrain train ARGS            the driver in this process (one rank), same flags as launcher/train.py
    zerotrain launch -n N [--master_port P] ARGS   the driver on N local ranks under the deepspeed launcher
    zerotrain launch --hostfile H [--force] [--skip-host-checks] [deepspeed flags] -- ARGS   checked multi-node launch
    zerotrain slurm [--nodes N --gpus-per-node G --max-requeues K --dry-run ...] -- ARGS    sbatch script with requeue
    zerotrain demo                  build the offline demo mix and train `debug` on 2 CPU ranks
    zerotrain params [PRESET...] [--depth D] [--scaling-rule NAME --heads H] [--vocab-size V]
                                    parameter counts and training FLOPs per token
    zerotrain export RUN_DIR|CHECKPOINT --to DIR    a checkpoint as a Hugging Face Llama directory
    zerotrain plan TRAIN-FLAGS [--gpus N --gpu-mem GiB --nodes M] [--mfu F] [--json]    memory, time, money
    zerotrain preflight --stage v1|v2|v3 TRAIN-FLAGS    staged checks before a long run (docs/preflight.md)
    zerotrain profiles              the hardware profiles in ds_configs/
    zerotrain prepare --data MIX.json --tokenizer T --out DIR     tokenize a mix into verified shards
    zerotrain verify DIR            check a prepared shard directory, measure read speed
    zerotrain data-bench --data MIX.json|DIR [--seq-len N --micro-batch N]    the loader alone, tokens/s
    zerotrain tokenizer train --data MIX.json --vocab-size N --out DIR       byte-level BPE, HF format
    zerotrain report RUN_DIR [--compare RUN_DIR2 ...]   plots + report.md in RUN_DIR/report/
    zerotrain runs [OUT]            the run directories under OUT (default runs): status, steps, losses
    zerotrain --version             the installed version

`python -m zerotrain ...` is the same command.
"""
from __future__ import annotations

import importlib
import sys

import zerotrain
from zerotrain.launcher.components import startup_gc
from zerotrain.launcher.errors import UsageError, fail

# command -> (module, function): each function takes the argument list and is also the Python API.
# One line per command (litgpt's __main__.py habit); the usage text is this module's docstring.
COMMANDS = {
    "train": ("zerotrain.launcher.commands.train", "main"),
    "launch": ("zerotrain.launcher.commands.launch", "launch_main"),
    "slurm": ("zerotrain.launcher.commands.launch", "slurm_main"),
    "demo": ("zerotrain.launcher.commands.demo", "main"),
    "params": ("zerotrain.launcher.commands.params", "params_main"),
    "plan": ("zerotrain.launcher.commands.plan", "plan_main"),
    "preflight": ("zerotrain.launcher.commands.preflight", "main"),
    "export": ("zerotrain.launcher.commands.export", "main"),
    "profiles": ("zerotrain.launcher.commands.profiles", "main"),
    "prepare": ("zerotrain.dataio.pipeline.commands", "prepare_main"),
    "verify": ("zerotrain.dataio.pipeline.commands", "verify_main"),
    "data-bench": ("zerotrain.dataio.pipeline.commands", "data_bench_main"),
    "tokenizer": ("zerotrain.dataio.pipeline.commands", "tokenizer_main"),
    "report": ("zerotrain.launcher.commands.report", "report_main"),
    "runs": ("zerotrain.launcher.commands.report", "runs_main"),
}


def main(argv: list[str] | None = None) -> None:
    """The command line (argv None: the process's entry, the console script or `python -m zerotrain`; a list:
    called in-process, as the tests and the Python API do)."""
    entry = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    if argv[0] in ("-V", "--version"):
        print(f"zerotrain {zerotrain.__version__}")
        return
    command, rest = argv[0], argv[1:]
    try:
        if command not in COMMANDS:
            raise UsageError(f"unknown command {command!r} ({', '.join(COMMANDS)})")
        module, function = COMMANDS[command]
        if entry:  # the process's start-up without the cyclic collector (components/startup_gc.py)
            startup_gc.pause()
        run = getattr(importlib.import_module(module), function)
        if command != "train":  # `zerotrain train` resumes at its training loop, after the engine's build
            startup_gc.resume()
        run(rest)
    except UsageError as e:
        fail(str(e))
    finally:
        startup_gc.resume()  # a train that ended before its loop (--help, --dry-run, bad input)


if __name__ == "__main__":
    main()
