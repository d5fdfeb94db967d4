"""`manifest.json`: where, with what and how each launch of a run ran.

One file per run directory, written by rank 0 only, atomically (a kill leaves the previous version). The top level describes the run as first
launched: run id, config hash, profile, seed, package versions, zerotrain's git commit (when the
source tree is a git checkout), hosts, world size, start time. `segments` holds one entry per
launch, the first included: time, hosts, world size, the checkpoint it resumed from, versions
and commit (an upgrade between resumes shows), any ZEROTRAIN_TEST_* test hooks it ran with
(`test_hooks`), and, once `record_end` ran, when and how it ended:
`ended`, `end_step`, `end_reason` (the end kind of launcher/ends.py's END_KINDS: the key keeps its
first name, so manifests of every version read alike), `end_exit_code` and `end_message` (older
manifests may lack these two: readers take the code from the table). A segment without `ended` was
killed (kill -9, node loss) or crashed before it could say so. `restarts` (written by `zerotrain launch
--max-restarts`, components/launching/jobs.py, between two launches, when no rank is left) holds one entry
per restart: `attempt`, `time`, the end kind (`kind`), `exit_code`, `cause` in words, `rank` (the first
rank that exited, when the launcher could see it; for a hang, the ranks the hang summary names as
behind) and `backoff_s`; the segment of the launch that ended is closed then with that kind. `zerotrain
runs` reads it with `read_manifest`. Written with zerotrain.durable (temp file, fsync, rename, fsync the
directory). Where a config's run directory is: launcher/run_plan.py identify().
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from zerotrain import durable, resource_dir
from zerotrain.launcher.components.observe.metrics import read_metrics
from zerotrain.launcher.ends import end_kind
from zerotrain.launcher.errors import StopRun

MANIFEST = "manifest.json"
FORMAT = 1
PACKAGES = ("zerotrain", "deepspeed", "torch", "transformers", "datasets")
# The folder holding launcher/: the checkout root of an editable install, site-packages/zerotrain of a wheel
SOURCE_ROOT = resource_dir("zerotrain.launcher").resolve().parent


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (None: not installed)."""
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(root: Path = SOURCE_ROOT) -> dict | None:
    """{"commit", "dirty"} of the zerotrain checkout at `root`; None if it is not one (an installed
    wheel, no git binary, a broken repository): a manifest never fails for want of git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        # An installed copy inside some other repository (a venv in a project) is not our checkout.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def read_manifest(run_dir: Path) -> dict | None:
    """The manifest of `run_dir`, or None if there is none or it is not readable JSON."""
    try:
        data = json.loads((Path(run_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("segments"), list) else None


def write_or_extend(run_dir: Path, *, run_id: str, config_hash: str, profile: str, seed: int, world_size: int,
                    hosts: list[str], resumed_from: str | None, rank0_only: bool = True,
                    test_hooks: dict[str, str] | None = None) -> dict | None:
    """Start the manifest of a new run, or append a segment for this launch to an existing one.

    `hosts`: the hostnames of every rank (gathered by the caller; duplicates are fine).
    `resumed_from`: the checkpoint this launch loads, None for a fresh start (a relaunch that
    found no checkpoint still appends a segment). `test_hooks`: the ZEROTRAIN_TEST_* variables this launch
    runs with (components/hooks.py), recorded in its segment when there are any. With `rank0_only` (the default) only the
    process with RANK 0 writes and the others return None, so every rank may call it.
    Returns the manifest as written.
    """
    if rank0_only and not _is_rank0():
        return None
    run_dir = Path(run_dir)
    segment = {"started": now_iso(), "hosts": sorted(set(hosts)), "world_size": world_size,
               "from_checkpoint": None if resumed_from is None else str(resumed_from),
               "config_hash": config_hash, "versions": package_versions(), "git": git_commit(),
               "pid": os.getpid(), **({"test_hooks": test_hooks} if test_hooks else {})}
    manifest = read_manifest(run_dir)
    if manifest is None and (run_dir / MANIFEST).exists():  # unreadable: keep it for a human, never stop a run over it
        bad = run_dir / MANIFEST
        bad.replace(run_dir / (MANIFEST + ".unreadable"))
        print(f"zerotrain: warning: {bad} was not readable JSON; kept as {MANIFEST}.unreadable,"
              " starting a new one", file=sys.stderr, flush=True)
    if manifest is None or not manifest["segments"]:  # a new run (or restarts recorded before any launch wrote one)
        manifest = {"format": FORMAT, "run_id": run_id, "config_hash": config_hash, "profile": profile,
                    "seed": seed, "versions": segment["versions"], "git": segment["git"],
                    "hosts": segment["hosts"], "world_size": world_size, "started": segment["started"],
                    "segments": [], **({"restarts": manifest["restarts"]} if manifest and "restarts" in manifest
                                       else {})}
    manifest["segments"].append(segment)
    run_dir.mkdir(parents=True, exist_ok=True)
    durable.write_json(run_dir / MANIFEST, manifest)
    return manifest


def record_end(run_dir: Path, stop: StopRun, step: int, rank0_only: bool = True) -> dict | None:
    """Close the current (last) segment: when it ended, at which step, and how: the end kind, its exit
    code (from the table) and the run's one-line message."""
    if rank0_only and not _is_rank0():
        return None
    manifest = read_manifest(run_dir)
    if manifest is None or not manifest["segments"]:
        return None  # nothing to close (the manifest was never written); not worth failing a run over
    manifest["segments"][-1].update(ended=now_iso(), end_step=step, end_reason=stop.kind,
                                    end_exit_code=stop.exit_code, end_message=stop.message)
    durable.write_json(Path(run_dir) / MANIFEST, manifest)
    return manifest


