"""Stop policies without a process group: signals, spikes, budgets, early stopping (non-finite values: the
Trainer's own check, tests/test_train_integration.py; the end kinds: tests/test_end_kinds.py)."""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zerotrain.launcher.components.guards import Budget, EarlyStopping, SignalStop, SpikeDetector
from zerotrain.launcher.ends import EXIT_SIGNAL_HARD
from zerotrain.launcher.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


# -- spikes ---------------------------------------------------------------------------------
def falling_curve(n: int, seed: int, noise: float = 0.08) -> list[float]:
    """A pretraining-like loss: fast fall from ~6 to ~2, multiplicative noise on every step."""
    rng = random.Random(seed)
    return [(2.0 + 4.0 * math.exp(-t / 60)) * (1 + rng.gauss(0, noise)) for t in range(n)]


def decisions(det: SpikeDetector, losses) -> list[int]:
    """The indices at which the detector reports a spike."""
    return [i for i, x in enumerate(losses) if det.update(x)]


@pytest.mark.parametrize("seed", range(5))
def test_falling_noisy_loss_is_never_a_spike(seed):
    # Noise of 8% per step, including the steep first steps of training (no warm-up false alarms).
    assert decisions(SpikeDetector(), falling_curve(3000, seed)) == []
    # Even 25% noise on a 2-sample-per-step curve does not make three doublings in a row.
    assert decisions(SpikeDetector(), falling_curve(3000, seed, noise=0.25)) == []


def test_early_rise_during_warmup_is_not_judged():
    # Too high a learning rate in the first steps: the loss more than doubles, then falls.
    early = [3.0, 3.1, 7.0, 8.0, 7.5, 6.9] + [6.0 - 0.1 * i for i in range(19)]
    det = SpikeDetector(window=50)  # judges nothing before 25 losses
    assert decisions(det, early) == []
    assert det.threshold() is not None  # 25 losses now: judging starts
    assert decisions(SpikeDetector(window=50, min_history=2), early) == [4]  # what a short baseline would say


@pytest.mark.parametrize("m", [1, 3, 5])
def test_x3_jump_for_m_steps_is_one_spike_m_minus_1_is_none(m):
    base = falling_curve(300, seed=1, noise=0.05)
    det = SpikeDetector(consecutive=m)
    assert decisions(det, base) == []
    # m - 1 steps at three times the loss, then back to normal: no spike
    if m > 1:
        assert decisions(det, [3 * base[-1]] * (m - 1) + base[-20:]) == []
    # m steps at three times the loss: reported at the m-th
    assert decisions(det, [3 * base[-1]] * m) == [m - 1]
    assert det.spikes == 1 and det.streak == m


def test_spike_steps_stay_out_of_the_window_and_report_once():
    det = SpikeDetector(window=50, factor=2.0, consecutive=3)
    decisions(det, [2.0 + 0.01 * (i % 5) for i in range(100)])
    before = list(det.history)
    # A long spike: reported once, the baseline never moves, so it never hides itself.
    assert decisions(det, [6.0] * 200) == [2]
    assert list(det.history) == before and det.streak == 200
    assert "above 2 x the median 2.02" in det.explain()
    # Recovery (an accepted loss ends the streak), then a second spike is reported again.
    assert decisions(det, [2.01] * 10 + [7.0] * 3) == [12]
    assert det.spikes == 2


def test_non_finite_loss_counts_as_a_spike_step_and_never_enters_the_window():
    det = SpikeDetector(consecutive=2)
    decisions(det, [2.0] * 40)
    assert decisions(det, [float("nan"), float("inf")]) == [1]
    assert all(math.isfinite(x) for x in det.history)


def test_near_zero_loss_noise_is_not_a_spike():
    # A memorising fine-tune: loss ~0.01 with big relative noise; a rise below min_increase (0.1) is no spike.
    rng = random.Random(0)
    assert decisions(SpikeDetector(), [0.01 * (1 + 3 * rng.random()) for _ in range(2000)]) == []


