"""The hang watchdog (launcher/components/observe/watchdog.py).

The policy without a process group: the default timeout from the slowest phase, who is behind from
heartbeat files, a firing rank and a joining rank in one process (stacks, summary, manifest, exit
file, exit code), the flag, the profile keys and the test hook. Then the real thing, 2 CPU ranks under
`zerotrain launch` and DeepSpeed's launcher (gloo, ZeRO-3), one launch per scenario (a rank frozen from
outside with SIGSTOP, rank 0 blocked inside a C++ gloo collective: tests/test_restarts.py, whose launch
checks the watchdog's stacks, summary and line before the restart):
- a rank that blocks inside an evaluation, then (in the restarted job) inside a save, in one launch
  (ZEROTRAIN_TEST_HANG, each once per run): detected and named, restarted by `zerotrain launch --max-restarts 2`,
  and the run's losses are the uninterrupted run's, bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REFERENCE_FLAGS, read_metrics
from test_restarts import start  # zerotrain launch --hostfile --no_ssh on this node, a free port
from zerotrain.launcher.components import manifest
from zerotrain.launcher.components.observe import watchdog
from zerotrain.launcher.components.hooks import TestHooks, hang_reported
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.config_resolve import identity, resolve_config
from zerotrain.launcher.ends import EXIT_HUNG
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import validate_profile
from zerotrain.launcher.settings import comm_timeout_s

# -- the policy, without a process group --------------------------------------------------------------

def test_default_timeout_is_the_larger_of_600_s_and_5x_the_slowest_phase():
    assert watchdog.timeout_for("compute", None, {}) == 600
    assert watchdog.timeout_for("save", None, {"start": 900.0, "compute": 2.0, "save": 150.0}) == 750
    assert watchdog.timeout_for("data", 8, {"save": 150.0}) == 8  # given: fixed
    # start-up (no measured phase has ended yet) gets 30 minutes whatever the setting ...
    assert watchdog.timeout_for("start", 8, {"start": 1.0}) == 1800
    assert watchdog.timeout_for("start", 3600, {}) == 3600
    # ... and once the loop runs, "start" is the time between the measured phases: the normal timeout
    assert watchdog.timeout_for("start", 8, {"start": 1.0, "data": 0.1}) == 8
    # the first step of a launch compiles (flex, --compile, Muon): the start-up's grace, given or not
    assert watchdog.timeout_for("compute", None, {"data": 0.1}, first_step=True) == 1800
    assert watchdog.timeout_for("compute", 8, {"data": 0.1}, first_step=True) == 1800
    assert "600 s and 5x the slowest" in watchdog.describe(None) and "8 s" in watchdog.describe(8)
    assert watchdog.describe(0) == "watchdog: off (--hang-timeout 0)"


def beat(rank, step, phase, age, launch="L", now=1000.0):
    return {"rank": rank, "step": step, "phase": phase, "in_phase_s": 1.0, "time": now - age, "host": "h",
            "pid": 100 + rank, "launch": launch}


def test_the_first_step_of_a_launch_gets_the_start_up_grace(tmp_path):
    """Its compute compiles (flex on a GPU, --compile, Muon): 9 s of it at --hang-timeout 8 is not a hang; the
    same 9 s in a later step is."""
    now = FakeTime()
    clock = PhaseClock(clock=now)
    exits = []
    dog = watchdog.Watchdog(clock, tmp_path / "run", 0, 1, "L", 8, exit_fn=exits.append, now=now)
    dog.beat_dir.mkdir(parents=True)
    for finished in range(2):
        with clock.phase("compute"):
            now.t += 9
            dog.check()
        clock.set_step(finished + 1)
    assert exits == [EXIT_HUNG]  # the second step's, not the first's


def test_behind_names_lower_steps_and_stale_heartbeats_of_this_launch(tmp_path):
    beats = {0: beat(0, 7, "agree", 0.5), 1: beat(1, 7, "compute", 1.0), 2: beat(2, 6, "compute", 1.0),
             3: beat(3, 7, "save", 40.0), 4: beat(4, 2, "data", 1.0, launch="an earlier launch")}
    for r, b in beats.items():
        (tmp_path / f"rank-{r}.json").write_text(json.dumps(b))
    (tmp_path / "rank-5.json").write_text('{"rank": 5, "st')  # torn: ignored
    seen = watchdog.read_heartbeats(tmp_path, "L")
    assert sorted(seen) == [0, 1, 2, 3]
    late = watchdog.behind(7, seen, me=0, now=1000.0, stale_s=15.0)
    assert [(b["rank"], b["why"]) for b in late] == [(2, "lower step"), (3, "stale heartbeat")]
    assert late[1]["phase"] == "save" and late[1]["heartbeat_age_s"] == 40.0


class FakeTime:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_firing_rank_and_a_joining_rank_in_one_process(tmp_path, monkeypatch):
    """Rank 1 stuck in its collective past the timeout, rank 0's heartbeat stale (rank 0 is the frozen one,
    so the manifest is rank 1's to write): rank 1 dumps its stacks, writes the summary naming rank 0, records
    "hung" in the manifest, leaves 11 for the launcher and exits 11. A rank 2 that is still alive joins the
    same directory and exits 11 too."""
    run_dir = tmp_path / "run"
    manifest.write_or_extend(run_dir, run_id="run", config_hash="x", profile="cpu", seed=1, world_size=3, hosts=["h"],
                             resumed_from=None, rank0_only=False)
    monkeypatch.setenv("ZEROTRAIN_EXIT_FILE", str(tmp_path / "exit_code"))
    now = FakeTime()
    clock = PhaseClock(clock=now)
    exits = []
    dog = watchdog.Watchdog(clock, run_dir, 1, 3, "L", 8, exit_fn=exits.append, now=now)
    dog.beat_dir.mkdir(parents=True)
    (dog.beat_dir / "rank-0.json").write_text(json.dumps(beat(0, 4, "compute", 30.0, now=now.t)))
    with clock.phase("data"):
        pass
    clock.set_step(5)
    with clock.phase("agree"):
        now.t += 5
        dog.check()  # a heartbeat, nothing else
        assert exits == [] and json.loads(dog.beat_path.read_text())["phase"] == "agree"
        now.t += 4  # 9 s in "agree" > 8
        dog.check()
    assert exits == [EXIT_HUNG]
    (hang_dir,) = [p for p in (run_dir / "hangs").iterdir() if p.name != "heartbeat"]
    assert hang_dir.name.endswith("-step5")
    summary = json.loads((hang_dir / "summary.json").read_text())
    assert (summary["fired_by"], summary["step"], summary["phase"]) == (1, 5, "agree")
    assert [(b["rank"], b["step"], b["why"]) for b in summary["behind"]] == [(0, 4, "lower step, stale heartbeat")]
    assert summary["no_heartbeat"] == [2] and summary["stacks"] == ["rank-1.txt"]
    assert summary["where"]["1"]["in_collective"] is False and summary["outside_collectives"] == []
    assert summary["message"].startswith("rank 1 hung in agree at step 5 for 9 s; behind: rank 0 (step 4, compute")
    stacks = (hang_dir / "rank-1.txt").read_text()
    assert "step 5, phase agree" in stacks and "test_a_firing_rank_and_a_joining_rank" in stacks  # this thread
    # torch's flight recorder of this process's collectives, beside the stacks (NCCL's on a GPU; empty here)
    assert "pg_status" in json.loads((hang_dir / "rank-1.flight_recorder.json").read_text())
    end = manifest.read_manifest(run_dir)["segments"][-1]
    assert (end["end_reason"], end["end_exit_code"]) == ("hung", EXIT_HUNG)
    assert (tmp_path / "exit_code").read_text() == f"{EXIT_HUNG}\n"

    # rank 2, alive and still within its own timeout, sees the claim at its next tick and joins
    joined = []
    other = watchdog.Watchdog(PhaseClock(clock=now), run_dir, 2, 3, "L", 8, exit_fn=joined.append, now=now)
    other.check()
    assert joined == [EXIT_HUNG] and (hang_dir / "rank-2.txt").is_file()
    assert "joined the hang rank 1 reported" in (hang_dir / "rank-2.txt").read_text()


def test_the_flag_and_the_profile_keys_are_checked():
    assert resolve_config(["--data", "m.json", "--hang-timeout", "90"]).observe.hang_timeout == 90
    assert resolve_config(["--data", "m.json", "--hang-timeout", "0"]).observe.hang_timeout == 0
    for bad in ("-5", "abc", "nan"):
        with pytest.raises(UsageError, match="hang-timeout"):
            resolve_config(["--data", "m.json", "--hang-timeout", bad])
    cfg = resolve_config(["--data", "m.json", "--hang-timeout", "30"])
    assert "hang_timeout" not in identity(cfg)  # how the run is watched, not what it trains
    validate_profile({"zerotrain": {"hang_timeout": 0, "comm_timeout_s": 120}}, "p")
    for key, bad in (("hang_timeout", -1), ("hang_timeout", "10"), ("comm_timeout_s", 0), ("comm_timeout_s", True)):
        with pytest.raises(UsageError, match=f"zerotrain.{key}"):
            validate_profile({"zerotrain": {key: bad}}, "p")
    assert comm_timeout_s({}) == 1800 and comm_timeout_s({}, 3600) == 7200
    assert comm_timeout_s({"comm_timeout_s": 120}, 3600) == 120


def test_the_hang_hook(tmp_path):
    assert TestHooks.from_env({"ZEROTRAIN_TEST_HANG": "1:save:3"}).hang == {(1, "save", 3)}
    assert TestHooks.from_env({"ZEROTRAIN_TEST_HANG": "1:eval:2,0:save:3"}).hang == {(1, "eval", 2), (0, "save", 3)}
    for bad in ("1:compute:3", "1:save", "x:eval:2", "1:eval:2,", "1:eval:2,1:compute:3"):
        with pytest.raises(UsageError, match="ZEROTRAIN_TEST_HANG"):
            TestHooks.from_env({"ZEROTRAIN_TEST_HANG": bad})
    TestHooks().hang_here(1, "save", 3)  # no hook: returns
    # each hang once per run directory: one the watchdog reported is gone past, another one still holds
    hooks = TestHooks.from_env({"ZEROTRAIN_TEST_HANG": "1:eval:2,1:save:3"})
    reported = tmp_path / "hangs" / "20261127-step2"
    reported.mkdir(parents=True)
    (reported / "summary.json").write_text(json.dumps({"phase": "eval", "step": 2}))
    hooks.hang_here(1, "eval", 2, tmp_path)  # returns
    hooks.hang_here(0, "save", 3, tmp_path)  # another rank: returns
    assert hang_reported(tmp_path, "save", 3) is False and hang_reported(tmp_path, "eval", 2) is True


# -- real ranks ---------------------------------------------------------------------------------------

def hang_dirs_of(run_dir: Path) -> dict[tuple[str, int], Path]:
    """(phase, step) -> the hangs/<time>-step<S>/ directory the watchdog wrote for it."""
    dirs = [p for p in (run_dir / "hangs").iterdir() if p.name != "heartbeat"]
    return {(s["phase"], s["step"]): d for d in dirs for s in [json.loads((d / "summary.json").read_text())]}


# the shared reference run's flags (conftest: evaluated every 2 steps), with a save every 3: the run the save and
# eval hangs interrupt, whose history (conftest's reference_history) their restarts must reproduce
HANG_FLAGS = [*REFERENCE_FLAGS, "--eval-every-steps", "2", "--save-every-steps", "3"]
HANGS = [("eval", 2), ("save", 3)]


@pytest.mark.launches
def test_a_rank_blocked_inside_an_evaluation_then_a_save_is_detected_restarted_and_exact(
        tmp_path, mix_path, launched, reference_history):
    """Rank 1 blocks inside the step-2 evaluation, and (in the restarted job) inside the step-3 save (the hook:
    each once per run directory); rank 0 waits in that phase's collective until its watchdog fires; `zerotrain
    launch --max-restarts 2` starts the job again with --resume auto each time and the run ends with the
    uninterrupted run's losses, bit for bit."""
    run_dir = tmp_path / "r"
    proc = start(tmp_path, launched, ["--max-restarts", "2", "--restart-backoff", "0"],
                 ["--data", str(mix_path), "--out", str(tmp_path), "--run-id", "r", *HANG_FLAGS, "--hang-timeout", "6"],
                 {"ZEROTRAIN_TEST_HANG": ",".join(f"1:{phase}:{step}" for phase, step in HANGS)})
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    hang_dirs = hang_dirs_of(run_dir)
    assert sorted(hang_dirs) == sorted(HANGS), hang_dirs
    for phase, step in HANGS:
        hang_dir = hang_dirs[phase, step]
        summary = json.loads((hang_dir / "summary.json").read_text())
        assert summary["stacks"] == ["rank-0.txt", "rank-1.txt"]  # both alive: one fired, the other joined
        assert "hang_here" in (hang_dir / "rank-1.txt").read_text()
        # rank 0 waits in a collective (the save's all-gather, ZeRO-3's gathers in the evaluation's forward);
        # rank 1 does not: the summary and the line name it with its frame
        assert summary["where"]["0"]["in_collective"] and summary["outside_collectives"] == [1], summary
        assert f"hung in {phase} at step {step}" in out
    assert out.count("behind: none; outside any collective: rank 1 (hooks.py:") == 2
    record = manifest.read_manifest(run_dir)
    assert [(r["kind"], r["exit_code"]) for r in record["restarts"]] == [("hung", EXIT_HUNG)] * 2
    assert [s["end_reason"] for s in record["segments"]] == ["hung", "hung", "finished"]
    history = read_metrics(run_dir)
    assert [m["loss"] for m in history] == [m["loss"] for m in reference_history]  # exact floats
    assert [m["tokens_sha"] for m in history] == [m["tokens_sha"] for m in reference_history]
    assert [m.get("val_loss") for m in history] == [m.get("val_loss") for m in reference_history]
