"""Checkpoints on disk: tags, completion markers, verification, choosing the resume point, and which
tags rotation removes.

DeepSpeed's `engine.save_checkpoint` / `load_checkpoint` stay the engine; tags are `global_stepN`
under `RUN/checkpoints/`. This module is the format around them, read and checked from plain files
(no torch: `zerotrain runs`/`report` use it on a login node):

- **Completion.** A tag is complete only once `zerotrain.json` (MARKER) exists in it: the writer's
  meta (step, tokens, world size ...; read before anything is unpickled) plus `files`, each file's
  size and sha256. DeepSpeed's `latest` file is never read here (it is written before the other
  ranks finish); the Checkpointer writes it once a marker exists, for DeepSpeed's zero_to_fp32.py.
- **Resume.** `find_resume` takes the newest complete checkpoint whose files verify, falling back
  to older ones (saying so), the local directory and the mirror together. Markers written before
  `files` existed are accepted as complete.
- **Rotation** (`rotation_victims`, `drop_tag`), **best.json** (`read_best_list`, `rank_best`: the K lowest validation losses), the mirror's place
  (`check_mirror`).

Not here: writing checkpoints, when to save, the background completion, the mirror copy
(components/checkpoints/checkpointer.py); the run directory's lock (components/checkpoints/run_lock.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zerotrain.launcher.errors import UsageError

MARKER = "zerotrain.json"
TAG = re.compile(r"^global_step(\d+)$")
BEST = "best.json"
PARTIAL = ".partial"  # suffix of a mirror copy in progress: never matches TAG


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int:
    return int(TAG.match(tag).group(1))


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- reading checkpoint directories -----------------------------------------------------------

def tag_dirs(ckpt_dir: Path) -> list[Path]:
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted((p for p in Path(ckpt_dir).iterdir() if TAG.match(p.name) and p.is_dir()),
                  key=lambda p: step_of(p.name))


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint tag directories (a marker exists; not verified), oldest first."""
    return [p for p in tag_dirs(ckpt_dir) if (p / MARKER).is_file()]


