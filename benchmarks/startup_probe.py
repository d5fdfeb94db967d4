"""Launched in place of launcher/train.py by benchmarks/startup.py: the same driver
(`zerotrain.launcher.train.main`), with timestamps taken around its start-up phases by wrapping the functions
it calls (nothing in the driver is edited). Rank 0 writes them as JSON to ZT_STARTUP_OUT when the
first optimizer step has been logged; the run then goes on as usual.

Phases: the launcher processes' own start (from /proc: the deepspeed runner and launch.py are this
process's ancestors), this process's exec, its imports, the plan (profile, tokenizer, data read and
verified: `zerotrain.dataio.pipeline.loader.load_data` timed inside it), process-group set-up (DeepSpeed's
`init_distributed`, its communication op load timed inside it), model build (`_build_engine` less
`deepspeed.initialize`), engine init (`deepspeed.initialize`), the data loader (`_build_data`), and
the first step.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

T_MAIN = time.time()
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def started_at(pid: int | str = "self") -> float:
    """A process's start time (seconds since the epoch) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def ancestors() -> list[dict]:
    """(pid, command, start time) of the parent chain up to the benchmark controller."""
    out, pid = [], os.getppid()
    stop = int(os.environ.get("ZT_STARTUP_CONTROLLER", "1"))
    while pid > 1 and pid != stop:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        out.append({"pid": pid, "cmd": " ".join(c.decode(errors="replace") for c in cmd[:4]), "t": started_at(pid)})
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return out


marks = {"rank_exec": started_at(), "probe_main": T_MAIN, "ancestors": ancestors()}
durations: dict[str, float] = {}


def timed(owner, name: str, label: str):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            durations[label] = durations.get(label, 0.0) + time.time() - t0
            marks.setdefault(f"{label}_start", t0)
    setattr(owner, name, wrapper)


t0 = time.time()
import torch  # noqa: E402
marks["import_torch_s"] = time.time() - t0
t0 = time.time()
import deepspeed  # noqa: E402
marks["import_deepspeed_s"] = time.time() - t0
t0 = time.time()
import zerotrain.dataio.pipeline.loader  # noqa: E402
import zerotrain.launcher.components.observe.metrics  # noqa: E402
import zerotrain.launcher.train  # noqa: E402
import zerotrain.launcher.trainer  # noqa: E402
from deepspeed.ops.op_builder.builder import OpBuilder  # noqa: E402

marks["import_zerotrain_s"] = time.time() - t0
marks["imports_done"] = time.time()

timed(zerotrain.launcher.trainer, "plan_run", "plan")
timed(zerotrain.dataio.pipeline.loader, "load_data", "data_load_verify")
timed(deepspeed, "init_distributed", "init_distributed")
# DeepSpeed's CPU builders may come from a second import of the op_builder package (its own class
# objects): patch the class that defines load() for the builder the CPU accelerator hands out.
from deepspeed.accelerator import get_accelerator  # noqa: E402

_builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
timed(next(c for c in type(_builder).__mro__ if "load" in c.__dict__) if _builder else OpBuilder, "load", "op_load")
timed(zerotrain.launcher.trainer.Trainer, "__init__", "trainer_init")
timed(zerotrain.launcher.trainer.Trainer, "_build_engine", "build_engine")
timed(deepspeed, "initialize", "deepspeed_initialize")
timed(zerotrain.launcher.trainer.Trainer, "_build_data", "build_data")
timed(zerotrain.launcher.trainer.Trainer, "train", "train")

original_log = zerotrain.launcher.components.observe.metrics.MetricsLogger.log


def log(self, record):
    original_log(self, record)
    if record.get("step") == 1 and "event" not in record and "first_step" not in marks:
        marks["first_step"] = time.time()
        marks["first_step_s"] = record.get("step_s")
        out = os.environ.get("ZT_STARTUP_OUT")
        if out and os.environ.get("RANK", "0") == "0":
            Path(out).write_text(json.dumps({**marks, "durations": durations}))


zerotrain.launcher.components.observe.metrics.MetricsLogger.log = log

if __name__ == "__main__":
    zerotrain.launcher.train.main(sys.argv[1:])  # exactly as launcher/train.py does