def record_restart(run_dir: Path, restart: dict) -> dict:
    """Between two launches (no rank alive; `zerotrain launch` alone writes): append `restart` (attempt, kind,
    exit_code, cause, rank, backoff_s; `time` added) to the run's `restarts`, and close the last segment if its
    launch could not (a lost rank, a hang) with that kind, its exit code, the cause and the last logged step.
    A run killed before its manifest was written gets one holding only the restarts (the next launch fills
    in the rest). Returns the manifest as written."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir) or {"format": FORMAT, "run_id": run_dir.name, "segments": []}
    restart = {"time": now_iso(), **restart}
    manifest.setdefault("restarts", []).append(restart)
    _close_open_segment(run_dir, manifest, restart["time"], restart["kind"], restart["exit_code"], restart["cause"])
    run_dir.mkdir(parents=True, exist_ok=True)
    durable.write_json(run_dir / MANIFEST, manifest)
    return manifest


def record_lost_end(run_dir: Path, kind: str, exit_code: int, cause: str, job_started: float) -> bool:
    """After a job no rank of which recorded its end (a traceback, a lost rank: `zerotrain launch` alone writes, no
    rank alive): close the run's last segment with that kind, code and cause, as a restart does, if that segment
    is the job's own (started at or after `job_started`, a time.time(): never an earlier launch's, nor another
    live launch's). False when nothing was closed."""
    manifest = read_manifest(Path(run_dir))
    if not manifest or not manifest.get("segments"):
        return False
    try:
        started = datetime.fromisoformat(manifest["segments"][-1]["started"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return False
    if started < job_started - 1 or not _close_open_segment(Path(run_dir), manifest, now_iso(), kind, exit_code,
                                                            cause):
        return False
    durable.write_json(Path(run_dir) / MANIFEST, manifest)
    return True


def _close_open_segment(run_dir: Path, manifest: dict, when: str, kind: str, exit_code: int, cause: str) -> bool:
    if not manifest["segments"] or "ended" in manifest["segments"][-1]:
        return False
    history = read_metrics(run_dir)
    manifest["segments"][-1].update(ended=when, end_step=history[-1]["step"] if history else 0,
                                    end_reason=end_kind(kind).kind, end_exit_code=exit_code, end_message=cause)
    return True


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:
        pass
    return os.environ.get("RANK", "0") == "0"