def test_spike_detector_state_round_trip_gives_the_same_decisions():
    rng = random.Random(7)
    losses = falling_curve(400, seed=3, noise=0.05)
    for start, length in ((120, 2), (260, 3), (330, 4)):  # the spike of 2 steps is not reported
        for i in range(start, start + length):
            losses[i] *= 3 + rng.random()
    reference = SpikeDetector()
    expected = decisions(reference, losses)
    assert expected == [262, 332]
    for cut in (10, 121, 200, 262, 332):  # in the warm-up, mid-streak (streak 1 and 2), between spikes
        first = SpikeDetector()
        got = decisions(first, losses[:cut])
        resumed = SpikeDetector()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # travels as JSON-safe data
        got += [cut + i for i in decisions(resumed, losses[cut:])]
        assert got == expected, cut
        assert resumed.spikes == reference.spikes


def test_spike_detector_refuses_bad_settings():
    for kwargs, words in [({"window": 0}, "--spike-window"), ({"factor": 1.0}, "--spike-factor"),
                          ({"factor": float("nan")}, "--spike-factor"), ({"consecutive": -1}, "--spike-consecutive")]:
        with pytest.raises(UsageError, match=words):
            SpikeDetector(**kwargs)


# -- budgets --------------------------------------------------------------------------------
def run_until_budget(budget: Budget, elapsed_s: float, step_time_s: float, tokens_seen: int = 0,
                     tokens_per_step: int = 4096, reserve_s: float = 0.0, max_steps: int = 10**6):
    """A fake loop: ask before each step, run it if it fits. Returns (steps run, elapsed, reason)."""
    steps = 0
    while steps < max_steps:
        reason = budget.exceeded_after_next(elapsed_s, step_time_s, tokens_seen, tokens_per_step, reserve_s)
        if reason:
            return steps, elapsed_s, reason
        elapsed_s += step_time_s
        tokens_seen += tokens_per_step
        steps += 1
    return steps, elapsed_s, None


def test_max_hours_fraction_stops_at_the_last_step_that_fits():
    b = Budget(max_hours=0.01)  # 36 s
    steps, elapsed, reason = run_until_budget(b, 0.0, 5.0)
    assert steps == 7 and elapsed == 35.0  # the 8th would end at 40 s > 36 s
    assert reason.startswith("--max-hours 0.01 (36.0s) reached")
    assert b.steps_left(0.0, 5.0, 0, 4096) == 7
    # A step that ends exactly on the limit still fits.
    assert run_until_budget(Budget(max_hours=0.01), 0.0, 6.0)[0] == 6
    # Time kept back for the final save.
    assert run_until_budget(Budget(max_hours=0.01), 0.0, 5.0, reserve_s=4.0)[0] == 6
    assert run_until_budget(Budget(max_hours=1.5), 0.0, 100.0)[0] == 54


def test_max_hours_counts_time_across_resumes():
    b = Budget(max_hours=2.5)  # 9000 s, step 700 s -> 12 steps (8400 s)
    first = run_until_budget(b, 0.0, 700.0, max_steps=5)
    assert first[:2] == (5, 3500.0)
    # A new launch resumes from the checkpointed elapsed time and stops at the same total.
    b2 = Budget(max_hours=2.5)
    b2.resume(first[1])
    steps, elapsed, reason = run_until_budget(b2, first[1], 700.0)
    assert (5 + steps, elapsed) == (12, 8400.0) and "--max-hours 2.5" in reason


