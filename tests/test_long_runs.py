"""Runs that survive: signals, kill -9, corrupted checkpoints, rotation, mirror, evaluation and the
best checkpoint, budgets, spike rollback and a failed save — end to end with the real `deepspeed`
launcher on 2 CPU ranks (ZeRO-3, gloo). The policy logic itself is unit-tested without a process
group in test_checkpointer.py and test_guards.py; here each launch serves several assertions.

Every interrupted run is compared with one uninterrupted reference run of the same flags (conftest's
`reference_history`, shared with test_restarts.py and test_watchdog.py): the effective per-step history
(zerotrain.launcher.components.observe.metrics.read_metrics) must have the same token digests and bit-identical
losses at every step.
"""
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, REFERENCE_FLAGS, REFERENCE_STEPS, REPO, TRAIN_PY, cpu_profile, free_port, launch
from zerotrain.launcher.components.checkpoints.checkpoint import complete_checkpoints, verify
from zerotrain.launcher.components.observe.metrics import read_metrics

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

N = REFERENCE_STEPS
FLAGS = REFERENCE_FLAGS  # the shared reference run's (conftest), --max-steps N last
ENV = {"OMP_NUM_THREADS": "1"}


def deepspeed_cmd(args):
    return [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(TRAIN_PY), *args]


def zerotrain_launch_cmd(args):
    return [str(BIN / "zerotrain"), "launch", "-n", "2", *args]


def popen(cmd, env_extra=None):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, **ENV, **(env_extra or {})}, start_new_session=True)


def wait_for_step(run_dir: Path, step: int, proc, timeout=240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return
        if any(m["step"] >= step for m in read_metrics(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


def same_history(a, b):
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, N + 1))
    assert [m["tokens_sha"] for m in a] == [m["tokens_sha"] for m in b]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # full-precision floats, compared exactly


def test_sigterm_saves_once_and_resumes_exactly_with_eval_best_rotation_and_mirror(tmp_path, mix_path,
                                                                                  reference_history):
    out, mirror = tmp_path / "runs", tmp_path / "mirror"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS, "--save-every-steps", "2",
            "--keep-last", "1", "--keep-best", "2", "--mirror", str(mirror), "--eval-every-steps", "2"]
    run = out / "r"
    # SIGTERM reaches only `zerotrain launch` (as from a scheduler), during a slowed-down evaluation
    proc = popen(zerotrain_launch_cmd(args), {"ZEROTRAIN_TEST_SLOW_MIRROR": "1"})
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 6, text[-3000:]  # stopped by a signal, checkpoint saved: rank 0's code survives
    assert "Traceback" not in text
    stopped = read_metrics(run)[-1]["step"]
    assert 5 <= stopped < N
    ckpts = run / "checkpoints"
    assert (ckpts / f"global_step{stopped}" / "zerotrain.json").is_file()
    events = read_metrics(run, events=True)
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "signal"

    resumed = launch("deepspeed", args)  # continues to N; config unchanged
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpts / f'global_step{stopped}'} at step {stopped}" in resumed.stdout
    history = read_metrics(run)
    same_history(history, reference_history)  # eval, rotation and the mirror do not touch the training
    assert [m.get("val_loss") for m in history] == [m.get("val_loss") for m in reference_history]  # nor the resume

    # evaluation every 2 steps on a held-out slice, the 2 best checkpoints kept through rotation and the resume
    evals = {m["step"]: m["val_loss"] for m in history if "val_loss" in m}
    assert sorted(evals) == list(range(2, N + 1, 2))
    assert all(set(m["val_loss_per_source"]) == {"prose", "notes"} for m in history if "val_loss" in m)
    kept = sorted(evals, key=lambda s: (evals[s], s))[:2]
    best_step = kept[0]
    best = json.loads((ckpts / "best.json").read_text())
    assert best["step"] == best_step and best["tag"] == f"global_step{best_step}"
    assert [(b["step"], b["val_loss"]) for b in best["kept"]] == [(s, evals[s]) for s in kept]
    complete = sorted(p.name for p in ckpts.glob("global_step*") if (p / "zerotrain.json").is_file())
    assert complete == sorted({f"global_step{N}", *(f"global_step{s}" for s in kept)})  # keep-last 1, plus the 2 best
    # the mirror holds verified copies of the tags
    mirrored = mirror / "r" / "checkpoints"
    assert (mirrored / f"global_step{N}" / "zerotrain.json").is_file()
    assert verify(mirrored / f"global_step{N}") is None
    assert json.loads((mirrored / "best.json").read_text()) == best
    assert not list(mirrored.glob("*.tmp*"))
    manifest = json.loads((run / "manifest.json").read_text())
    assert [(s.get("end_reason"), s.get("end_exit_code")) for s in manifest["segments"]] == [("signal", 6), ("finished", 0)]
    assert manifest["segments"][0]["end_message"].startswith("stopped by SIGTERM at step")
    assert not (run / "run.lock").exists()


