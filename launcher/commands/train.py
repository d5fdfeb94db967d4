"""`zerotrain train` (and launcher/train.py under the launchers): the driver's command line: `run(cfg)` (launcher/trainer.py) and exit codes.

Starts the same way under `deepspeed`, `torchrun`, `accelerate launch` and plain `python`
(one process: it sets up the single-rank environment itself). Bad input is refused before
anything is built or written (exit status 2, one line). Exit codes: launcher/ends.py and
README.md ("Long runs"). See README.md for the flags, or `--help`.
"""
from __future__ import annotations

import logging
import os
import sys

from zerotrain.launcher.components.launching.launcher_watch import leave_if_launcher_gone, watch_launcher
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.ends import EXIT_USAGE
from zerotrain.launcher.errors import UsageError, fail
from zerotrain.launcher.rank_ends import report_rank_end
from zerotrain.launcher.trainer import QuietExit, report_exit, run


def main(argv: list[str] | None = None) -> None:
    code = 0
    rank = int(os.environ.get("RANK", "0"))
    rank0 = rank == 0
    watch_launcher(rank)  # started by `zerotrain launch`: end with it
    try:
        result = run(resolve_config(argv))
        code = result.exit_code
    except UsageError as e:  # DataError too: bad input, nothing written
        if getattr(e, "any_rank", False) and not rank0:
            print(f"zerotrain: error: {e}", file=sys.stderr, flush=True)  # the rank that met it says it
            sys.exit(EXIT_USAGE)
        if rank0:  # `zerotrain launch` exits 2, whatever code DeepSpeed's launcher takes: never restarted
            report_exit(EXIT_USAGE)
        fail(str(e))
    except QuietExit:  # another rank met a data error and printed it
        if rank0:
            report_exit(EXIT_USAGE)
        sys.exit(EXIT_USAGE)
    except Exception:
        leave_if_launcher_gone(rank)  # the job is ending with its launcher: no traceback for the lost peer
        raise
    report_rank_end(code)
    if result.extra.get("offload"):
        # ZeRO-Offload: DeepSpeed 0.19 can abort (SIGABRT) while the interpreter tears down its CPU Adam and
        # swap buffers (measured: ZeRO-3 parameter + optimizer offload, 2 runs of 2, after engine.destroy()).
        # The run has ended by now (checkpoint, manifest and exit code written, engine destroyed): leave with
        # the run's code before that teardown can replace it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

