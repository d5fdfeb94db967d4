"""Checkpoints: when to save, the save itself, completion, verification, rotation, the best
checkpoint, the mirror copy, and the lock on a run directory.

DeepSpeed's `engine.save_checkpoint` / `load_checkpoint` stay the engine; tags are `global_stepN`
under `RUN/checkpoints/`. Around them:

- **Completion.** A tag is complete only once `zerotrain.json` exists in it. Rank 0 writes it
  (tmp + os.replace) after every rank has written its files: the caller's meta (step, tokens, world
  size ...; read before anything is unpickled) plus `files`, each file's size and sha256. Hashing
  runs on a background thread on every rank, each rank hashing the files it wrote (so a 32-rank
  checkpoint is hashed 32 ways at once: the marker of a final save must fit in the launcher's 30 s
  grace after SIGTERM); the hashes meet on rank 0 over a gloo group of their own. The loop only
  waits for DeepSpeed's own writes.
  DeepSpeed's `latest` file is written before the other ranks finish, so it is never read here; we
  write it ourselves once a marker exists (DeepSpeed's zero_to_fp32.py defaults to it).
- **Resume.** `find_resume` takes the newest complete checkpoint whose files verify, falling back
  to older ones (saying so), the local directory and the mirror together. Markers written before
  `files` existed are accepted as complete.
- **Failure.** A write that fails on any rank fails that save on every rank (`CheckpointError`),
  with no rank left waiting in a collective; the half-written tag is removed, older ones untouched.
- **Rotation** (`keep_last`), **best.json** (`mark_best`), **mirror** (a background copy to other
  storage, verified, renamed into place) and **RunLock** (one live process per run directory).

Not here: what goes into client_state and meta (the Trainer's), and sharing `hours_due` between
ranks (rank 0 decides, the Trainer broadcasts).

Test-only hooks (environment): ZEROTRAIN_TEST_FAIL_SAVE=RANK:STEP[,RANK:STEP] makes that rank's
first write of that save half-write a file and raise OSError(ENOSPC); ZEROTRAIN_TEST_SLOW_SAVE=S
sleeps S seconds inside every save after each rank's first file (a half-written tag on disk);
ZEROTRAIN_TEST_SLOW_MARKER=S delays each marker by S s; ZEROTRAIN_TEST_SLOW_MIRROR=S each mirror copy.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.errors import CheckpointError, UsageError  # noqa: F401  (CheckpointError re-exported)

MARKER = "zerotrain.json"
TAG = re.compile(r"^global_step(\d+)$")
BEST = "best.json"
LOCK = "zerotrain.lock"
PARTIAL = ".partial"  # suffix of a mirror copy in progress: never matches TAG


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int:
    return int(TAG.match(tag).group(1))


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- reading checkpoint directories -----------------------------------------------------------

def _tags(ckpt_dir: Path) -> list[Path]:
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted((p for p in Path(ckpt_dir).iterdir() if TAG.match(p.name) and p.is_dir()),
                  key=lambda p: step_of(p.name))


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint tag directories (a marker exists; not verified), oldest first."""
    return [p for p in _tags(ckpt_dir) if (p / MARKER).is_file()]