def unmarked_tags(run: Path, since: float) -> list[Path]:
    """Checkpoint tags holding a file written after `since` but no completion marker: a save under way."""
    return [tag for tag in (run / "checkpoints").glob("global_step*") if not (tag / "zerotrain.json").exists()
            and any(f.stat().st_mtime >= since for f in tag.rglob("*") if f.is_file())]


def test_kill_minus_9_at_random_moments_then_resume_reaches_the_same_losses(tmp_path, mix_path, reference_history):
    """kill -9 of the whole process group at 3 random moments (a step, a slowed save or the marker write), each
    at least one step after the resume, then once inside a save (deterministic: every save is held after each
    rank's first file), each followed by a resume; then a corrupted newest checkpoint: resume falls back to the
    previous one and says so. Every marker only ever names a whole checkpoint."""
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS, "--save-every-steps", "1"]
    run = out / "r"
    rng = random.Random(7)
    # random kills after steps 3, 7 and 11 at the earliest: a run slowed by 0.3 s a save cannot reach N meanwhile
    for earliest in (3, 7, 11):
        proc = popen(deepspeed_cmd(args), {"ZEROTRAIN_TEST_SLOW_SAVE": "0.3"})
        done = read_metrics(run)[-1]["step"] if read_metrics(run) else 0
        wait_for_step(run, max(earliest, done + 1), proc)
        time.sleep(rng.uniform(0.0, 0.4))  # lands in a step, a save or the marker write
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert all(verify(p) is None for p in complete_checkpoints(run / "checkpoints"))
    # inside a save: the first save of this launch holds each rank after its first file, and is killed there
    since = time.time()
    proc = popen(deepspeed_cmd(args), {"ZEROTRAIN_TEST_SLOW_SAVE": "3600"})
    t0 = time.time()
    while not unmarked_tags(run, since) and proc.poll() is None and time.time() - t0 < 240:
        time.sleep(0.05)
    (half,) = unmarked_tags(run, since)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    complete = complete_checkpoints(run / "checkpoints")
    assert all(verify(p) is None for p in complete) and half not in complete and not (half / "zerotrain.json").exists()
    # corrupt one byte of the newest complete checkpoint: the resume must fall back, and say so
    newest = complete[-1]
    victim = sorted(newest.glob("*optim_states.pt"))[0]
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    final = launch("deepspeed", args)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
    assert f"checkpoint {newest}" in final.stdout and "falling back" in final.stdout
    same_history(read_metrics(run), reference_history)


