"""The real training run, with ZeRO-3's parameter all-gathers counted on each rank (tests/test_workstation_recipes.py).

Launched by the real `deepspeed` launcher in place of launcher/train.py, with the same arguments; it runs the
driver unchanged (`zerotrain.launcher.commands.train.main`) with two of DeepSpeed 0.19.8's functions wrapped:
- `partition_parameters._dist_allgather_fn`: every parameter all-gather ZeRO-3 issues goes through it (the
  coalesced and the single-parameter paths of `all_gather_coalesced`, runtime/zero/partition_parameters.py);
  counted as calls and as elements received (the gathered buffer, padded partitions included);
- `PartitionedParameterCoordinator.reset_step`: called by the start-of-forward hook of the top module
  (runtime/zero/parameter_offload.py), so it opens one forward + backward of one micro-batch.
Each rank writes OUT_DIR/gathers-rank{R}.json: one entry per forward (whether gradients were on, the trace mode
the coordinator runs it in, calls, elements), the first entry holding what was gathered before the
first forward; the file is rewritten at the start of every forward (a killed run leaves the passes it finished).

Usage: deepspeed --num_gpus 2 tests/helpers/gather_count_harness.py OUT_DIR TRAIN_ARGS...
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)
warnings.filterwarnings("ignore", category=FutureWarning)


def main(out_dir: str, train_args: list[str]) -> None:
    import torch
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from zerotrain.launcher.commands.train import main as train

    segments = [{"phase": "before the first forward", "grad": None, "trace": None, "calls": 0, "elements": 0}]
    gather, reset = partition_parameters._dist_allgather_fn, PartitionedParameterCoordinator.reset_step

    def counting_gather(input_tensor, output_tensor, group=None):
        segments[-1]["calls"] += 1
        segments[-1]["elements"] += output_tensor.numel()
        return gather(input_tensor, output_tensor, group)

    def write() -> None:  # after every pass: a run killed with kill -9 leaves the passes it finished
        Path(out_dir, f"gathers-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(segments, indent=1))

    def opening_reset(self):
        write()
        reset(self)
        trace = ("complete" if self.is_complete_trace() else "record" if self.is_record_trace() else "invalid")
        segments.append({"phase": "forward", "grad": torch.is_grad_enabled(), "trace": trace, "calls": 0,
                         "elements": 0})

    try:
        with mock.patch.object(partition_parameters, "_dist_allgather_fn", counting_gather), \
                mock.patch.object(PartitionedParameterCoordinator, "reset_step", opening_reset):
            train(train_args)
    finally:
        write()


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    with exit_after():
        main(args[0], args[1:])