def incomplete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Tag directories without a marker (a save in progress, failed or killed), oldest first."""
    return [p for p in _tags(ckpt_dir) if not (p / MARKER).is_file()]


def read_meta(tag_dir: Path) -> dict:
    return json.loads((Path(tag_dir) / MARKER).read_text())


def read_best(ckpt_dir: Path) -> dict | None:
    """checkpoints/best.json ({"tag", "step", "val_loss"}), or None if there is none (or it is unreadable)."""
    try:
        best = json.loads((Path(ckpt_dir) / BEST).read_text())
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("tag"), str) else None


def write_json_atomic(path: Path, obj: dict) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# -- the write guard around DeepSpeed's checkpoint engine ---------------------------------------

def _hook(name: str) -> str:
    return os.environ.get(f"ZEROTRAIN_TEST_{name}", "")


def _sleep_hook(name: str) -> None:
    seconds = _hook(name)
    if seconds:
        time.sleep(float(seconds))


def _free_space(path: str) -> str:
    try:
        return f" ({shutil.disk_usage(os.path.dirname(path)).free / 2**20:,.0f} MiB free there)"
    except OSError:
        return ""


@contextlib.contextmanager
def _no_zip_crc32():
    """torch.save without the zip format's CRC-32 of every record. Measured here (benchmarks/RESULTS.md,
    `checkpoint`): the CRC was most of a save's time (114M model, ZeRO-2, 1.7 GB: 2.0 s -> 0.5-0.9 s),
    and the marker's sha256 of every file, checked before any resume, already catches what it would.
    torch.load reads these files as any other. Process-wide in torch, so restored afterwards."""
    import torch.serialization as ts

    if not hasattr(ts, "set_crc32_options"):  # torch < 2.6: always computed
        yield
        return
    before = ts.get_crc32_options()
    ts.set_crc32_options(False)
    try:
        yield
    finally:
        ts.set_crc32_options(before)


class _WriteGuard:
    """Stands in for `engine.checkpoint_engine` and records a failed write instead of raising it.

    DeepSpeed 0.19's save_checkpoint runs collectives between its writes: a barrier after rank 0's
    makedirs, two all_reduces validating the tag, a final barrier. A rank that raised out of it (a
    full disk on one node) would leave the others in a barrier forever. So every write through the
    engine (torch.save of model and optimizer states, makedirs) and rank 0's copy of the recovery
    scripts is caught; DeepSpeed runs its collectives to the end on every rank, and the Checkpointer
    then agrees on the outcome with one all_gather. Outside a save it passes everything through.
    """

    def __init__(self, inner, rank: int):
        self.inner, self.rank = inner, rank
        self.active = False
        self.error: str | None = None
        self.written: list[str] = []

    @classmethod
    def install(cls, engine, rank: int) -> "_WriteGuard":
        inner = engine.checkpoint_engine
        if isinstance(inner, cls):
            return inner
        if inner.is_decoupled():  # files would still be in flight when save_checkpoint returns
            raise UsageError(f"checkpoint engine {inner.name}: decoupled (asynchronous) engines are not supported")
        guard = cls(inner, rank)
        ds_compat.route_checkpoint_writes(engine, guard)  # and rank 0's copy of zero_to_fp32.py inside the save
        return guard

    def begin(self, step: int) -> None:
        self.active, self.error, self.written, self.step = True, None, [], step
        fails = {tuple(map(int, s.split(":"))) for s in _hook("FAIL_SAVE").split(",") if s}
        self.inject_failure = (self.rank, step) in fails

    def end(self) -> None:
        self.active = False

    def run(self, fn, *args, where: str | None = None, **kwargs):
        if not self.active:
            return fn(*args, **kwargs)
        if self.error:  # the disk already failed: do not spend time writing the rest
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - torch.save reports a full disk as a RuntimeError
            self.error = one_line(e)
            if where:  # torch.save's message names neither the file nor the cause: add both hints
                named = self.error if where in self.error else f"writing {where}: {self.error}"
                self.error = named + _free_space(where)
            return None

    def save(self, state_dict, path: str):
        def write():
            if self.inject_failure:
                self.inject_failure = False
                with open(path, "wb") as f:
                    f.write(b"half a file")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (ZEROTRAIN_TEST_FAIL_SAVE)", path)
            with _no_zip_crc32():
                self.inner.save(state_dict, path)
            self.written.append(path)
            if len(self.written) == 1:
                _sleep_hook("SLOW_SAVE")
        return self.run(write, where=path)

    def makedirs(self, path, exist_ok=False):
        return self.run(self.inner.makedirs, path, exist_ok=exist_ok)

    def __getattr__(self, name):  # load, create, commit, is_decoupled, ...: DeepSpeed's own
        return getattr(self.inner, name)


# -- background work on rank 0 ------------------------------------------------------------------

class _Worker:
    """One daemon thread running jobs in order. A job reports its own errors; a killed process
    leaves at worst an incomplete tag or a `.partial` mirror copy, both ignored and cleaned later."""

    def __init__(self, name: str, say):
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._say = say
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        with self._cv:
            self._pending += 1
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - last resort: the thread must survive
                self._say(f"warning: {self._thread.name}: {one_line(e)}")
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


# -- the Checkpointer -----------------------------------------------------------------------------

class Checkpointer:
    """When to save, the (collective) save, completion, rotation, best.json and the mirror.

    Every rank builds one with the same arguments (the constructor is collective when world > 1);
    `save` is collective; everything after the files are written runs on background threads:
    hashing on every rank, then marker, rotation and mirror on rank 0.

        ckpt = Checkpointer(run_dir / "checkpoints", run_id, rank, world, save_every_steps=500,
                            save_every_hours=4, keep_last=3, mirror="/nfs/ckpt", say=say)
        hours = ckpt.hours_due()            # rank 0's answer; broadcast it
        if ckpt.due(step, hours, last_step=step == max_steps):
            ckpt.save(engine, step, client_state, meta)
        ...
        ckpt.close()                        # waits for the marker and the mirror copies
    """

    def __init__(self, ckpt_dir: Path, run_id: str, rank: int, world: int, save_every_steps: int = 0,
                 save_every_hours: float | None = None, keep_last: int = 0, mirror: Path | str | None = None,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.time):
        for flag, value in (("--save-every-steps", save_every_steps), ("--keep-last", keep_last)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{flag}: must be an integer >= 0, got {value!r}")
        hours = save_every_hours
        if hours is not None and (isinstance(hours, bool) or not isinstance(hours, (int, float)) or not hours > 0):
            raise UsageError(f"--save-every-hours: must be a positive number, got {hours!r}")
        self.ckpt_dir, self.run_id, self.rank, self.world = Path(ckpt_dir), run_id, rank, world
        self.save_every_steps, self.save_every_hours, self.keep_last = save_every_steps, save_every_hours, keep_last
        self.say, self.clock = say, clock
        self.mirror_dir = Path(mirror) / run_id / "checkpoints" if mirror else None
        self.last_saved_step: int | None = None
        self._last_saved_dir: Path | None = None
        self.last_blocked_s: float | None = None  # how long the last save() held the caller
        self._last_save_time = clock()
        self._lock = threading.Lock()  # rotation, and the tags being written or mirrored
        self._writing: str | None = None
        self._mirroring: set[str] = set()
        self._errors: list[str] = []  # this rank's failed completions, reported to all at the next save
        self._finalize_hold: threading.Event | None = None  # tests: hold a completion back
        self._mirror_hold: threading.Event | None = None  # tests: hold a mirror copy back
        self._group = None
        if world > 1:
            import torch.distributed as dist

            # The background threads exchange hashes on a gloo group of their own, so they never
            # interleave with the loop's collectives on the main (NCCL) group. Collective: every rank
            # builds its Checkpointer at the same point.
            self._group = dist.new_group(backend="gloo")
        self._finalizer = _Worker("zerotrain-checkpoint", say)
        self._mirror = None
        if rank != 0:
            return
        if self.mirror_dir is not None:
            try:
                self.mirror_dir.mkdir(parents=True, exist_ok=True)
                probe = self.mirror_dir / f".probe-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as e:
                self._warn(f"--mirror {mirror}: not writable ({one_line(e)}); training goes on without a mirror")
            else:
                self._mirror = _Worker("zerotrain-mirror", say)

    # -- when ------------------------------------------------------------------------------------
    def hours_due(self, now: float | None = None) -> bool:
        """--save-every-hours elapsed since the last save (or since start)? `now` on the `clock` (wall
        clock, time.time() by default). Rank 0 asks, then broadcasts."""
        if not self.save_every_hours:
            return False
        now = self.clock() if now is None else now
        return now - self._last_save_time >= self.save_every_hours * 3600

    def due(self, step: int, hours_flag: bool = False, last_step: bool = False) -> bool:
        """Save at this step? At the last step always, then every N steps or when hours_flag (whichever
        comes first: any save restarts the clock); never twice for one step."""
        if step == self.last_saved_step:
            return False
        return (last_step or hours_flag
                or bool(self.save_every_steps and step % self.save_every_steps == 0))

    def note_loaded(self, step: int) -> None:
        """The engine now holds checkpoint `step` (a resume or a rollback): a save of that step is
        not due, and a later save of a step saved before the rollback writes it anew."""
        self.last_saved_step = step
        self._last_saved_dir = self.ckpt_dir / tag_for(step)
        self._last_save_time = self.clock()

    def discard_after(self, step: int) -> list[str]:
        """Rank 0: delete the tags newer than `step`, here and in the mirror: a timeline given up by
        a rollback or by --resume of an older tag, which a later `find_resume` (newest first) must
        not pick. best.json goes too if it names one of them. Waits for pending background work.
        Returns the deleted tags (other ranks: [])."""
        if self.rank != 0:
            return []
        self.wait()
        victims = []
        with self._lock:
            for d in (self.ckpt_dir, self.mirror_dir if self._mirror is not None else None):
                if d is None:
                    continue
                best = read_best(d)
                for p in _tags(d):
                    if step_of(p.name) > step:
                        drop_tag(p)
                        victims.append(p.name)
                        if best and best["tag"] == p.name:
                            (d / BEST).unlink(missing_ok=True)
        victims = sorted(set(victims), key=step_of)
        if victims:
            self.say(f"removed checkpoints newer than step {step} (a timeline given up): {', '.join(victims)}")
        return victims

    # -- the save (collective) -----------------------------------------------------------------
    def save(self, engine, step: int, client_state: dict, meta: dict) -> Path:
        """Write tag global_stepN on every rank; returns its path once every rank's files are written.

        The tag becomes complete once the ranks' background threads have hashed their files and
        rank 0 has written the marker (`wait()` waits for that). If a write failed on any rank, or an
        earlier completion failed, raises CheckpointError on every rank; the failed tag is removed,
        older ones are untouched.
        """
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        if step == self.last_saved_step:
            return tag_dir
        t0 = time.perf_counter()
        guard = _WriteGuard.install(engine, self.rank)
        if self.rank == 0:
            with self._lock:
                self._writing = tag
            if tag_dir.exists():  # left by a failed save or an abandoned timeline: never mix its files with ours
                drop_tag(tag_dir)
        guard.begin(step)
        error = None
        try:
            engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
        except Exception as e:  # noqa: BLE001 - outside the guarded writes; other ranks may be in a collective
            error = one_line(e)
        finally:
            guard.end()
        error = error or guard.error
        written = sorted({Path(p).relative_to(tag_dir).as_posix() for p in guard.written
                          if Path(p).is_relative_to(tag_dir)})
        earlier = self._errors.pop(0) if self._errors else None
        outcome = self._all_gather((error, written, earlier))
        if self.rank == 0:
            with self._lock:
                self._writing = None
        failed = [(r, e) for r, (e, _, _) in enumerate(outcome) if e]
        before = next((x for _, _, x in outcome if x), None)
        if failed or before:
            if self.rank == 0:
                drop_tag(tag_dir)
            if before:
                raise CheckpointError(f"an earlier checkpoint could not be completed: {before}")
            r, e = failed[0]
            raise CheckpointError(f"checkpoint {tag_dir} failed on rank {r}: {e}; it was removed, "
                                  + self._previous())
        self.last_saved_step = step
        self._last_saved_dir = tag_dir
        self._last_save_time = self.clock()
        self._finalizer.submit(self._finalize, tag_dir, dict(meta), written)
        self.last_blocked_s = time.perf_counter() - t0
        return tag_dir

    def _previous(self) -> str:
        """The checkpoint a restart would use, as far as every rank can tell without waiting: the last
        one this Checkpointer saved (its marker may still be in progress), else the newest on disk."""
        done = complete_checkpoints(self.ckpt_dir)
        previous = self._last_saved_dir or (done[-1] if done else None)
        return f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"

    def _all_gather(self, mine) -> list:
        """On the main group: the gloo group belongs to the background threads, and two threads
        issuing collectives on one group could pair them up differently on different ranks."""
        if self.world == 1:
            return [mine]
        import torch.distributed as dist

        every = [None] * self.world
        dist.all_gather_object(every, mine)
        return every

    # -- completion (every rank), rotation and mirror (rank 0): background threads -------------
    def _finalize(self, tag_dir: Path, meta: dict, written: list[str]) -> None:
        """Every rank: hash the files it wrote; rank 0: merge, write the marker, rotate, mirror."""
        try:
            if self.rank == 0:
                if self._finalize_hold is not None:
                    self._finalize_hold.wait()
                _sleep_hook("SLOW_MARKER")
            error, mine = None, {}
            try:
                mine = {rel: hash_file(tag_dir / rel) for rel in written}
            except Exception as e:  # noqa: BLE001 - still take part in the exchange below
                error = one_line(e)
            every = [(error, mine)]
            if self._group is not None:
                import torch.distributed as dist

                every = [None] * self.world
                dist.all_gather_object(every, (error, mine), group=self._group)
            bad = next(((r, e) for r, (e, _) in enumerate(every) if e), None)
            if bad:
                raise CheckpointError(f"rank {bad[0]} could not hash its files: {bad[1]}")
            if self.rank != 0:
                return
            files = {rel: h for _, hashes in every for rel, h in hashes.items()}
            for rel, h in files.items():
                p = tag_dir / rel
                if not p.is_file() or p.stat().st_size != h["size"]:
                    raise CheckpointError(f"rank 0 does not see {rel} as another rank wrote it: the checkpoint"
                                          " directory must be storage shared by all nodes")
            files.update(hash_files(tag_dir, skip=files))  # anything written outside the engine's save
            write_json_atomic(tag_dir / MARKER, {**meta, "files": dict(sorted(files.items()))})
            latest = self.ckpt_dir / "latest"  # for DeepSpeed's zero_to_fp32.py; never read by us
            tmp = latest.with_name(f".latest.tmp-{os.getpid()}")
            tmp.write_text(tag_dir.name)
            os.replace(tmp, latest)
        except Exception as e:  # noqa: BLE001 - reported to every rank at the next save
            self._errors.append(f"{tag_dir.name}: {one_line(e)}")
            self._warn(f"checkpoint {tag_dir} not completed: {one_line(e)}")
            return
        if self._mirror is not None:
            with self._lock:
                self._mirroring.add(tag_dir.name)
            self._mirror.submit(self._mirror_tag, tag_dir.name)
        self._rotate(self.ckpt_dir)

    def _rotate(self, ckpt_dir: Path) -> None:
        if self.keep_last == 0 and not incomplete_checkpoints(ckpt_dir):
            return
        with self._lock:
            best = read_best(self.ckpt_dir)
            protected = set(self._mirroring) | ({best["tag"]} if best else set())
            if self._writing:
                protected.add(self._writing)
            complete = [p.name for p in complete_checkpoints(ckpt_dir)]
            incomplete = [p.name for p in incomplete_checkpoints(ckpt_dir)]
            victims = rotation_victims(complete, incomplete, self.keep_last, protected)
            for tag in victims:
                drop_tag(ckpt_dir / tag)
        if victims:
            self.say(f"checkpoint rotation (--keep-last {self.keep_last}): removed {', '.join(victims)}"
                     f" from {ckpt_dir}")

    def _mirror_tag(self, tag: str) -> None:
        tmp = self.mirror_dir / f".{tag}{PARTIAL}"
        try:
            if self._mirror_hold is not None:
                self._mirror_hold.wait()
            _sleep_hook("SLOW_MIRROR")
            src = self.ckpt_dir / tag
            files = read_meta(src)["files"]
            self.mirror_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.mirror_dir.glob(f".global_step*{PARTIAL}"):  # copies cut short by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            for rel in files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, tmp / rel)
            problem = check_files(tmp, files)  # read back from the mirror: what a resume would read
            if problem:
                raise CheckpointError(f"the copy does not verify: {problem}")
            shutil.copyfile(src / MARKER, tmp / MARKER)  # last: a copy counts only with its marker
            final = self.mirror_dir / tag
            if final.exists():
                drop_tag(final)
            os.rename(tmp, final)
            _fsync_dir(self.mirror_dir)
        except Exception as e:  # noqa: BLE001 - the mirror is best effort: warn, train on
            shutil.rmtree(tmp, ignore_errors=True)
            self._warn(f"--mirror {self.mirror_dir}: copy of {tag} failed ({one_line(e)}); training goes on")
        finally:
            with self._lock:
                self._mirroring.discard(tag)
        self._rotate(self.mirror_dir)
        self._rotate(self.ckpt_dir)  # the tag just copied is no longer protected here

    # -- best ----------------------------------------------------------------------------------
    def mark_best(self, tag: str, step: int, val_loss: float) -> None:
        """Name `tag` in checkpoints/best.json (and the mirror's); rank 0, after the tag's marker."""
        if self.rank == 0:
            self._finalizer.submit(self._write_best, {"tag": tag, "step": step, "val_loss": val_loss})

    def _write_best(self, best: dict) -> None:
        if not (self.ckpt_dir / best["tag"] / MARKER).is_file():
            self._warn(f"best.json not updated: {best['tag']} is not a complete checkpoint")
            return
        write_json_atomic(self.ckpt_dir / BEST, best)
        if self._mirror is not None:
            self._mirror.submit(self._mirror_best, best)

    def _mirror_best(self, best: dict) -> None:
        try:
            write_json_atomic(self.mirror_dir / BEST, best)
        except OSError as e:
            self._warn(f"--mirror {self.mirror_dir}: best.json not written ({one_line(e)})")

    # -- end -------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, mirror: bool = True) -> bool:
        """Wait for this rank's background work: its hashing and, on rank 0, the markers (and mirror
        copies unless mirror=False). False on timeout. Raises CheckpointError (on the rank that saw
        it) if a checkpoint could not be completed. Call it on every rank."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        done = self._finalizer.join(left())
        if done and mirror and self._mirror is not None:
            done = self._mirror.join(left())
        if self._errors:
            raise CheckpointError(f"checkpoint not completed: {self._errors.pop(0)}")
        return done

    def close(self) -> None:
        """wait(), then stop the background threads."""
        try:
            self.wait()
        finally:
            for worker in (self._finalizer, self._mirror):
                if worker is not None:
                    worker.close()

    def _warn(self, message: str) -> None:
        self.say(f"warning: {message}")