def test_spike_on_one_rank_rolls_back_every_rank_then_a_full_disk_fails_one_save_cleanly(tmp_path, mix_path):
    """A spike planted in rank 1's loss for steps 32-34: all ranks roll back to step 30 together and
    skip the same data window; later rank 1's save at step 40 hits ENOSPC: exit 7, one line, the
    previous checkpoint intact."""
    out = tmp_path / "runs"
    run = out / "r"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS[:-1], "50",
            "--save-every-steps", "10", "--on-spike", "rollback"]
    # a rank waiting for the failed one until the backend's timeout (30 min) would run past launch's 600 s
    proc = launch("deepspeed", args, env_extra={"ZEROTRAIN_TEST_SPIKE": "1:32-34:20",
                                                "ZEROTRAIN_TEST_FAIL_SAVE": "1:40"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 7, text[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "global_step40 failed on rank 1" in errors[0], errors
    assert "No space left on device" in errors[0] and "global_step30 is intact" in errors[0]
    rollbacks = json.loads((run / "rollbacks.json").read_text())
    assert len(rollbacks) == 1 and rollbacks[0]["skipped_steps"] == [31, 34]
    assert rollbacks[0]["rolled_back_to"].endswith("global_step30")
    history = read_metrics(run)
    assert [m["step"] for m in history] == list(range(1, 41))
    assert max(m["loss"] for m in history) < 20  # the spiking records were superseded after the rollback
    complete = complete_checkpoints(run / "checkpoints")
    assert complete[-1].name == "global_step30" and verify(complete[-1]) is None
    assert not (run / "checkpoints" / "global_step40" / "zerotrain.json").exists()


def test_budgets_stop_at_a_step_boundary_save_and_resume_with_a_larger_budget(tmp_path, mix_path):
    """A budget is checked after each step, so every launch trains one step at least; each step is held 0.1 s
    (ZEROTRAIN_TEST_SLOW_DATA), so that 400 steps take 40 s or more on any host and neither budget lets them all
    run: no outcome depends on the host's speed."""
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS[:-1], "400"]
    slow = {"ZEROTRAIN_TEST_SLOW_DATA": "0.1"}
    first = launch("python", args + ["--max-hours", "0.0005"], env_extra=slow)  # 1.8 s of training
    assert first.returncode == 5, first.stdout[-2000:] + first.stderr[-2000:]
    assert "budget reached" in first.stdout + first.stderr
    step = read_metrics(out / "r")[-1]["step"]
    assert 0 < step < 400 and (out / "r" / "checkpoints" / f"global_step{step}" / "zerotrain.json").is_file()
    # the same command again: the stop reserved a step's and a save's time, and so does the restart (it used
    # to reserve none and trained one step past the hour's limit)
    again = launch("python", args + ["--max-hours", "0.0005"], env_extra=slow)
    assert again.returncode == 5, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"budget reached before step {step + 1}: --max-hours" in again.stdout + again.stderr
    assert read_metrics(out / "r")[-1]["step"] == step
    # money: 1 GPU at $3600/hour is $1/s; a budget of $5 more than was spent stops again
    spent = read_metrics(out / "r")[-1]["elapsed_s"]
    second = launch("python", args + ["--budget-usd", f"{spent + 5:.3f}", "--gpu-hour-usd", "3600"], env_extra=slow)
    assert second.returncode == 5, second.stdout[-2000:] + second.stderr[-2000:]
    assert "budget-usd" in second.stdout + second.stderr
    left = [ln for ln in second.stdout.splitlines() if ln.startswith("budget: $")]  # said once, after the resume
    assert len(left) == 1 and 4.9 < float(left[0].rsplit("(", 1)[1].split(" left")[0].lstrip("$")) <= 5.0, left
    step2 = read_metrics(out / "r")[-1]["step"]
    assert step < step2 < 400
    third = launch("python", args[:-1] + [str(step2 + 3)])
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert [m["step"] for m in read_metrics(out / "r")] == list(range(1, step2 + 4))


def test_early_stop_keeps_and_exports_the_best_checkpoint(tmp_path, mix_path):
    """Evaluated on uniformly random characters, the validation loss rises as the model learns the
    training text: the best checkpoint is an early one, the run stops after P evaluations without
    improvement (exit 4), and `zerotrain export RUN --best` exports that best one. The run asks for
    deterministic kernels (--deterministic, docs/gpu.md): every operator it runs has one on the CPU."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#%&()*+,-./:;<=>?@[]^_{|}~"
    (tmp_path / "noise.jsonl").write_text("".join(
        json.dumps({"text": "".join(rng.choice(alphabet) for _ in range(300))}) + "\n" for _ in range(40)))
    (tmp_path / "eval.json").write_text(json.dumps({"sources": [{"name": "noise", "path": "noise.jsonl",
                                                                  "weight": 1}]}))
    out = tmp_path / "runs"
    proc = launch("python", ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS[:-1], "60",
                             "--eval-data", str(tmp_path / "eval.json"), "--eval-tokens", "4000",
                             "--eval-every-steps", "2", "--early-stop-patience", "3", "--keep-last", "1",
                             "--keep-best", "3", "--deterministic"])
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "early stop" in proc.stdout
    assert json.loads((out / "r" / "config.json").read_text())["run"]["deterministic"] is True
    history = read_metrics(out / "r")
    evals = {m["step"]: m["val_loss"] for m in history if "val_loss" in m}
    best_step = min(evals, key=evals.get)
    assert max(evals) == best_step + 3 * 2 < 60  # three evaluations without a new best, then stop
    best = json.loads((out / "r" / "checkpoints" / "best.json").read_text())
    kept = sorted(evals, key=lambda s: (evals[s], s))[:3]
    assert best["step"] == best_step and [b["step"] for b in best["kept"]] == kept
    complete = sorted(int(p.name[11:]) for p in (out / "r" / "checkpoints").glob("global_step*")
                      if (p / "zerotrain.json").is_file())
    assert complete == sorted({*kept, max(evals)})  # rotation kept the 3 best, and the newest
    runs = subprocess.run([str(BIN / "zerotrain"), "runs", str(out)], capture_output=True, text=True, cwd=REPO)
    assert f"({best_step}; also {kept[1]}, {kept[2]})" in runs.stdout, runs.stdout + runs.stderr
    exported = subprocess.run([str(BIN / "zerotrain"), "export", str(out / "r"), "--best", "--to",
                               str(tmp_path / "hf")], capture_output=True, text=True, cwd=REPO)
    assert exported.returncode == 0, exported.stderr
    assert f"exported {out / 'r' / 'checkpoints' / best['tag']}" in exported.stdout
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_signal_during_start_up_ends_the_run_before_its_first_step_and_a_second_one_at_once(tmp_path, mix_path):
    """SIGTERM to `zerotrain launch` while its ranks start (ZEROTRAIN_TEST_SLOW_START: a large model's build or
    load) stops the run before any step: exit 6, its end in manifest.json, nothing trained or saved, no traceback.
    A second signal after the grace second exits at once: exit 130 through the launch too, recorded as such."""
    for name, signals, code, kind in (("once", 1, 6, "signal"), ("twice", 2, 130, "hard-signal")):
        run = tmp_path / "runs" / name
        args = ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", name, *FLAGS]
        proc = popen(zerotrain_launch_cmd(args), {"ZEROTRAIN_TEST_SLOW_START": "8"})
        t0 = time.time()
        while not (run / "manifest.json").is_file():  # written before the ranks sleep
            assert proc.poll() is None and time.time() - t0 < 240, "the run directory was never written"
            time.sleep(0.05)
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)  # past the grace second: a second signal is not the same one delivered twice
        text = proc.communicate(timeout=120)[0]
        assert proc.returncode == code, text[-3000:]
        assert "Traceback" not in text
        end = json.loads((run / "manifest.json").read_text())["segments"][-1]
        assert (end["end_reason"], end["end_exit_code"], end["end_step"]) == (kind, code, 0), end
        assert read_metrics(run) == [] and complete_checkpoints(run / "checkpoints") == []
    assert "during start-up, before this launch's first step" in end_message(tmp_path / "runs" / "once")


def end_message(run: Path) -> str:
    return json.loads((run / "manifest.json").read_text())["segments"][-1]["end_message"]


def test_a_run_ended_by_its_token_budget_started_again_trains_nothing_more(tmp_path, mix_path):
    """The budget is checked before a launch's first step too: the same command again after --total-tokens
    stopped the run ends it at once (exit 5) instead of training one step past the budget."""
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *FLAGS, "--total-tokens", "384"]
    first = launch("python", args)
    assert first.returncode == 5, first.stdout[-2000:] + first.stderr[-2000:]
    step = read_metrics(out / "r")[-1]["step"]
    assert 0 < step < N and read_metrics(out / "r")[-1]["tokens_seen"] <= 384
    again = launch("python", args)
    assert again.returncode == 5, again.stdout[-2000:] + again.stderr[-2000:]
    assert read_metrics(out / "r")[-1]["step"] == step
    assert f"budget reached before step {step + 1}: --total-tokens 384 reached" in end_message(out / "r")


def test_sigterm_to_a_launch_with_data_workers_saves_and_stops(tmp_path, mix_path):
    """`zerotrain launch` signals the ranks' whole process group, their data-loader workers too: the workers leave
    the signal to their rank, which finishes its step, saves and stops (exit 6), instead of failing its next fetch
    on a killed worker (exit 143, nothing saved)."""
    run = tmp_path / "runs" / "w"
    args = ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "w", *FLAGS[:-1], "400",
            "--profile", cpu_profile(tmp_path, workers=2)]
    proc = popen(zerotrain_launch_cmd(args))
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 6, text[-3000:]
    assert "Traceback" not in text and "killed by signal" not in text
    stopped = read_metrics(run)[-1]["step"]
    assert [p.name for p in complete_checkpoints(run / "checkpoints")][-1] == f"global_step{stopped}"
