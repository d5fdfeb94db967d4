"""`python -m zerotrain ...` is the `zerotrain` command (used by the SLURM template and the docs)."""
import gc

from zerotrain.launcher.cli import main

if __name__ == "__main__":
    try:
        main()
    finally:
        gc.freeze()  # the exit frees it all: no full collections in the interpreter's shutdown (launcher/train.py)
