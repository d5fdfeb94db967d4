"""The health check (launcher/components/observe/health.py): a run that knows how fast it should be.

The policy is fed numbers by hand (no process group): window shares and MFU, the consecutive windows
before a verdict, its de-duplication and repetition, recovery, straggler naming and the messages. One
real launch (deepspeed, 2 CPU ranks, gloo, the debug model, 20 steps) with a slow data source
(ZEROTRAIN_TEST_SLOW_DATA: 0.2 s a batch, rank 1 0.3 s) and a profile whose threshold no CPU reaches
shows the verdict end to end: metrics.jsonl, the TensorBoard events, `zerotrain runs` and `report`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_profile, free_port, launch
from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from zerotrain.launcher.components.observe.health import DEFAULTS, LABELS, REMEDIES, HealthCheck, standing
from zerotrain.launcher.components.hooks import SLOW_DATA, TestHooks
from zerotrain.launcher.components.observe.metrics import read_metrics
from zerotrain.launcher.components.observe.phases import PHASES
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import validate_profile
from zerotrain.launcher.settings import HEALTH_DEFAULTS as HEALTH_KEYS, resolve

REPO = Path(__file__).resolve().parent.parent
SLOW = {"data": 0.6, "compute": 0.3, "agree": 0.1}  # a step of 1 s, mostly waiting for data
FAST = {"data": 0.01, "compute": 0.98, "agree": 0.01}
# Windows of 1 s. One step of 1 s: MFU 50 FLOPs / 1 s / 500 = 0.1, below the threshold 0.3; eight steps of
# 0.125 s: MFU 0.8, above it.
SLOW_WINDOW = [(1.0, SLOW)]
FAST_WINDOW = [(0.125, {"compute": 0.125})] * 8


def check(world: int = 1, peak: float | None = 500.0, **knobs) -> HealthCheck:
    """Tokens x FLOPs per step = 50 on peak 500 per rank; threshold 0.3 (see SLOW_WINDOW, FAST_WINDOW)."""
    return HealthCheck(world=world, tokens_per_step=10, flops_per_token=5.0, peak_flops=peak, expected_mfu=0.4,
                       threshold=0.3, threshold_source="test", **{"window_s": 1.0, **knobs})


def feed(health: HealthCheck, steps: list[tuple[float, dict]], rank_seconds=None) -> list[dict]:
    """Every verdict of these (wall, phases) steps, in order."""
    verdicts = []
    for wall, phases in steps:
        closed = health.add_step(0, wall, phases, rank_seconds)
        if closed:
            verdicts += closed[1]
    return verdicts


# -- windows: shares and MFU ------------------------------------------------------------------------------

def test_a_window_closes_after_window_s_and_carries_its_shares_and_mfu():
    health = check(window_s=2.0, peak=100.0)
    assert health.add_step(1, 0.5, {"data": 0.25, "compute": 0.25}) is None
    assert health.add_step(2, 1.0, {"data": 0.1, "compute": 0.8, "agree": 0.1}) is None  # 1.5 s < 2 s
    window, verdicts = health.add_step(3, 0.5, {"compute": 0.5})
    assert verdicts == []  # the first window (start-up) is logged, not judged
    assert (window.step, window.steps, window.wall_s) == (3, 3, 2.0)
    figures = window.figures()
    assert figures["time_shares"] == {"agree": 0.05, "compute": 0.775, "data": 0.175}
    assert sum(figures["time_shares"].values()) == pytest.approx(1.0)
    assert figures["window_mfu"] == pytest.approx(3 * 10 * 5.0 / 2.0 / 100.0)  # 3 steps' FLOPs / wall / peak
    assert figures["window_s"] == 2.0
    assert health.add_step(4, 0.5, {"compute": 0.5}) is None  # a new window begins


def test_mfu_counts_every_rank_and_no_peak_means_shares_only():
    window, _ = check(world=4).add_step(1, 1.0, FAST, [(1.0, 0.0)] * 4)
    assert window.mfu == pytest.approx(50 / 1.0 / (500.0 * 4))
    health = check(peak=None)
    window, _ = health.add_step(1, 1.0, SLOW)
    assert "window_mfu" not in window.figures() and window.figures()["time_shares"]["data"] == 0.6
    assert feed(health, [(1.0, SLOW)] * 10) == []  # no peak, no MFU verdict
    assert "no MFU verdict" in health.describe()


# -- the throughput verdict ---------------------------------------------------------------------------------

def test_slow_for_several_windows_is_one_event_naming_the_largest_share_and_a_remedy():
    health = check()
    assert feed(health, SLOW_WINDOW * 3) == []  # start-up + 2 slow windows: not yet
    (verdict,) = feed(health, SLOW_WINDOW)  # the third slow window
    assert verdict["topic"] == "throughput" and verdict["verdict"] == "slow" and verdict["ok"] is False
    assert verdict["phase"] == "data" and verdict["mfu"] == pytest.approx(0.1)
    assert verdict["message"] == (
        "MFU 10.0% over the last 3 windows (expected 40%, below the threshold 30.0%); data wait 60% of wall time"
        " (then compute 30%, agreement 10%): the loader cannot keep up; raise the profile's"
        " zerotrain.dataloader.workers or prepare shards (zerotrain prepare) on a fast local disk")
    assert verdict["summary"] == "slow: data wait 60%"
    assert feed(health, SLOW_WINDOW * 20) == []  # the same diagnosis is not said again every window


def test_a_fast_window_breaks_the_streak():
    health = check()
    assert feed(health, SLOW_WINDOW * 3 + FAST_WINDOW + SLOW_WINDOW * 2) == []
    assert [v["verdict"] for v in feed(health, SLOW_WINDOW)] == ["slow"]  # 3 slow windows since the fast one


def test_a_new_diagnosis_is_said_and_a_standing_one_is_repeated_after_repeat_s():
    health = check(repeat_s=10.0)
    assert [v["phase"] for v in feed(health, SLOW_WINDOW * 4)] == ["data"]
    saving = {"save": 0.7, "compute": 0.3}
    assert feed(health, [(1.0, saving)]) == []  # the last 3 windows: data 40%, save 23%
    (verdict,) = feed(health, [(1.0, saving)])  # save 47%, data 20%: a new diagnosis
    assert verdict["phase"] == "save" and "; saving 47% of wall time (then compute 30%, data wait 20%): saving" \
        " blocks the loop: save less often" in verdict["message"]
    # said after 7 s of windows (the start-up window's included): said again 10 s later
    assert feed(health, [(1.0, saving)] * 9) == []
    assert [v["phase"] for v in feed(health, [(1.0, saving)])] == ["save"]


def test_recovery_is_said_once_after_several_fast_windows():
    health = check()
    assert len(feed(health, SLOW_WINDOW * 4)) == 1
    assert feed(health, FAST_WINDOW * 2) == []
    (verdict,) = feed(health, FAST_WINDOW)
    assert verdict["verdict"] == "recovered" and verdict["ok"] and verdict["summary"] == "ok"
    assert verdict["message"] == "MFU 80.0% over the last 3 windows, back above the threshold 30.0%"
    assert feed(health, FAST_WINDOW * 5) == []
    assert [v["verdict"] for v in feed(health, SLOW_WINDOW * 3)] == ["slow"]  # slow again: said again


@pytest.mark.parametrize("phase", ["compute", "agree", "eval", "save", "mirror", "log"])
def test_every_phase_has_its_remedy_in_the_message(phase):
    health = check()
    steps = [(1.0, {phase: 0.8, "data": 0.2})] * 4
    (verdict,) = feed(health, steps)
    assert verdict["phase"] == phase and verdict["message"].endswith(REMEDIES[phase])
    assert f"{LABELS[phase]} 80% of wall time" in verdict["message"]


def test_every_phase_of_the_clock_has_a_label_and_a_remedy():
    assert set(PHASES) <= set(LABELS) and set(PHASES) <= set(REMEDIES)


# -- stragglers ----------------------------------------------------------------------------------------------

def ranks(work: list[float], data: list[float] | None = None) -> list[tuple[float, float]]:
    return list(zip(work, data or [0.0] * len(work)))


def test_a_rank_consistently_slower_than_the_others_is_named():
    health = check(world=4, peak=None)
    slow_data = ranks([1.0, 1.05, 0.95, 1.4], [0.1, 0.1, 0.1, 0.5])
    assert feed(health, [(1.0, FAST)] * 3, slow_data) == []  # start-up + 2 windows
    (verdict,) = feed(health, [(1.0, FAST)], slow_data)
    assert verdict["topic"] == "stragglers" and verdict["ranks"] == [3] and verdict["ratios"] == {"3": 1.4}
    assert verdict["message"] == (
        "rank 3 is 1.4x slower than the median of the other ranks (step work 1.4 s vs 1 s a step, data wait"
        " 0.5 s vs 0.1 s; mostly data wait: that rank's loader or disk is slow)")
    assert verdict["summary"] == "straggler: rank 3 1.4x"
    assert feed(health, [(1.0, FAST)] * 10, slow_data) == []  # said once
    # rank 3 recovers: said once, after the same number of windows
    even = ranks([1.0, 1.05, 0.95, 1.02])
    assert feed(health, [(1.0, FAST)] * 2, even) == []
    (verdict,) = feed(health, [(1.0, FAST)], even)
    assert verdict["verdict"] == "no-straggler" and verdict["ok"] and "was: rank 3" in verdict["message"]


def test_a_straggler_without_data_wait_and_jitter_below_the_ratio():
    health = check(world=3, peak=None)
    verdicts = feed(health, [(1.0, FAST)] * 4, ranks([2.0, 1.3, 1.0]))
    assert [v["ranks"] for v in verdicts] == [[0]]
    assert "rank 0 is 1.7x slower" in verdicts[0]["message"] and "not data wait" in verdicts[0]["message"]
    health = check(world=3, peak=None)
    assert feed(health, [(1.0, FAST)] * 10, ranks([1.15, 1.0, 1.05])) == []  # under 1.2x: noise
    # slower in one window out of each two: not consistent
    health = check(world=3, peak=None)
    for _ in range(10):
        assert feed(health, [(1.0, FAST)], ranks([1.5, 1.0, 1.0])) + feed(health, [(1.0, FAST)], ranks([1.0] * 3)) == []


def test_one_rank_has_no_stragglers():
    assert feed(check(world=1, peak=None), [(1.0, FAST)] * 10, ranks([1.0])) == []


# -- what runs and report show: the verdicts that still stand ------------------------------------------------

def test_standing_verdicts():
    slow = {"event": "health", "topic": "throughput", "ok": False, "summary": "slow: data wait 60%"}
    straggler = {"event": "health", "topic": "stragglers", "ok": False, "summary": "straggler: rank 3 1.4x"}
    ok = {"event": "health", "topic": "throughput", "ok": True, "summary": "ok"}
    assert standing([slow, straggler]) == [slow, straggler]
    assert standing([slow, straggler, ok]) == [straggler]
    assert standing([slow, {"event": "resume", "step": 5}]) == []  # a new launch judges afresh
    assert standing([{"event": "stop"}]) == []


# -- knobs and the test hook ------------------------------------------------------------------------------

def test_profile_knobs_are_validated_before_anything_runs():
    assert set(HEALTH_KEYS) == set(DEFAULTS)
    zt = {"expected_mfu": 0.5, "peak_flops_per_device": 1e12, "health": {"window_s": 30, "windows": 2}}
    validate_profile({"zerotrain": zt}, "p")
    health = HealthCheck.from_settings(resolve(None, "p", {"zerotrain": zt}), world=2, tokens_per_step=1,
                                       flops_per_token=1.0)
    assert (health.window_s, health.windows, health.straggler_ratio) == (30.0, 2, 1.2)
    assert health.threshold == pytest.approx(0.375)  # 0.75 x expected_mfu: the rule in launcher/settings.py
    for bad, words in [({"window": 3}, "keys among"), ({"windows": 1.5}, "whole count"), ({"window_s": 0}, "positive"),
                       ({"straggler_ratio": 0.9}, "above 1"), ([], "must be an object")]:
        with pytest.raises(UsageError, match=words):
            validate_profile({"zerotrain": {"health": bad}}, "p")


def test_slow_data_hook():
    hooks = TestHooks.from_env({SLOW_DATA: "0.2,1:0.3"})
    assert [getattr(hooks.slow_training_data(object(), r), "seconds", 0) for r in (0, 1, 2)] == [0.2, 0.3, 0.2]
    loader = object()
    assert TestHooks.from_env({SLOW_DATA: "1:0.3"}).slow_training_data(loader, 0) is loader
    with pytest.raises(UsageError, match=rf"^{SLOW_DATA}=x: expected"):
        TestHooks.from_env({SLOW_DATA: "x"})


# -- the sinks: a verdict as text, the shares as scalars ----------------------------------------------------

def test_wandb_gets_the_verdict_and_the_shares(tmp_path, monkeypatch):
    """W&B (offline, read back from its own run file): `health` at the verdict's step, beside that step's shares."""
    from test_observability import wandb_offline_runs
    from zerotrain.launcher.components.observe.metrics import MetricsLogger
    from zerotrain.launcher.config import RunConfig

    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "wb-run"
    run.mkdir()
    logger = MetricsLogger(run, True, RunConfig.from_flat(dict(data="mix.json", log="wandb")))
    logger.log({"step": 1, "loss": 2.0})
    logger.log({"step": 2, "loss": 1.0, "time_shares": {"data": 0.75, "compute": 0.25}, "window_mfu": 0.1})
    logger.event("health", 2, topic="throughput", verdict="slow", ok=False, message="data wait 75% of wall time",
                 summary="slow: data wait 75%")
    logger.log({"step": 3, "loss": 0.5})
    logger.close()
    (wandb_run,) = wandb_offline_runs(run)
    assert wandb_run["history"][2] == {"loss": 1.0, "time_shares/data": 0.75, "time_shares/compute": 0.25,
                                       "window_mfu": 0.1, "health": "data wait 75% of wall time"}
    assert wandb_run["history"][3] == {"loss": 0.5}


# -- one real launch ---------------------------------------------------------------------------------------

def tensorboard(log_dir: Path) -> tuple[dict, dict]:
    """(scalars tag -> [(step, value)], text tag -> [(step, text)]) as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"]}
    return scalars, texts


