"""--sequence-parallel N checked against the launch and the model, torch-free, before anything is written (the one
resolution, pre-flight). Moved here from launcher/resolution.py; the planner's side of the check (N divides the
world, --seq-len and the heads; the all-to-all's bytes and time) is launcher/planning/sequence.py.
"""
from __future__ import annotations

from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.planning import check_sequence_parallel


def check_sequence_parallel_plan(cfg: RunConfig, settings, model_args, world: int,
                                 one_rank: str = "this launch has 1") -> int:
    """--sequence-parallel N checked against the launch and the model (UsageError, one line, before anything
    is written): planning.check_sequence_parallel."""
    sp = settings.sequence_parallel
    check_sequence_parallel(sp, f"--sequence-parallel {sp} ({settings.sources['sequence_parallel']})", cfg.data.seq_len,
                            model_args, world, one_rank)
    return sp
