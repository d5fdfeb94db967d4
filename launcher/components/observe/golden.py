"""Golden steps: the figures a pre-flight dress rehearsal (`zerotrain preflight --stage v3`) records at a
few steps, and the check a real run with `--golden PATH` makes against them (`GoldenCheck`: warn, or with
`--golden-strict` stop with EXIT_GOLDEN, when tokens/s or peak memory is more than TOLERANCE off; a golden
file of another config or world size is refused naming the keys).

A component: the rehearsal (zerotrain.launcher.commands.preflight) writes the file, the Trainer checks it.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from zerotrain.launcher.config_resolve import drift as config_drift
from zerotrain.launcher.config_resolve import identity_hash
from zerotrain.launcher.errors import UsageError
from zerotrain.reading import read_json_object

GOLDEN_FORMAT, GOLDEN_VERSION = "zerotrain-golden", 1
TOLERANCE = 0.10  # the doctrine: the full run hits the rehearsal's numbers within +-10%
GOLDEN_WINDOW = 5  # a golden step's figures are medians over the steps (s - 5, s]: one step alone is noise
GOLDEN_POINTS = 4  # golden steps per rehearsal


def golden_steps(n_steps: int, window: int = GOLDEN_WINDOW, points: int = GOLDEN_POINTS) -> tuple[list[int], int]:
    """(golden steps, window) for a rehearsal of n_steps: evenly spaced ends of windows that leave
    out step 1 (start-up: allocator, caches, compilation)."""
    window = max(1, min(window, n_steps - 1))
    first = min(n_steps, window + 1)
    if n_steps - first < points:
        return list(range(first, n_steps + 1)), window
    return sorted({round(first + (n_steps - first) * k / (points - 1)) for k in range(points)}), window


def memory_key(record: dict) -> str | None:
    """The peak-memory figure of a step record: GPU memory on an accelerator, else host RSS."""
    return "peak_mem_gib" if "peak_mem_gib" in record else "peak_rss_gib" if "peak_rss_gib" in record else None


def window_figures(records: dict[int, dict], step: int, window: int) -> dict | None:
    """Medians and spread of the step records (by step) in (step - window, step]."""
    recs = [records[s] for s in range(step - window + 1, step + 1) if s in records]
    if not recs or step not in records:
        return None
    times = [r["step_s"] for r in recs if r.get("step_s")]
    out = {"step": step, "steps_in_window": len(recs),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
           "loss": records[step]["loss"]}
    if times:
        med = statistics.median(times)
        out.update(step_s_median=med, step_s_min=min(times), step_s_max=max(times),
                   step_s_spread=(max(times) - min(times)) / med if med else None,
                   data_wait_fraction=sum(r.get("data_wait_s", 0.0) for r in recs) / sum(times))
    key = memory_key(records[step])
    if key:
        out["memory_key"], out[key] = key, records[step][key]
    mfus = [r["mfu"] for r in recs if r.get("mfu") is not None]
    if mfus:
        out["mfu"] = statistics.median(mfus)
    return out


def make_golden(records: list[dict], cfg, world: int, profile: str, device: str, n_steps: int) -> dict:
    """golden.json's content from a rehearsal's metrics (zerotrain.launcher.components.observe.metrics.read_metrics)."""
    by_step = {r["step"]: r for r in records}
    steps, window = golden_steps(n_steps)
    points = [f for f in (window_figures(by_step, s, window) for s in steps) if f is not None]
    return {"format": GOLDEN_FORMAT, "version": GOLDEN_VERSION, "tolerance": TOLERANCE, "window": window,
            "run": cfg.to_dict(), "identity_hash": identity_hash(cfg), "world_size": world, "profile": profile,
            "device": device, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": points}


class GoldenCheck:
    """A real run's comparison with a rehearsal's golden steps (`--golden PATH`).

        golden = GoldenCheck.load(path, cfg, world)   # UsageError: not a golden file, or another config
        message = golden.check(step, record, dist)    # every step, every rank, after the record is logged

    `check` keeps the last `window` step records and, at a golden step, compares the median
    tokens/s over the window and the peak memory at the step with the golden figures: a message
    when either is more than `tolerance` off (either way: a run that does not look like its
    rehearsal was not rehearsed), else None. With `dist` (torch.distributed, world > 1) rank 0's
    verdict is broadcast at golden steps only (every rank knows them), so every rank decides alike.
    """

    def __init__(self, path: str, golden: dict):
        self.path, self.golden = path, golden
        self.window, self.tolerance = int(golden["window"]), float(golden["tolerance"])
        self.by_step = {int(p["step"]): p for p in golden["steps"]}
        self.records: dict[int, dict] = {}

    @property
    def steps(self) -> list[int]:
        return sorted(self.by_step)

    @classmethod
    def load(cls, path: str, cfg, world: int | None = None) -> "GoldenCheck":
        where = f"--golden {path}"
        if not isinstance(path, str) or not Path(path).is_file():
            raise UsageError(f"{where}: no such file")
        raw = read_json_object(Path(path), where)
        if raw.get("format") != GOLDEN_FORMAT or raw.get("version") != GOLDEN_VERSION:
            raise UsageError(f"{where}: not a zerotrain golden file (version {GOLDEN_VERSION}, written by"
                             " `zerotrain preflight --stage v3`)")
        steps = raw.get("steps")
        if (not isinstance(raw.get("run"), dict) or not isinstance(steps, list) or not steps
                or not all(isinstance(p, dict) and isinstance(p.get("step"), int) and p.get("tokens_per_s")
                           for p in steps)):
            raise UsageError(f"{where}: damaged golden file (run, steps or their tokens_per_s missing)")
        for key in ("window", "tolerance", "world_size"):
            if isinstance(raw.get(key), bool) or not isinstance(raw.get(key), (int, float)) or raw[key] <= 0:
                raise UsageError(f"{where}: damaged golden file ({key} missing or not a positive number)")
        try:
            drift = config_drift(cfg, raw["run"])
        except TypeError as e:  # a value the RunConfig cannot hold
            raise UsageError(f"{where}: damaged golden file ({e})") from None
        if world is not None and raw["world_size"] != world:
            drift.append(f"world_size {raw['world_size']!r} -> {world!r}")
        if drift:
            raise UsageError(f"{where}: recorded for another config: {', '.join(drift)}; rehearse this one with"
                             " `zerotrain preflight --stage v3` (same flags, same launch)")
        return cls(path, raw)

    def check(self, step: int, record: dict, dist=None) -> str | None:
        if "event" in record:
            return None
        self.records[step] = record
        for s in [s for s in self.records if s <= step - self.window or s > step]:
            del self.records[s]  # older than the window, or an abandoned timeline after a rollback
        if step not in self.by_step:
            return None
        message = self.compare(step)
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [message]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
        return message

    def compare(self, step: int) -> str | None:
        want = self.by_step[step]
        got = window_figures(self.records, step, self.window)
        if got is None:
            return None
        off, worse = [], False
        for label, key, fmt, bad in (("tokens/s", "tokens_per_s", "{:,.0f}", -1),
                                     ("peak memory", want.get("memory_key"), "{:.2f} GiB", 1)):
            if not key or not want.get(key) or got.get(key) is None:
                continue
            change = got[key] / want[key] - 1
            if abs(change) > self.tolerance:
                off.append(f"{label} {fmt.format(got[key])} vs {fmt.format(want[key])} in the rehearsal"
                           f" ({change:+.0%})")
                worse |= change * bad > 0
        if not off:
            return None
        hint = ("check the node, the data path and what else runs there" if worse else
                "the rehearsal did not measure this run: rehearse again on an idle node")
        return f"golden step {step}: " + "; ".join(off) + f", more than {self.tolerance:.0%} off {self.path} ({hint})"
