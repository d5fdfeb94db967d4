"""The Checkpointer: when to save, the (collective) save itself, its completion on background threads,
rotation, best.json and the mirror copy. The format it writes and verifies is components/checkpoints/checkpoint.py.

- **The save.** DeepSpeed's `engine.save_checkpoint` writes the files; `_WriteGuard` stands in for the
  engine's checkpoint engine so that a failed write on any rank fails that save on every rank
  (`CheckpointError`), with no rank left waiting in a collective; the half-written tag is removed,
  older ones untouched.
- **Completion.** Rank 0 writes the marker (zerotrain.durable) after every rank has written its
  files. Hashing runs on a background thread on every rank, each rank hashing the files it wrote (so
  a 32-rank checkpoint is hashed 32 ways at once: the marker of a final save must fit in the
  launcher's 30 s grace after SIGTERM); the hashes meet on rank 0 over a gloo group of their own. The
  loop only waits for DeepSpeed's own writes.
- **Rotation** (`keep_last`), **the K best** (`keep_best`: `would_keep`, `mark_best`, best.json; rotation never
  removes them), **mirror** (a background copy to other
  storage, verified, renamed into place).

Not here: what goes into client_state and meta (the Trainer's), and sharing `hours_due` between
ranks (rank 0 decides, the Trainer broadcasts). Test faults (failed and slow saves, slow
mirror copies) are components/hooks.py's FaultyCheckpointer, built in place of this one only when a test asks.
"""
from __future__ import annotations

import contextlib
import math
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.serialization as ts

from zerotrain import durable
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.checkpoints.checkpoint import (BEST, MARKER, PARTIAL, check_files, complete_checkpoints,
                                                      drop_tag, hash_file, hash_files, incomplete_checkpoints,
                                                      best_entry, best_json, best_rank, one_line, rank_best,
                                                      marked_best, read_best_list, same_criterion, read_meta,
                                                      rotation_victims, step_of, tag_dirs, tag_for)
