"""zerotrain driver: configuration, profiles, the training loop, checkpoints, the `zerotrain` command.

`from launcher import finetune` is the notebook entry (launcher/commands/finetune.py), imported on first
use so that `import launcher` stays light for the CLI and the ranks.
"""


def __getattr__(name: str):
    if name == "finetune":
        import importlib

        return importlib.import_module("zerotrain.launcher.commands.finetune")  # a module callable as finetune(...)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
