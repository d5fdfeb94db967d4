"""`python -m zerotrain.launcher.commands.preflight ...` and `deepspeed --module zerotrain.launcher.commands.preflight ...`."""
import sys

from zerotrain.launcher.commands.preflight.harness import main

if __name__ == "__main__":
    main(sys.argv[1:])