from zerotrain.launcher.errors import CheckpointError, UsageError


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
        self.writer = inner  # what a save's files are written through (begin)
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

    def begin(self, step: int, writer) -> None:
        """A save of `step` starts; its files are written through `writer` (Checkpointer.writer)."""
        self.active, self.error, self.written, self.step, self.writer = True, None, [], step, writer

    def end(self) -> None:
        self.active, self.writer = False, self.inner

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
            with _no_zip_crc32():
                self.writer.save(state_dict, path)
            self.written.append(path)
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
                 save_every_hours: float | None = None, keep_last: int = 0, keep_best: int = 1,
                 mirror: Path | str | None = None, say: Callable[[str], None] = print, clock: Callable[[], float] = time.time,
                 best_by: tuple[str, bool] | None = None):
        """best_by: (metric, higher is better) when --best-by ranks the K best; None: the validation loss."""
        for flag, value in (("--save-every-steps", save_every_steps), ("--keep-last", keep_last)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{flag}: must be an integer >= 0, got {value!r}")
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 1:
            raise UsageError(f"--keep-best: must be an integer >= 1, got {keep_best!r}")
        hours = save_every_hours
        if hours is not None and (isinstance(hours, bool) or not isinstance(hours, (int, float)) or not hours > 0):
            raise UsageError(f"--save-every-hours: must be a positive number, got {hours!r}")
        self.ckpt_dir, self.run_id, self.rank, self.world = Path(ckpt_dir), run_id, rank, world
        self.save_every_steps, self.save_every_hours, self.keep_last = save_every_steps, save_every_hours, keep_last
        self.keep_best, self.best_by = keep_best, best_by
        self.kept: list[dict] = []  # the K best, best first: the same on every rank (sync_best)
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
                dropped = set()
                for p in tag_dirs(d):
                    if step_of(p.name) > step:
                        drop_tag(p)
                        dropped.add(p.name)
                kept = read_best_list(d)
                if any(b["tag"] in dropped for b in kept):
                    kept = [b for b in kept if b["tag"] not in dropped]
                    if kept:
                        durable.write_json(d / BEST, best_json(kept))
                    else:
                        (d / BEST).unlink(missing_ok=True)
                victims += dropped
            self.kept = [b for b in self.kept if step_of(b["tag"]) <= step]
        victims = sorted(set(victims), key=step_of)
        if victims:
            self.say(f"removed checkpoints newer than step {step} (a timeline given up): {', '.join(victims)}")
        return victims

    # -- the save (collective) -----------------------------------------------------------------
    def writer(self, inner, step: int):
        """What the save of `step` writes its files through: DeepSpeed's checkpoint engine `inner` (components/hooks.py's
        FaultyCheckpointer plants failed and slow writes here)."""
        return inner

    def save(self, engine, step: int, client_state: dict, meta: dict, best_value: float | None = None) -> Path:
        """Write tag global_stepN on every rank; returns its path once every rank's files are written.
        `best_value`: the step is saved as one of the K best (mark_best follows); its entry goes into the marker.

        The tag becomes complete once the ranks' background threads have hashed their files and
        rank 0 has written the marker (`wait()` waits for that). If a write failed on any rank, or an
        earlier completion failed, raises CheckpointError on every rank; the failed tag is removed,
        older ones are untouched.
        """
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        if step == self.last_saved_step:
            return tag_dir
        if best_value is not None:
            meta = {**meta, "best": best_entry(tag, step, best_value, self.best_by)}
        t0 = time.perf_counter()
        guard = _WriteGuard.install(engine, self.rank)
        if self.rank == 0:
            with self._lock:
                self._writing = tag
            if tag_dir.exists():  # left by a failed save or an abandoned timeline: never mix its files with ours
                drop_tag(tag_dir)
        guard.begin(step, self.writer(guard.inner, step))
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
            error, mine = None, {}
            try:
                mine = {rel: hash_file(tag_dir / rel) for rel in written}
            except Exception as e:  # noqa: BLE001 - still take part in the exchange below
                error = one_line(e)
            every = [(error, mine)]
            if self._group is not None:
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
            durable.write_json(tag_dir / MARKER, {**meta, "files": dict(sorted(files.items()))})
            durable.write_text(self.ckpt_dir / "latest", tag_dir.name)  # for DeepSpeed's zero_to_fp32.py; never read by us
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
            protected = set(self._mirroring) | {b["tag"] for b in self.kept}
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
            src = self.ckpt_dir / tag
            files = read_meta(src)["files"]
            self.mirror_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.mirror_dir.glob(f".global_step*{PARTIAL}"):  # copies cut short by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            for rel in files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, tmp / rel)
                with open(tmp / rel, "rb") as f:  # on the mirror's disk before its marker claims it
                    os.fsync(f.fileno())
            problem = check_files(tmp, files)  # read back from the mirror: what a resume would read
            if problem:
                raise CheckpointError(f"the copy does not verify: {problem}")
            durable.write_json(tmp / MARKER, read_meta(src))  # last: a copy counts only with its marker
            final = self.mirror_dir / tag
            if final.exists():
                drop_tag(final)
            os.rename(tmp, final)
            durable.fsync_dir(self.mirror_dir)
        except Exception as e:  # noqa: BLE001 - the mirror is best effort: warn, train on
            shutil.rmtree(tmp, ignore_errors=True)
            self._warn(f"--mirror {self.mirror_dir}: copy of {tag} failed ({one_line(e)}); training goes on")
        finally:
            with self._lock:
                self._mirroring.discard(tag)
        self._rotate(self.mirror_dir)
        self._rotate(self.ckpt_dir)  # the tag just copied is no longer protected here

    # -- the K best ----------------------------------------------------------------------------
    def sync_best(self) -> list[dict]:
        """Collective: every rank takes rank 0's best.json (at start, after a resume or a rollback), trimmed
        to --keep-best (a resume may lower it; the file follows at the next mark_best). A complete checkpoint
        saved as one of the best that best.json does not name (a kill landed between its marker and best.json's
        rewrite) is ranked in again from its marker, and rank 0 rewrites best.json with it."""
        kept = self._healed_best() if self.rank == 0 else None
        if self.world > 1:
            box = [kept]
            dist.broadcast_object_list(box, src=0)
            kept = box[0]
        with self._lock:  # ranked as this run ranks (a resume may change --best-by)
            self.kept = [b for b in kept if same_criterion(b, self.best_by)][:self.keep_best]
        return self.kept

    def _healed_best(self) -> list[dict]:
        """Rank 0: best.json's list with the markers' best entries it lacks ranked in (the K best of all)."""
        listed = read_best_list(self.ckpt_dir)
        missing = [e for e in marked_best(self.ckpt_dir) if all(b["tag"] != e["tag"] for b in listed)
                   and same_criterion(e, self.best_by)]
        if not missing:
            return listed
        kept = [b for b in listed if same_criterion(b, self.best_by)]
        for entry in missing:
            kept = rank_best(kept, entry, self.keep_best)
        added = [b["tag"] for b in kept if b in missing]
        if added:
            self.say(f"best.json: {', '.join(added)} ranked in again from its checkpoint (best.json had not been"
                     " rewritten when the run stopped)")
            durable.write_json(self.ckpt_dir / BEST, best_json(kept))
        return kept

    def would_keep(self, value: float) -> bool:
        """Would a checkpoint with this validation loss (or --best-by score) be among the K best? (every rank
        answers alike)"""
        if not math.isfinite(value):
            return False
        rank = best_rank(best_entry("", 0, value, self.best_by))
        return len(self.kept) < self.keep_best or rank < best_rank(self.kept[self.keep_best - 1])

    def mark_best(self, tag: str, step: int, value: float) -> None:
        """Every rank: `tag` takes its place among the K best, and the one it pushes out may be rotated away;
        rank 0 rewrites checkpoints/best.json (and the mirror's) after the tag's marker."""
        with self._lock:
            self.kept = rank_best(self.kept, best_entry(tag, step, value, self.best_by), self.keep_best)
            kept = list(self.kept)
        if self.rank == 0:
            self._finalizer.submit(self._write_best, tag, kept)

    def _write_best(self, tag: str, kept: list[dict]) -> None:
        if not (self.ckpt_dir / tag / MARKER).is_file():
            self._warn(f"best.json not updated: {tag} is not a complete checkpoint")
            return
        best = best_json(kept)
        durable.write_json(self.ckpt_dir / BEST, best)
        if self._mirror is not None:
            self._mirror.submit(self._mirror_best, best)

    def _mirror_best(self, best: dict) -> None:
        try:
            durable.write_json(self.mirror_dir / BEST, best)
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


def load(engine, tag_dir: Path) -> dict:
    """Load a complete checkpoint into the engine; returns the client_state. With the optimizer swapped to NVMe
    DeepSpeed's load skips the optimizer's own state (Adam's step count and moments, the learning rates): restored
    from the checkpoint's ZeRO file (ds_compat.restore_swapped_optimizer_state); with CPU Adam its bias
    correction is continued as the uninterrupted run's (ds_compat.continue_cpu_adam_bias_correction)."""
    path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    ds_compat.restore_swapped_optimizer_state(engine, tag_dir)
    # ZeRO-Offload's CPU Adam restarts its bias-correction terms another way than it keeps them (a last-bit
    # difference in every later update): brought to the uninterrupted run's
    ds_compat.continue_cpu_adam_bias_correction(getattr(engine.optimizer, "optimizer", None))
    return client_state