@pytest.mark.launches
def test_a_slow_data_source_is_named_by_a_real_launch(tmp_path, mix_path):
    profile = json.loads(Path(cpu_profile(tmp_path)).read_text())
    # No CPU reaches 100% of its peak: the verdict does not depend on this machine's speed. Windows of 1 s. Each
    # micro-batch's data held 2 s (3 s on rank 1): the verdict, over the first 3 windows, names the data wait even
    # where a loaded host makes the first step's compute take seconds (with 0.2 s it named compute under load)
    profile["zerotrain"].update(expected_mfu=1.0, mfu_threshold=1.0,
                                health={"window_s": 1.0, "windows": 3, "straggler_ratio": 1.1})
    (tmp_path / "slow.json").write_text(json.dumps(profile))
    out = tmp_path / "runs"
    port = free_port()
    try:
        proc = launch("deepspeed", ["--data", str(mix_path), "--model", "debug",
                                    "--profile", str(tmp_path / "slow.json"), "--seq-len", "64", "--micro-batch", "2",
                                    "--max-steps", "8", "--out", str(out), "--run-id", "slow-data",
                                    "--resume", "never", "--log", "tensorboard"],
                      env_extra={SLOW_DATA: "2,1:3"}, timeout=300, port=port)
    finally:
        for f in allreduce_buffer_files(port):  # this launch's only: another beside it (xdist) keeps its own
            f.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = out / "slow-data"
    events = [e for e in read_metrics(run, events=True) if e["event"] == "health"]
    slow = [e for e in events if e["verdict"] == "slow"]
    assert len(slow) == 1 and slow[0]["phase"] == "data", events  # said once, naming the data wait
    assert "of wall time" in slow[0]["message"] and "the loader cannot keep up" in slow[0]["message"]
    assert slow[0]["time_shares"]["data"] > 0.3
    stragglers = [e for e in events if e["verdict"] == "straggler"]
    assert [e["ranks"] for e in stragglers] == [[1]] and "mostly data wait" in stragglers[0]["message"]
    assert "zerotrain: health: MFU " in proc.stdout

    history = read_metrics(run)
    windows = [r for r in history if "time_shares" in r]
    assert len(windows) >= 4 and all(sum(r["time_shares"].values()) == pytest.approx(1, abs=1e-3) for r in windows)
    scalars, texts = tensorboard(run / "tensorboard")
    # a window logs the phases it saw: one with no data wait (the last batch ready before its step, as a loader
    # ahead of the loop leaves it on a fast host) has no `data` share, and TensorBoard no point at its step
    assert scalars["time_shares/data"] == [(r["step"], pytest.approx(r["time_shares"]["data"], rel=1e-5))
                                           for r in windows if "data" in r["time_shares"]]
    assert len(scalars["time_shares/data"]) >= 3
    assert [s for s, _ in scalars["window_mfu"]] == [r["step"] for r in windows]
    assert [text for _, text in texts["health/text_summary"]] == [e["message"] for e in events]

    runs = subprocess.run([sys.executable, "-m", "zerotrain", "runs", str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert runs.returncode == 0, runs.stderr
    header, row = runs.stdout.splitlines()
    # the events' own summaries (formatted from the unrounded figures: the recorded ratio is rounded to 3 places,
    # and 1.4504 -> 1.45 would print 1.4x where the summary says 1.5x), and those agree with the recorded figures
    assert header.split()[-1] == "health" and row.endswith(f"{slow[0]['summary']}; {stragglers[0]['summary']}")
    assert slow[0]["summary"].startswith("slow: data wait ")
    assert abs(float(slow[0]["summary"].split()[-1].rstrip("%")) / 100 - slow[0]["time_shares"]["data"]) <= 0.006
    assert stragglers[0]["summary"].startswith("straggler: rank 1 ")
    assert abs(float(stragglers[0]["summary"].split()[-1].rstrip("x")) - stragglers[0]["ratios"]["1"]) <= 0.051
    report = subprocess.run([sys.executable, "-m", "zerotrain", "report", str(run)], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert report.returncode == 0, report.stderr
    text = (run / "report" / "report.md").read_text()
    assert "## Health (metrics.jsonl)" in text and f"- step {slow[0]['step']}: **slow**: {slow[0]['message']}" in text
    assert "| where the wall time went (health windows) | data wait " in text
    assert (run / "report" / "time_shares.png").is_file()