def incomplete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Tag directories without a marker (a save in progress, failed or killed), oldest first."""
    return [p for p in tag_dirs(ckpt_dir) if not (p / MARKER).is_file()]


def read_meta(tag_dir: Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def read_best_list(ckpt_dir: Path) -> list[dict]:
    """The checkpoints best.json keeps (--keep-best K), best first; [] if there is none (or it is unreadable).
    Each is {"tag", "step", "val_loss"} (chosen by validation loss), or with --best-by {"tag", "step", "metric",
    "score", "higher_is_better"}. A best.json written before --keep-best (one checkpoint, no "kept" list)
    reads as a list of one."""
    try:
        best = json.loads((Path(ckpt_dir) / BEST).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(best, dict):
        return []
    kept = best.get("kept", [best])
    if not isinstance(kept, list):
        return []
    return [e for e in map(_entry, kept) if e is not None]


def _entry(b) -> dict | None:
    """A best.json entry as read (best.json or a marker's "best"), or None if it is not one."""
    if not isinstance(b, dict) or not isinstance(b.get("tag"), str):
        return None
    if isinstance(b.get("val_loss"), (int, float)):
        return {"tag": b["tag"], "step": b.get("step"), "val_loss": b["val_loss"]}
    if isinstance(b.get("score"), (int, float)) and isinstance(b.get("metric"), str):
        return {"tag": b["tag"], "step": b.get("step"), "metric": b["metric"], "score": b["score"],
                "higher_is_better": bool(b.get("higher_is_better"))}
    return None


def marked_best(ckpt_dir: Path) -> list[dict]:
    """The entries the complete checkpoints saved as one of the K best carry in their markers ("best", written
    with the checkpoint's completion), oldest first. best.json is rewritten after the marker, as a file of its
    own: a kill between the two leaves a best checkpoint that best.json does not name, which these restore
    (Checkpointer.sync_best)."""
    out = []
    for tag_dir in complete_checkpoints(ckpt_dir):
        try:
            entry = _entry(read_meta(tag_dir).get("best"))
        except (OSError, ValueError, AttributeError):
            continue
        if entry is not None and entry["tag"] == tag_dir.name:
            out.append(entry)
    return out


def read_best(ckpt_dir: Path) -> dict | None:
    """The best checkpoint of best.json (lowest validation loss, or best --best-by score), or None."""
    kept = read_best_list(ckpt_dir)
    return kept[0] if kept else None


def best_json(kept: list[dict]) -> dict:
    """best.json's content: the best one's tag, step and val_loss (or metric and score) at the top (what readers
    of the one-best format read), and "kept": every kept checkpoint, best first."""
    return {**kept[0], "kept": kept}


def best_entry(tag: str, step: int, value: float, by: tuple[str, bool] | None) -> dict:
    """A best.json entry: by validation loss (by None), or by (metric, higher is better)."""
    if by is None:
        return {"tag": tag, "step": step, "val_loss": value}
    return {"tag": tag, "step": step, "metric": by[0], "score": value, "higher_is_better": by[1]}


def best_rank(entry: dict) -> float:
    """Lower is better: the validation loss, or the score (negated where higher is better)."""
    if "val_loss" in entry:
        return entry["val_loss"]
    return -entry["score"] if entry["higher_is_better"] else entry["score"]


def same_criterion(entry: dict, by: tuple[str, bool] | None) -> bool:
    """Whether a kept entry was ranked as this run ranks (a resume may change --best-by: the others are dropped)."""
    return "val_loss" in entry if by is None else entry.get("metric") == by[0]


def rank_best(kept: list[dict], entry: dict, keep_best: int) -> list[dict]:
    """`kept` with `entry` in its place (a tag already there is replaced), the best `keep_best` (lowest
    `best_rank`), best first (ties: the earlier step first)."""
    merged = [b for b in kept if b["tag"] != entry["tag"]] + [entry]
    return sorted(merged, key=lambda b: (best_rank(b), b["step"]))[:keep_best]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_file(path: Path) -> dict:
    """{size, sha256} of a file just written, fsynced too: torch.save does not fsync, and a marker
    must not claim files that a node crash could still take back from the page cache."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
        return {"size": os.fstat(f.fileno()).st_size, "sha256": digest}


def hash_files(tag_dir: Path, skip=()) -> dict[str, dict]:
    """{relative path: {size, sha256}} for every file of a tag but the marker, our temp files and `skip`."""
    tag_dir = Path(tag_dir)
    files = {}
    for p in sorted(tag_dir.rglob("*")):
        rel = p.relative_to(tag_dir).as_posix()
        if p.is_file() and p.name != MARKER and not p.name.startswith(f".{MARKER}") and rel not in skip:
            files[rel] = hash_file(p)
    return files


def check_files(root: Path, files: dict) -> str | None:
    """None if every listed file is under `root` with its size and sha256; else the first problem."""
    root = Path(root)
    paths = {}
    for rel, want in sorted(files.items()):
        if not isinstance(want, dict) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"{MARKER}: bad entry {rel!r}"
        p = root / rel
        if not p.is_file():
            return f"file {rel} missing"
        size = p.stat().st_size
        if size != want.get("size"):  # sizes first: a truncated file is caught without reading anything
            return f"file {rel} has {size} bytes, {MARKER} says {want.get('size')}"
        paths[rel] = p
    # hashlib releases the GIL on large reads, so a few threads overlap I/O and hashing
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(paths)))) as pool:
        digests = dict(zip(paths, pool.map(file_sha256, paths.values())))
    for rel in paths:
        if digests[rel] != files[rel].get("sha256"):
            return f"file {rel} sha256 mismatch"
    return None


def verify(tag_dir: Path) -> str | None:
    """None if the checkpoint is complete and every file its marker lists matches; else the first
    problem, one line. A marker without `files` (written before they were recorded) is accepted."""
    try:
        meta = read_meta(tag_dir)
    except FileNotFoundError:
        return f"no {MARKER} (incomplete)"
    except (OSError, ValueError) as e:
        return f"{MARKER} unreadable ({one_line(e)})"
    if not isinstance(meta, dict):
        return f"{MARKER} is not a JSON object"
    files = meta.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{MARKER}: 'files' is not an object"
    return check_files(tag_dir, files)


def find_resume(ckpt_dir: Path, mirror_ckpt_dir: Path | None = None, say=print) -> Path | None:
    """The newest complete checkpoint that verifies, local or mirror; None if there is no complete one.

    Local and mirror tags are taken together, newest step first, the local copy first at equal
    steps: a fresh node with an empty disk resumes from the mirror (loaded from there, not copied
    back: DeepSpeed reads each file once either way), and a corrupted local tag falls back to its
    mirror copy before an older tag. Verifying reads every byte: call it on one rank and share the
    answer. Raises UsageError if complete checkpoints exist but none verifies.
    """
    found = [(step_of(p.name), 0, p) for p in complete_checkpoints(ckpt_dir)]
    if mirror_ckpt_dir is not None:
        found += [(step_of(p.name), 1, p) for p in complete_checkpoints(mirror_ckpt_dir)]
    found.sort(key=lambda f: (-f[0], f[1]))
    first = None
    for i, (_, _, path) in enumerate(found):
        problem = verify(path)
        if problem is None:
            return path
        first = first or f"{path}: {problem}"
        if i + 1 < len(found):
            say(f"checkpoint {path}: {problem}; falling back to {found[i + 1][2]}")
    if first is None:
        return None
    more = f" (nor do {len(found) - 1} older)" if len(found) > 1 else ""
    raise UsageError(f"no complete checkpoint verifies: {first}{more}")


# -- policy: rotation ----------------------------------------------------------------------------

def rotation_victims(complete: list[str], incomplete: list[str], keep_last: int,
                     protected: set[str] | frozenset = frozenset()) -> list[str]:
    """Tags to delete, oldest first.

    complete: tags with a marker; incomplete: tags without one; protected: the best tag and tags
    whose mirror copy is queued or running. Complete tags beyond the newest `keep_last` go (0 keeps
    all; the newest is always kept, so never the only one). An incomplete tag goes only when it is
    older than the newest complete one (a newer one may be a save in progress).
    """
    complete = sorted(complete, key=step_of)
    victims = complete[:-keep_last] if keep_last > 0 else []
    if complete:
        newest = step_of(complete[-1])
        victims += [t for t in incomplete if step_of(t) < newest]
    return sorted((t for t in victims if t not in protected), key=step_of)


def drop_tag(tag_dir: Path) -> None:
    """Delete a tag directory, marker first: an interrupted delete leaves an incomplete tag, never a
    'complete' one with files missing."""
    try:
        (Path(tag_dir) / MARKER).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(tag_dir, ignore_errors=True)


def check_mirror(mirror: Path, run_dir: Path, run_id: str) -> None:
    """--mirror must be storage apart from the run directory: refuse overlaps (UsageError)."""
    root, r = Path(mirror).resolve(), Path(run_dir).resolve()
    m = root / run_id / "checkpoints"
    if root == r or r in root.parents:
        raise UsageError(f"--mirror {mirror}: inside the run directory {run_dir} (a mirror must be separate storage)")
    if m == r or r in m.parents or m in r.parents:
        raise UsageError(f"--mirror {mirror}: its copies would go to {m}, which overlaps the run directory {run_dir}")
