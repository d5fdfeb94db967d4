"""zerotrain driver: configuration, profiles, the training loop, checkpoints, the `zerotrain` command.

`from zerotrain.launcher import finetune` is the notebook entry (launcher/commands/finetune.py), imported on
first use so that `import zerotrain.launcher` stays light for the CLI and the ranks (it trains: torch).
"""
import importlib


def __getattr__(name: str):
    if name == "finetune":
        return importlib.import_module("zerotrain.launcher.commands.finetune")  # a module callable as finetune(...)
    raise AttributeError(f"module 'zerotrain.launcher' has no attribute {name!r}")
