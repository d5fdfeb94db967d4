"""launcher/components/checkpoints/checkpoint.py, checkpointer.py and run_lock.py: when to save, completion markers with sizes
and sha256, verification and fallback on resume, rotation, best.json, the mirror, failed saves, the run directory lock.

The policy and file logic run in-process without a process group (world 1): `save()` drives a
small engine stand-in whose writes go through DeepSpeed's own TorchCheckpointEngine, the way
`engine.save_checkpoint` writes. What needs real ranks (a write failing on one rank of two, no
hang, the real ZeRO-3 files, a load) is one launch of tests/helpers/ckpt_harness.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from conftest import BIN, REPO, free_port
from zerotrain.launcher.components.checkpoints.checkpoint import (BEST, MARKER, check_mirror, complete_checkpoints,
                                                                  find_resume, read_best, read_best_list, read_meta,
                                                                  rotation_victims, tag_for, verify)
from zerotrain.launcher.components import faults
from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.checkpoints import run_dir_snapshot
from zerotrain.launcher.components.checkpoints.run_lock import LOCK, RunLock
from zerotrain.launcher.errors import CheckpointError, UsageError

HARNESS = REPO / "tests" / "helpers" / "ckpt_harness.py"


class Engine:
    """Writes a tag the way DeepSpeed's save_checkpoint does: makedirs and torch.save through
    `self.checkpoint_engine` (DeepSpeed's TorchCheckpointEngine), two files per tag."""

    def __init__(self):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        import torch

        assert save_latest is False  # DeepSpeed's `latest` is written before all ranks finish
        d = os.path.join(save_dir, tag)
        self.checkpoint_engine.makedirs(d, exist_ok=True)
        self.checkpoint_engine.save({"client": client_state, "w": torch.arange(4096.0)},
                                    os.path.join(d, "mp_rank_00_model_states.pt"))
        self.checkpoint_engine.save({"m": torch.ones(2048)}, os.path.join(d, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        return True


@pytest.fixture(scope="module")
def engine():
    return Engine()


def make(tmp_path, hooks: TestHooks | None = None, **kw) -> tuple[Checkpointer, list[str]]:
    """A Checkpointer, or (`hooks`) the faulty stand-in the run builds when a test hook is set."""
    said: list[str] = []
    build = Checkpointer if hooks is None else partial(faults.checkpointer, hooks)
    return build(tmp_path / "run" / "checkpoints", "run", 0, 1, say=said.append, **kw), said


def save(ckpt, engine, step):
    return ckpt.save(engine, step, {"zerotrain": {"step": step}}, {"step": step, "world_size": 1})


def names(paths) -> list[str]:
    return [p.name for p in paths]


# -- policy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("complete, incomplete, keep, protected, victims", [
    ([1, 2, 3], [], 0, [], []),                    # 0 keeps all
    ([1, 2, 3], [], 1, [], [1, 2]),
    ([1, 2, 3], [], 2, [], [1]),
    ([1, 2, 3], [], 5, [], []),
    ([1, 2, 3, 4], [], 1, [2], [1, 3]),            # the best (or an in-flight mirror copy) stays
    ([1, 2, 3, 4], [], 1, [1, 2, 3], []),
    ([3], [], 1, [], []),                          # never the only complete one
    ([], [1, 2], 1, [], []),                       # no complete one: incomplete ones stay
    ([2, 4], [1, 3, 5], 1, [], [1, 2, 3]),         # incomplete: only older than the newest complete
    ([2, 4], [1, 3, 5], 0, [], [1, 3]),
    ([10, 9, 100], [], 2, [], [9]),                # by step, not by name
])
def test_rotation_victims(complete, incomplete, keep, protected, victims):
    t = lambda steps: [tag_for(s) for s in steps]  # noqa: E731
    assert rotation_victims(t(complete), t(incomplete), keep, set(t(protected))) == t(victims)


def test_due_every_steps_every_hours_whichever_first_and_always_at_the_end(tmp_path, engine):
    now = [0.0]
    ckpt, _ = make(tmp_path, save_every_steps=10, save_every_hours=2, clock=lambda: now[0])
    assert not ckpt.hours_due() and ckpt.hours_due(now=2 * 3600)
    assert [s for s in range(1, 31) if ckpt.due(s)] == [10, 20, 30]
    assert ckpt.due(7, hours_flag=True) and ckpt.due(7, last_step=True) and not ckpt.due(7)
    now[0] = 1.5 * 3600
    save(ckpt, engine, 7)  # any save restarts the hours clock
    assert not ckpt.due(7, hours_flag=True, last_step=True)  # never twice for one step
    assert not ckpt.hours_due(now=now[0] + 1.9 * 3600) and ckpt.hours_due(now=now[0] + 2 * 3600)
    ckpt.close()
    plain, _ = make(tmp_path / "b")
    assert not plain.hours_due(now=1e9) and [s for s in range(1, 50) if plain.due(s)] == []
    assert plain.due(49, last_step=True)
    plain.close()


@pytest.mark.parametrize("kw, message", [
    ({"keep_last": -1}, "--keep-last: must be an integer >= 0, got -1"),
    ({"save_every_hours": 0}, "--save-every-hours: must be a positive number, got 0"),
    ({"save_every_steps": -5}, "--save-every-steps: must be an integer >= 0, got -5"),
])
def test_bad_policy_values_are_one_line_usage_errors(tmp_path, kw, message):
    with pytest.raises(UsageError, match=f"^{message}$"):
        make(tmp_path, **kw)


# -- completion and verification ----------------------------------------------------------------------

def test_a_save_is_complete_only_once_the_background_marker_lists_every_file(tmp_path, engine, monkeypatch):
    ckpt, _ = make(tmp_path)
    hold = threading.Event()
    monkeypatch.setattr(ckpt, "_finalize_hold", hold)
    tag_dir = save(ckpt, engine, 5)
    # save() has returned: the files are written, the marker is not (hashing is rank 0's background work)
    assert sorted(p.name for p in tag_dir.iterdir()) == ["mp_rank_00_model_states.pt",
                                                         "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert complete_checkpoints(ckpt.ckpt_dir) == [] and find_resume(ckpt.ckpt_dir) is None
    hold.set()
    ckpt.close()
    meta = read_meta(tag_dir)
    assert meta["step"] == 5 and meta["world_size"] == 1
    assert meta["files"] == {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                             for p in tag_dir.iterdir() if p.name != MARKER}
    assert verify(tag_dir) is None and find_resume(ckpt.ckpt_dir) == tag_dir
    assert (ckpt.ckpt_dir / "latest").read_text() == tag_for(5)  # ours, written after the marker
    assert not [p for p in tag_dir.iterdir() if p.name.startswith(".")]  # no temp file left


def test_verify_names_the_first_problem_and_accepts_old_markers(tmp_path, engine):
    ckpt, _ = make(tmp_path)
    tag_dir = save(ckpt, engine, 1)
    ckpt.close()
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    good = optim.read_bytes()
    optim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert verify(tag_dir) == "file zero_pp_rank_0_mp_rank_00_optim_states.pt sha256 mismatch"
    optim.write_bytes(good[:100])
    assert verify(tag_dir) == f"file zero_pp_rank_0_mp_rank_00_optim_states.pt has 100 bytes, {MARKER} says {len(good)}"
    optim.unlink()
    assert verify(tag_dir) == "file zero_pp_rank_0_mp_rank_00_optim_states.pt missing"
    (tag_dir / MARKER).write_text("{not json")
    assert verify(tag_dir).startswith(f"{MARKER} unreadable (JSONDecodeError")
    # the marker format before `files`: existing runs must still resume
    (tag_dir / MARKER).write_text(json.dumps({"step": 1, "tokens_seen": 64, "world_size": 1, "run_id": "run"}))
    assert verify(tag_dir) is None and find_resume(ckpt.ckpt_dir) == tag_dir


def test_resume_falls_back_past_a_corrupted_checkpoint_saying_so(tmp_path, engine):
    ckpt, _ = make(tmp_path)
    tags = [save(ckpt, engine, s) for s in (2, 4, 6)]
    ckpt.close()
    (tags[2] / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    (tags[1] / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    said = []
    assert find_resume(ckpt.ckpt_dir, say=said.append) == tags[0]
    assert said == [f"checkpoint {tags[2]}: file mp_rank_00_model_states.pt has 7 bytes, {MARKER} says "
                    f"{read_meta(tags[2])['files']['mp_rank_00_model_states.pt']['size']}; falling back to {tags[1]}",
                    f"checkpoint {tags[1]}: file zero_pp_rank_0_mp_rank_00_optim_states.pt missing;"
                    f" falling back to {tags[0]}"]
    (tags[0] / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(UsageError, match=rf"^no complete checkpoint verifies: {tags[2]}: file mp_rank_00_model_states"
                                         r"\.pt has 7 bytes, .* \(nor do 2 older\)$"):
        find_resume(ckpt.ckpt_dir, say=said.append)
    assert find_resume(tmp_path / "nothing") is None


# -- failed saves -------------------------------------------------------------------------------------

def test_a_failed_write_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(tmp_path, engine, monkeypatch):
    ckpt, _ = make(tmp_path, hooks=TestHooks(fail_save=frozenset({(0, 2)})))
    save(ckpt, engine, 1)
    with pytest.raises(CheckpointError) as e:
        save(ckpt, engine, 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {ckpt.ckpt_dir / 'global_step2'} failed on rank 0: OSError:"
                                              " [Errno 28] No space left on device")
    assert msg.endswith(f"; it was removed, the previous checkpoint {ckpt.ckpt_dir / 'global_step1'} is intact")
    assert not (ckpt.ckpt_dir / "global_step2").exists()  # the half-written tag is gone
    save(ckpt, engine, 3)  # the next save works again
    ckpt.close()
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step1", "global_step3"]
    assert verify(ckpt.ckpt_dir / "global_step1") is None


# -- rotation, best, mirror -----------------------------------------------------------------------------

def test_rotation_keeps_best_newest_and_in_flight_mirror_copies(tmp_path, engine, monkeypatch):
    ckpt, said = make(tmp_path, keep_last=1, mirror=tmp_path / "mirror")
    hold = threading.Event()
    monkeypatch.setattr(ckpt, "_mirror_hold", hold)  # a mirror slower than the saves
    planted_old, planted_new = ckpt.ckpt_dir / "global_step0", ckpt.ckpt_dir / "global_step9"
    planted_old.mkdir(parents=True)
    planted_new.mkdir()  # newer than any complete one: may be a save in progress
    for step in (1, 2, 3, 4):
        save(ckpt, engine, step)
        if step == 2:
            ckpt.mark_best(tag_for(2), 2, 0.5)
    ckpt._finalizer.join()
    # every tag is queued or being copied: nothing complete is deleted, the old incomplete one is
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == [tag_for(s) for s in (1, 2, 3, 4)]
    assert not planted_old.exists() and planted_new.exists()
    hold.set()
    ckpt.close()
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step2", "global_step4"]  # best + newest
    mirror = tmp_path / "mirror" / "run" / "checkpoints"
    assert names(complete_checkpoints(mirror)) == ["global_step2", "global_step4"]
    assert all(verify(p) is None for p in complete_checkpoints(mirror))
    best = {"tag": "global_step2", "step": 2, "val_loss": 0.5}
    assert json.loads((mirror / BEST).read_text()) == json.loads((ckpt.ckpt_dir / BEST).read_text()) == {
        **best, "kept": [best]}
    assert not [p for p in mirror.iterdir() if p.name.startswith(".")]
    assert find_resume(ckpt.ckpt_dir) == ckpt.ckpt_dir / "global_step4"  # the planted step 9 is ignored
    where = {"local": ckpt.ckpt_dir, "mirror": mirror}
    assert said == [f"checkpoint rotation (--keep-last 1): removed {tag} from {where[side]}" for tag, side in (
        ("global_step0", "local"), ("global_step1", "local"), ("global_step1", "mirror"),
        ("global_step3", "local"), ("global_step3", "mirror"))]


def test_a_fresh_node_resumes_from_the_mirror_and_a_bad_local_copy_falls_back_to_it(tmp_path, engine):
    ckpt, _ = make(tmp_path, mirror=tmp_path / "mirror")
    save(ckpt, engine, 3)
    ckpt.close()
    local, mirror = ckpt.ckpt_dir, tmp_path / "mirror" / "run" / "checkpoints"
    (local / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    said = []
    assert find_resume(local, mirror, say=said.append) == mirror / "global_step3"
    assert said[0].endswith(f"; falling back to {mirror / 'global_step3'}")
    assert find_resume(tmp_path / "empty-node" / "checkpoints", mirror) == mirror / "global_step3"


def test_a_mirror_copy_that_does_not_verify_is_dropped_with_a_warning(tmp_path, engine, monkeypatch):
    ckpt, said = make(tmp_path, mirror=tmp_path / "mirror")
    hold = threading.Event()
    monkeypatch.setattr(ckpt, "_mirror_hold", hold)
    tag_dir = save(ckpt, engine, 1)
    ckpt._finalizer.join()
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"changed after the marker")
    hold.set()
    ckpt.close()
    mirror = tmp_path / "mirror" / "run" / "checkpoints"
    assert list(mirror.iterdir()) == []  # neither the tag nor a partial copy
    assert [s for s in said if s.startswith("warning:")] == [
        f"warning: --mirror {mirror}: copy of global_step1 failed (CheckpointError: the copy does not verify:"
        f" file mp_rank_00_model_states.pt has 24 bytes, {MARKER} says "
        f"{read_meta(tag_dir)['files']['mp_rank_00_model_states.pt']['size']}); training goes on"]


def test_an_unwritable_mirror_warns_once_and_saving_goes_on(tmp_path, engine):
    (tmp_path / "a-file").write_text("")
    ckpt, said = make(tmp_path, mirror=tmp_path / "a-file" / "mirror")
    save(ckpt, engine, 1)
    ckpt.mark_best(tag_for(1), 1, 2.0)
    ckpt.close()
    assert len(said) == 1 and said[0].startswith(f"warning: --mirror {tmp_path / 'a-file' / 'mirror'}: not writable (")
    assert said[0].endswith("training goes on without a mirror")
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step1"]


def test_a_best_checkpoint_best_json_does_not_name_is_ranked_in_again_from_its_marker(tmp_path, engine):
    """A kill between a best checkpoint's marker and best.json's rewrite (its own file, written after): the marker
    carries the checkpoint's entry, and the next start (sync_best) ranks it in with best.json's and rewrites the
    file, so --keep-best keeps it from rotation and `export --best` finds it. An entry pushed out of the K best
    (its tag still there as a regular save) stays out."""
    ckpt, said = make(tmp_path, keep_best=2)
    ckpt.sync_best()
    for step, loss in {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5}.items():  # step 1 pushed out by step 3; 4 pushes out 3
        ckpt.save(engine, step, {"zerotrain": {"step": step}}, {"step": step, "world_size": 1}, best_value=loss)
        ckpt.mark_best(tag_for(step), step, loss)
        ckpt.wait()
    ckpt.close()
    kept = [{"tag": "global_step4", "step": 4, "val_loss": 0.5}, {"tag": "global_step2", "step": 2, "val_loss": 1.0}]
    assert read_best_list(ckpt.ckpt_dir) == kept
    assert read_meta(ckpt.ckpt_dir / "global_step4")["best"] == kept[0]
    stale = [{"tag": "global_step2", "step": 2, "val_loss": 1.0}, {"tag": "global_step3", "step": 3, "val_loss": 2.0}]
    (ckpt.ckpt_dir / BEST).write_text(json.dumps({**stale[0], "kept": stale}))  # as the kill left it: step 4 unnamed
    resumed, said = make(tmp_path, keep_best=2)
    assert resumed.sync_best() == kept
    assert read_best_list(ckpt.ckpt_dir) == kept  # the file rewritten
    assert said == ["best.json: global_step4 ranked in again from its checkpoint (best.json had not been rewritten"
                    " when the run stopped)"]
    again, said = make(tmp_path, keep_best=2)
    assert again.sync_best() == kept and said == []  # nothing missing: the file is left as it is


def test_keep_best_k_survive_rotation_a_resume_and_a_rollback(tmp_path, engine):
    """--keep-best 2 with --keep-last 1: a tag is saved when its validation loss is among the 2 lowest, best.json
    lists them lowest first, rotation removes the one pushed out; a new Checkpointer (a resume) takes the list
    from best.json (trimmed when K is lowered); a rollback drops the given-up tags from it."""
    ckpt, said = make(tmp_path, keep_last=1, keep_best=2)
    ckpt.sync_best()
    assert ckpt.kept == []
    val = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 1.5}
    for step, loss in val.items():
        if ckpt.would_keep(loss):
            save(ckpt, engine, step)
            ckpt.mark_best(tag_for(step), step, loss)
        ckpt.wait()
    assert not ckpt.would_keep(1.6) and ckpt.would_keep(1.4) and not ckpt.would_keep(float("nan"))
    save(ckpt, engine, 6)  # the last step: saved, newest
    ckpt.close()
    kept = [{"tag": "global_step2", "step": 2, "val_loss": 1.0}, {"tag": "global_step5", "step": 5, "val_loss": 1.5}]
    assert json.loads((ckpt.ckpt_dir / BEST).read_text()) == {**kept[0], "kept": kept}
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step2", "global_step5", "global_step6"]
    assert [s.split(" from ")[0] for s in said] == [f"checkpoint rotation (--keep-last 1): removed {t}" for t in (
        "global_step1", "global_step3")]  # step 1 pushed out by step 3, step 3 by step 5

    resumed, _ = make(tmp_path, keep_last=1, keep_best=2)
    assert resumed.sync_best() == kept
    save(resumed, engine, 7)
    resumed.close()
    assert names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step2", "global_step5", "global_step7"]
    assert resumed.discard_after(4) == ["global_step5", "global_step7"]
    assert read_best_list(ckpt.ckpt_dir) == kept[:1] and resumed.kept == kept[:1]
    lowered, _ = make(tmp_path, keep_best=1)
    (ckpt.ckpt_dir / BEST).write_text(json.dumps({**kept[0], "kept": kept}))
    assert lowered.sync_best() == kept[:1]
    lowered.close()
    (ckpt.ckpt_dir / BEST).write_text(json.dumps(kept[1]))  # best.json from before --keep-best: a list of one
    assert read_best_list(ckpt.ckpt_dir) == kept[1:] and read_best(ckpt.ckpt_dir) == kept[1]
    for bad in (0, -1, True, "2"):
        with pytest.raises(UsageError, match=f"--keep-best: must be an integer >= 1, got {bad!r}"):
            make(tmp_path, keep_best=bad)


def test_best_names_only_a_complete_checkpoint(tmp_path, engine):
    ckpt, said = make(tmp_path)
    save(ckpt, engine, 1)
    ckpt.mark_best(tag_for(1), 1, 3.0)
    ckpt.mark_best(tag_for(7), 7, 1.0)  # never saved
    ckpt.close()
    assert json.loads((ckpt.ckpt_dir / BEST).read_text())["tag"] == "global_step1"
    assert said == ["warning: best.json not updated: global_step7 is not a complete checkpoint"]


def test_a_mirror_overlapping_the_run_directory_is_refused(tmp_path):
    run = tmp_path / "runs" / "r"
    with pytest.raises(UsageError, match="^--mirror .*: inside the run directory"):
        check_mirror(run / "mirror", run, "r")
    with pytest.raises(UsageError, match="^--mirror .*: its copies would go to .*checkpoints, which overlaps"):
        check_mirror(tmp_path / "runs", run, "r")  # --mirror = --out: the copies would be the checkpoints
    check_mirror(tmp_path / "nfs", run, "r")


# -- the run directory lock ------------------------------------------------------------------------------

@pytest.mark.launches
def test_run_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path):
    run = tmp_path / "run"
    said = []
    with RunLock(run, say=said.append):
        holder = json.loads((run / LOCK).read_text())
        assert holder["pid"] == os.getpid() and holder["host"]
        with pytest.raises(UsageError, match=rf"^run directory {run} is in use by pid {os.getpid()} on host "):
            RunLock(run).acquire()
    assert not (run / LOCK).exists() and said == []
    # a live process on this host
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = holder["host"]
        (run / LOCK).write_text(json.dumps({"host": host, "pid": sleeper.pid, "started": "then"}))
        with pytest.raises(UsageError, match=rf"in use by pid {sleeper.pid} on host {host} \(since then\)"):
            RunLock(run).acquire()
        # ... and once it is dead: first a zombie (killed, not reaped yet), then gone
        sleeper.kill()
        while Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        lock = RunLock(run, say=said.append).acquire()
        lock.release()
    finally:
        sleeper.kill()
        sleeper.wait()
    (run / LOCK).write_text(json.dumps({"host": host, "pid": sleeper.pid, "started": "then"}))
    lock = RunLock(run, say=said.append).acquire()
    assert said == 2 * [f"taking over the lock of {run} from pid {sleeper.pid} on host {host}: that process is gone"]
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    # a live pid that started at another time than the holder's: the pid was reused
    (run / LOCK).write_text(json.dumps({"host": host, "pid": os.getppid(), "pid_start": "1", "started": "then"}))
    said.clear()
    RunLock(run, say=said.append).acquire().release()
    assert said == [f"taking over the lock of {run} from pid {os.getppid()} on host {host}:"
                    " that pid now belongs to another process"]
    # another host: refused while its heartbeat is fresh, taken over once it is stale
    (run / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
    with pytest.raises(UsageError, match=r"in use by pid 1 on host elsewhere \(since then, heartbeat 0 min ago\)"):
        RunLock(run).acquire()
    old = time.time() - 3600
    os.utime(run / LOCK, (old, old))
    said.clear()
    with RunLock(run, say=said.append):
        assert said == [f"taking over the lock of {run} from pid 1 on host elsewhere: no heartbeat for 60 min"]


def test_run_lock_heartbeat_keeps_the_lock_fresh(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05):
        old = time.time() - 3600
        os.utime(tmp_path / LOCK, (old, old))
        time.sleep(0.3)
        assert time.time() - (tmp_path / LOCK).stat().st_mtime < 60



def test_a_live_run_is_refused_before_planning_and_a_directory_changed_since_the_plan_under_the_lock(tmp_path):
    """refuse_if_live: the lock's own line while its holder lives (a launch refuses before planning a resume on
    checkpoints the live run rotates); take_lock's `still`: a directory another launch wrote between the plan and
    the lock (that launch ended meanwhile) is refused and the lock given back."""
    from zerotrain.launcher.components.checkpoints.run_lock import refuse_if_live, take_lock

    from zerotrain.launcher.components.checkpoints.run_lock import _pid_start

    run = tmp_path / "run"
    refuse_if_live(run)  # no directory, no lock: nothing to say
    with RunLock(run):
        refuse_if_live(run)  # held by this process itself: not another launch
        other = {"host": socket.gethostname(), "pid": os.getppid(), "pid_start": _pid_start(os.getppid()),
                 "started": "2026-11-29T00:00:00+00:00"}  # a live process that is not this one
        mine = (run / LOCK).read_text()
        (run / LOCK).write_text(json.dumps(other))
        with pytest.raises(UsageError, match=f"run directory {run} is in use by pid {os.getppid()} on host"):
            refuse_if_live(run)
        (run / LOCK).write_text(mine)
    refuse_if_live(run)  # released
    with pytest.raises(UsageError, match="changed while this launch started"):
        take_lock(run, None, True, still=lambda: f"run directory {run} changed while this launch started")
    assert not (run / LOCK).exists()
    lock = take_lock(run, None, True, still=lambda: None)
    assert (run / LOCK).exists()
    lock.release()

def test_a_refused_start_up_puts_the_run_directory_back(tmp_path):
    """RunDirSnapshot (Trainer._abandon on bad input): files rewritten get their bytes back, logs appended to their
    length, new files and directories go (a universal conversion too), checkpoints stay; a new directory goes."""
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step4").mkdir(parents=True)
    (run / "checkpoints" / "global_step4" / "model.pt").write_bytes(b"weights")
    (run / "config.json").write_text('{"a": 1}\n')
    (run / "big.log").write_bytes(b"x" * (run_dir_snapshot.KEEP_BYTES + 10))
    (run / "hangs").mkdir()
    snap = run_dir_snapshot.RunDirSnapshot.take(run)
    (run / "config.json").write_text('{"a": 2, "changed": true}\n')
    with open(run / "big.log", "ab") as f:
        f.write(b"appended")
    (run / "zerotrain.lock").write_text("{}")
    (run / "checkpoints" / "universal" / "global_step4").mkdir(parents=True)
    (run / "checkpoints" / "universal" / "global_step4" / "x").write_text("converted")
    (run / "hangs" / "new").mkdir()
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_text("e")
    snap.restore()
    assert (run / "config.json").read_text() == '{"a": 1}\n'
    assert (run / "big.log").stat().st_size == run_dir_snapshot.KEEP_BYTES + 10
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "big.log", "checkpoints", "checkpoints/global_step4", "checkpoints/global_step4/model.pt", "config.json",
        "hangs"]
    fresh = tmp_path / "fresh"
    snap = run_dir_snapshot.RunDirSnapshot.take(fresh)
    (fresh / "checkpoints").mkdir(parents=True)
    snap.restore()
    assert not fresh.exists()
    made = tmp_path / "out" / "run"  # an --out the launch made too: gone with it when left empty
    snap = run_dir_snapshot.RunDirSnapshot.take(made, existed=False, out_existed=False)
    (made / "checkpoints").mkdir(parents=True)
    snap.restore()
    assert not made.parent.exists()

# -- two real ranks ---------------------------------------------------------------------------------

@pytest.mark.launches
def test_two_ranks_failed_saves_rotation_mirror_and_load(tmp_path):
    """One launch, 2 ranks, ZeRO-3: step 3 fails on rank 1 (test hook), step 5 on rank 0 (a real
    EFBIG write); both fail on both ranks without a hang; keep-last 2 + best + mirror; a load
    restores the saved weights."""
    proc = subprocess.run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                           str(HARNESS), "check", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRAIN_TEST_FAIL_SAVE": "1:3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    for r in (r0, r1):  # the same one-line error on both ranks, whichever rank failed
        assert sorted(r["errors"]) == ["3", "5"]
        assert r["errors"]["3"].startswith(f"checkpoint {ckpt_dir / 'global_step3'} failed on rank 1: OSError: [Errno 28]")
        assert r["errors"]["5"].startswith(f"checkpoint {ckpt_dir / 'global_step5'} failed on rank 0: writing"
                                           f" {ckpt_dir / 'global_step5'}/")  # the file-size limit: torch.save failed
        assert r["errors"]["3"].endswith(f"the previous checkpoint {ckpt_dir / 'global_step2'} is intact")
        assert r["errors"]["5"].endswith(f"the previous checkpoint {ckpt_dir / 'global_step4'} is intact")
        assert r["loaded_weights"] == r["saved_weights"] != r["moved_weights"] and r["loaded_step"] == 6
    assert r0["errors"] == r1["errors"]
    assert r0["local"] == r0["mirror"] == ["global_step2", "global_step4", "global_step6"]  # keep 2 + the best
    assert r0["local_incomplete"] == [] and r0["mirror_leftovers"] == []
    best = {"tag": "global_step2", "step": 2, "val_loss": 1.0}
    assert r0["best"] == r0["mirror_best"] == {**best, "kept": [best]}
    assert set(r0["verify"].values()) == {None} and len(r0["verify"]) == 6
    assert r0["marker_files"] == r0["on_disk"]
    assert r0["marker_files"]["global_step6"] == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                                                  for r in (0, 1) for kind in ("model", "optim")]
    assert r0["latest"] == "global_step6"
    # a corrupted file in the newest real checkpoint: resume falls back to the previous one
    victim = ckpt_dir / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    said = []
    assert find_resume(ckpt_dir, say=said.append) == ckpt_dir / "global_step4"
    assert said == [f"checkpoint {ckpt_dir / 'global_step6'}: file zero_pp_rank_1_mp_rank_00_optim_states.pt"
                    f" sha256 mismatch; falling back to {ckpt_dir / 'global_step4'}"]


def test_slow_save_hook_leaves_a_half_written_tag_for_the_kill_tests(tmp_path, engine, monkeypatch):
    """ZEROTRAIN_TEST_SLOW_SAVE: inside the save, after the first file, nothing complete on disk."""
    ckpt, _ = make(tmp_path, hooks=TestHooks(slow_save_s=1.0))
    saver = threading.Thread(target=save, args=(ckpt, engine, 1))
    saver.start()
    tag_dir = ckpt.ckpt_dir / "global_step1"
    deadline = time.time() + 30
    while not (tag_dir.is_dir() and any(tag_dir.iterdir())) and time.time() < deadline:
        time.sleep(0.01)
    assert names(tag_dir.iterdir()) == ["mp_rank_00_model_states.pt"] and find_resume(ckpt.ckpt_dir) is None
    saver.join()
    ckpt.close()
    assert verify(tag_dir) is None and names(complete_checkpoints(ckpt.ckpt_dir)) == ["global_step1"]


def test_after_a_rollback_the_given_up_tags_go_and_their_steps_save_again(tmp_path, engine):
    ckpt, said = make(tmp_path, save_every_steps=10, mirror=tmp_path / "mirror")
    for step in (10, 20, 30):
        save(ckpt, engine, step)
    ckpt.mark_best(tag_for(30), 30, 0.1)
    ckpt.wait()
    assert not ckpt.due(30, last_step=True)
    ckpt.note_loaded(10)  # rolled back to step 10: 20 and 30 hold the given-up timeline
    assert ckpt.discard_after(10) == ["global_step20", "global_step30"]
    mirror = tmp_path / "mirror" / "run" / "checkpoints"
    for d in (ckpt.ckpt_dir, mirror):
        assert names(complete_checkpoints(d)) == ["global_step10"] and not (d / BEST).exists()
    assert not ckpt.due(10, last_step=True) and ckpt.due(20)
    save(ckpt, engine, 20)
    ckpt.close()
    assert find_resume(ckpt.ckpt_dir) == ckpt.ckpt_dir / "global_step20"
    assert said[-1] == "removed checkpoints newer than step 10 (a timeline given up): global_step20, global_step30"
