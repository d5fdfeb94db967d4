"""Where a run's numbers go: sinks behind one small interface (torchtitan's `components/metrics.py`).

`metrics.jsonl` in the run directory is the one sink every run has: one JSON object per step,
appended, never rewritten. A resume, or a rollback after a loss spike, appends an event record
(`{"event": "resume" | "rollback", "step": k, ...}`) and then re-logs steps after k: `read_metrics`
gives the effective history (a later record for a step replaces the earlier one; an event at
step k drops what was logged after k before it). Only rank 0 writes.
"""
from __future__ import annotations

import json
from pathlib import Path


class JsonlSink:
    def __init__(self, path: Path):
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class MetricsLogger:
    """`log(record)` for step records, `event(kind, step, **info)` for resumes, rollbacks and stops."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.sinks = [JsonlSink(run_dir / "metrics.jsonl")] if is_main else []

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def event(self, kind: str, step: int, **info) -> None:
        self.log({"event": kind, "step": step, **info})

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(run_dir: Path, events: bool = False) -> list[dict]:
    """The effective per-step history of a run (see the module docstring), oldest step first."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    steps: dict[int, dict] = {}
    seen_events = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill -9 mid-write
            continue
        if "event" in record:
            seen_events.append(record)
            if record["event"] in ("resume", "rollback"):
                steps = {s: r for s, r in steps.items() if s <= record["step"]}
            continue
        steps[record["step"]] = record
    history = [steps[s] for s in sorted(steps)]
    return seen_events if events else history