def test_budget_usd_across_resumes_and_world_sizes():
    # The run: $1000 on 8 H100s at $4/GPU-hour = $32/h = 31.25 h; steps of 10 minutes.
    b = Budget(budget_usd=1000, gpu_hour_usd=4, world=8)
    steps, elapsed, reason = run_until_budget(b, 0.0, 600.0)
    assert steps == 187  # 187 x 600 s = 31.17 h; step 188 would end at 31.33 h
    assert b.spend_usd(elapsed) == pytest.approx(997.33, abs=0.01)
    assert reason.startswith("--budget-usd 1000 reached: $997.33 spent (249.3 GPU-hours at $4/h, every launch at its"
                             " world size; now 8 GPU(s))")

    # Same run in two launches: the second continues from the checkpointed elapsed time.
    first = Budget(budget_usd=1000, gpu_hour_usd=4, world=8)
    s1, e1, _ = run_until_budget(first, 0.0, 600.0, max_steps=100)
    second = Budget(budget_usd=1000, gpu_hour_usd=4, world=8)
    second.resume(e1, first.gpu_seconds(e1))
    s2, e2, _ = run_until_budget(second, e1, 600.0)
    assert (s1 + s2, e2) == (187, elapsed)

    # 10 h on 8 GPUs ($320), then a resume on 4 GPUs: $680 left at $16/h = 42.5 h more.
    eight = Budget(budget_usd=1000, gpu_hour_usd=4, world=8)
    assert eight.spend_usd(36000.0) == pytest.approx(320.0)
    four = Budget(budget_usd=1000, gpu_hour_usd=4, world=4)
    four.resume(36000.0, eight.gpu_seconds(36000.0))
    assert four.spend_usd(36000.0) == pytest.approx(320.0)
    steps, elapsed, _ = run_until_budget(four, 36000.0, 900.0)
    assert steps == 170 and elapsed == 36000.0 + 42.5 * 3600  # 42.5 h is exactly 170 steps of 15 min
    assert four.spend_usd(elapsed) == pytest.approx(1000.0)
    _, _, on_four = run_until_budget(four, elapsed - 900.0, 900.0)  # the spend counts each launch's own world
    assert on_four.startswith("--budget-usd 1000 reached: $1,000.00 spent (250 GPU-hours at $4/h")  # 80 + 170
    tiny = Budget(budget_usd=0.003, gpu_hour_usd=1, world=2)  # a test's budget: its spend below a cent is said
    assert tiny.exceeded_after_next(4.0, 2.0, 0, 1).startswith("--budget-usd 0.003 reached: $0.002222 spent")
    # A checkpoint that did not record GPU-seconds: its world is taken to be this one.
    old = Budget(budget_usd=1000, gpu_hour_usd=4, world=8)
    old.resume(36000.0)
    assert old.spend_usd(36000.0) == pytest.approx(320.0)
    assert "$680.00 left = 21.25 h" in old.describe()


def test_total_tokens_and_the_first_limit_to_bind():
    b = Budget(total_tokens=10_000)
    assert run_until_budget(b, 0.0, 1.0, tokens_per_step=4096)[0] == 2
    assert b.exceeded_after_next(0, 1.0, 8192, 4096).startswith("--total-tokens 10,000 reached: 8,192 tokens")
    with pytest.raises(UsageError, match="--total-tokens 1,000: less than one optimizer step"):
        Budget(total_tokens=1000).check_tokens_per_step(4096)
    both = Budget(max_hours=1, total_tokens=4096 * 50, budget_usd=2, gpu_hour_usd=1, world=4)  # $2 = 30 min
    steps, _, reason = run_until_budget(both, 0.0, 60.0)
    assert steps == 30 and reason.startswith("--budget-usd 2 reached")
    assert both.steps_left(0.0, 60.0, 0, 4096) == 30
    assert both.eta_s(0.0, 60.0, 0, 4096, max_steps_left=1000) == 1800.0
    assert both.eta_s(0.0, 60.0, 0, 4096, max_steps_left=10) == 600.0


def test_no_budget_never_stops_and_spend_needs_a_price():
    b = Budget()
    assert not b.active and b.exceeded_after_next(1e9, 1e6, 10**15, 4096) is None
    assert b.spend_usd(3600) is None and b.steps_left(0, 1, 0, 1) is None
    assert Budget(gpu_hour_usd=2.5, world=2).spend_usd(5400) == pytest.approx(7.5)  # price alone: spend shown


