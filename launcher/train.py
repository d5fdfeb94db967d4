"""The driver's entry for the launchers, in both forms they take:

    deepspeed --num_gpus N --module zerotrain.launcher.train ARGS     (also torchrun -m, accelerate launch -m)
    deepspeed --num_gpus N launcher/train.py ARGS                     (a checkout: the same, as a script)

`zerotrain launch`, the Slurm template and the notebook use the module form: it works the same for a
checkout and a wheel. The command itself is zerotrain.launcher.commands.train.
"""
import gc
import sys
from pathlib import Path

if __package__ in (None, "") and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # Run as a script: Python put this folder first on sys.path, where our module names (config,
    # errors, trainer, ...) would shadow other packages' top-level imports. Import the installed
    # `zerotrain` package instead.
    del sys.path[0]

from zerotrain.launcher.components import startup_gc  # noqa: E402  (light: gc only)

if __name__ == "__main__":  # a rank's start-up without the cyclic collector: its training loop resumes it
    startup_gc.pause()
from zerotrain.launcher.commands.train import main  # noqa: E402

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        # The process ends here. Left as they are, the interpreter's shutdown runs full garbage collections
        # over every object torch, DeepSpeed and the run made while it clears the modules: ~8 s per rank
        # on a 2-core CPU host. Frozen, they are only freed by the exit (nothing of the run is in them:
        # its files are written and closed, its atexit handlers still run).
        gc.freeze()
