"""`python -m zerotrain ...` is the `zerotrain` command (used by the SLURM template and the docs)."""
from zerotrain.launcher.cli import main

if __name__ == "__main__":
    main()