@pytest.mark.parametrize("kwargs, message", [
    ({"budget_usd": 100}, "--budget-usd needs --gpu-hour-usd"),
    ({"max_hours": 0}, "--max-hours: must be a positive number, got 0"),
    ({"max_hours": -1.5}, "--max-hours: must be a positive number, got -1.5"),
    ({"max_hours": float("inf")}, "--max-hours: must be a positive number"),
    ({"total_tokens": 0}, "--total-tokens: must be a positive integer, got 0"),
    ({"total_tokens": 1.5e9}, "--total-tokens: must be a positive integer"),
    ({"budget_usd": -5, "gpu_hour_usd": 2}, "--budget-usd: must be a positive number, got -5"),
    ({"budget_usd": 5, "gpu_hour_usd": 0}, "--gpu-hour-usd: must be a positive number, got 0"),
    ({"max_hours": "3"}, "--max-hours: must be a positive number, got '3'"),
])
def test_budget_refuses_bad_input_with_one_line(kwargs, message):
    with pytest.raises(UsageError) as e:
        Budget(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- early stopping -------------------------------------------------------------------------
def test_early_stopping_counts_evaluations_without_improvement_and_resumes():
    es = EarlyStopping(patience=3)
    vals = [3.0, 2.8, 2.9, 2.85, 2.7, 2.75, 2.71, float("nan"), 2.72]
    improved, stops = [], []
    for v in vals:
        improved.append(es.update(v))
        stops.append(es.should_stop)
    assert improved == [True, True, False, False, True, False, False, False, False]
    assert stops == [False] * 7 + [True, True]  # the 3rd evaluation without a better loss stops (nan counts)
    assert es.best == 2.7 and "no validation loss below 2.7 for 4 evaluations" in es.message()
    # Round trip mid-way gives the same decisions.
    a = EarlyStopping(patience=3)
    for v in vals[:6]:
        a.update(v)
    b = EarlyStopping(patience=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [b.update(v) for v in vals[6:]] == improved[6:] and b.should_stop
    # min_delta: a gain smaller than it is not an improvement.
    c = EarlyStopping(patience=1, min_delta=0.05)
    assert c.update(3.0) and not c.update(2.99) and c.should_stop
    assert EarlyStopping(patience=2).state_dict() == {"best": None, "bad_evals": 0}
    with pytest.raises(UsageError, match="--early-stop-patience: must be a positive integer, got 0"):
        EarlyStopping(0)


# -- signals --------------------------------------------------------------------------------
def test_first_signal_sets_the_flag_duplicates_are_absorbed_and_restore_puts_handlers_back():
    before = {s: signal.getsignal(s) for s in SignalStop.SIGNALS}
    # hard_exit=False: if the grace window broke, the test fails instead of os._exit-ing pytest.
    stop = SignalStop(grace_s=60.0, hard_exit=False, announce=False).install()
    try:
        assert stop.installed and stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)  # CPython runs the handler before os.kill returns
        assert stop.requested == "SIGTERM"
        try:
            os.kill(os.getpid(), signal.SIGINT)  # within the grace window: the same request
        except KeyboardInterrupt:
            pytest.fail("a duplicate signal inside the grace window was taken as a second request")
        assert stop.requested == "SIGTERM"
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in SignalStop.SIGNALS} == before
    stop.restore()  # twice is harmless


def test_second_signal_raises_keyboard_interrupt_when_hard_exit_is_off():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or a background shell, else Python's default
    with SignalStop(grace_s=0.0, hard_exit=False, announce=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before


def test_install_outside_the_main_thread_is_skipped_without_error():
    before = signal.getsignal(signal.SIGTERM)
    result = {}

    def body():
        try:
            stop = SignalStop().install()
            result["installed"] = stop.installed
            stop.restore()
        except Exception as e:  # noqa: BLE001 - the point is that nothing is raised
            result["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert result == {"installed": False}
    assert signal.getsignal(signal.SIGTERM) is before


CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from zerotrain.launcher.components.guards import SignalStop
stop = SignalStop(grace_s=0.3).install()
print("ready", flush=True)
while stop.requested is None:
    time.sleep(0.01)
print("flag", stop.requested, flush=True)
time.sleep(30)
print("not reached", flush=True)
"""


@pytest.mark.launches
def test_second_signal_after_the_grace_window_exits_at_once_in_a_real_process():
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "RANK": "0"})
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "flag SIGTERM\n"
        proc.send_signal(signal.SIGINT)  # still inside the 0.3 s grace window: absorbed
        threading.Event().wait(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_SIGNAL_HARD == 130
    assert "not reached" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("zerotrain: SIGTERM: finishing this step, saving a checkpoint")
    assert lines[1] == "zerotrain: rank 0: second signal (SIGINT) after SIGTERM: exiting now (exit 130), nothing saved"