# -- the run directory lock -------------------------------------------------------------------------

def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:  # a killed rank whose parent died too stays a zombie where PID 1 does not reap (containers)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RunLock:
    """RUN_DIR/zerotrain.lock: one live process per run directory.

    The lock holds host, pid, the pid's start time and the start time, as JSON. On this host, a
    lock whose process is gone (or whose pid now belongs to another process) is stale and taken
    over, saying so. A lock from another host cannot be checked that way, so the holder refreshes
    the file's mtime every `heartbeat_s` and another host's lock is taken over only once its mtime
    is `stale_after_s` old (default 15 minutes: a dead node's run can be restarted elsewhere after
    that, or at once by deleting the file; clock skew between hosts of a few minutes is harmless).
    Take it on rank 0 only (the pid is that process's).
    """

    def __init__(self, run_dir: Path, say=print, stale_after_s: float = 900.0, heartbeat_s: float = 60.0):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK
        self.say, self.stale_after_s, self.heartbeat_s = say, stale_after_s, heartbeat_s
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "RunLock":
        """Take the lock; UsageError (one line naming host and pid) if a live process holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LOCK}.{self.mine['host']}.{os.getpid()}")
        tmp.write_text(json.dumps(self.mine) + "\n")
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)  # atomic create-if-absent, with the content already in place
                    break
                except FileExistsError:
                    pass
                holder, age = self._holder()
                if holder is None and age is None:
                    continue  # released between our attempts: try again
                why = self._stale(holder, age)
                if why is None:
                    seen = "" if holder.get("host") == self.mine["host"] else f", heartbeat {age / 60:.0f} min ago"
                    raise UsageError(f"run directory {self.run_dir} is in use by pid {holder.get('pid')} on host"
                                     f" {holder.get('host')} (since {holder.get('started')}{seen}); wait for it to"
                                     f" end, pick another --run-id, or delete {self.path} if that run is dead")
                self.say(f"taking over the lock of {self.run_dir} from pid {(holder or {}).get('pid')} on host"
                         f" {(holder or {}).get('host')}: {why}")
                os.replace(tmp, self.path)
                tmp = None
                break
            else:
                raise UsageError(f"run directory {self.run_dir}: could not take {self.path} (it keeps changing)")
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        if self._holder()[0] != self.mine:  # two takers of one stale lock: the one whose file stayed wins
            raise UsageError(f"run directory {self.run_dir}: another process took {self.path} at the same time")
        self._thread = threading.Thread(target=self._heartbeat, name="zerotrain-lock", daemon=True)
        self._thread.start()
        return self

    def _holder(self) -> tuple[dict | None, float | None]:
        """(the lock's JSON or None if unreadable, its age in seconds); (None, None) if there is none."""
        try:
            age = time.time() - self.path.stat().st_mtime
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, age
        return (holder if isinstance(holder, dict) else None), age

    def _stale(self, holder: dict | None, age: float) -> str | None:
        """Why the lock is stale, or None if its holder may be alive."""
        if holder is None:
            return "the lock file is unreadable"
        if holder.get("host") == self.mine["host"]:
            pid = holder.get("pid")
            if not isinstance(pid, int) or not _pid_alive(pid):
                return "that process is gone"
            if holder.get("pid_start") and holder.get("pid_start") != _pid_start(pid):
                return "that pid now belongs to another process"
            return None
        if age > self.stale_after_s:
            return f"no heartbeat for {age / 60:.0f} min"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._holder()[0] == self.mine:
            self.path.unlink(missing_ok=True)


# -- the pre-Checkpointer entries (launcher/train.py, launcher/commands/export.py) -------------------------

_legacy: dict[str, Checkpointer] = {}


def save(engine, ckpt_dir: Path, step: int, client_state: dict, meta: dict) -> Path:
    """The pre-Checkpointer entry (launcher/train.py): returns once this rank's part is complete
    (on rank 0: once the marker is written). One Checkpointer per directory: its constructor is
    collective and makes a process group."""
    import torch.distributed as dist

    if str(ckpt_dir) not in _legacy:
        rank = dist.get_rank()
        _legacy[str(ckpt_dir)] = Checkpointer(ckpt_dir, meta.get("run_id", ""), rank, dist.get_world_size(),
                                              say=(lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None))
    ckpt = _legacy[str(ckpt_dir)]
    tag_dir = ckpt.save(engine, step, client_state, meta)
    ckpt.wait()
    return tag_dir


def load(engine, tag_dir: Path) -> dict:
    """Load a complete checkpoint into the engine; returns the client_state."""
    path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    return client_state
