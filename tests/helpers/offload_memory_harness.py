"""The real training run, with the host memory its offloaded state takes measured on each rank
(tests/test_offload_runs.py: the planner's host-memory figure checked against it).

Launched by the real `deepspeed` launcher in place of launcher/train.py, with the same arguments; it runs the
driver unchanged (`zerotrain.launcher.commands.train.main`) with DeepSpeed's `DeepSpeedEngine.step` wrapped: after
the first optimizer step (Adam's moments exist only then) each rank writes OUT_DIR/offload-rank{R}.json: the
bytes of the tensors DeepSpeed's offloaded ZeRO optimizer holds on the host, by the planner's components
(`ds_compat.offloaded_state_bytes`: each storage once), the model's parameter count (ZeRO-3: the full count, not
the partition), and the process's resident set (VmRSS) at that moment.

On DeepSpeed's CPU accelerator host and device memory are the same RAM: what is measured is the size of the
state DeepSpeed keeps in its offload structures, not memory moved off a device.

Usage: deepspeed --num_gpus 2 tests/helpers/offload_memory_harness.py OUT_DIR TRAIN_ARGS...
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


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main(out_dir: str, train_args: list[str]) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from zerotrain.launcher.commands.train import main as train
    from zerotrain.launcher.components import ds_compat

    step, written = DeepSpeedEngine.step, []

    def measuring_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        if not written:
            written.append(True)
            params = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
            record = {"bytes": ds_compat.offloaded_state_bytes(self), "params": params, "rss": rss_bytes()}
            Path(out_dir, f"offload-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
        return result

    with mock.patch.object(DeepSpeedEngine, "step", measuring_step):
        train(train_args)


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    with exit_after():
        main(args[0], args[1:])
