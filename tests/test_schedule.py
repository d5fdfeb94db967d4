"""The learning-rate schedules (launcher/components/schedule.py): the lr of every step, and what a resumed run's
schedule does when --max-steps changed."""
import math

import pytest

from zerotrain.launcher.components.schedule import Schedule


def lrs(schedule, steps):
    """The multiplier each 1-based step trains with (LambdaLR hands index s to step s + 1)."""
    return [schedule(s - 1) for s in range(1, steps + 1)]


def test_warmup_then_cosine_to_min():
    f = Schedule(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.55) and f(14) == pytest.approx(0.1)
    assert f(100) == pytest.approx(0.1)  # past the end it stays at the floor
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def test_wsd_holds_the_peak_then_decays_linearly_to_min_at_the_last_step():
    f = Schedule(lr=1.0, min_lr=0.1, warmup_steps=2, max_steps=10, kind="wsd", decay_fraction=0.2)
    assert f.decay_start == 8
    assert lrs(f, 10) == pytest.approx([0.5, 1.0, 1, 1, 1, 1, 1, 1, 0.55, 0.1])
    assert f.describe(3e-3) == ("schedule wsd: warmup 2 step(s) to lr 0.003, held to step 8, then linear decay over"
                                " steps 9-10 to 0.0003")
    long = Schedule(1.0, 0.0, 0, 100, "wsd", 0.25)  # no warmup, decay to 0 over the last 25 steps
    assert lrs(long, 100)[:75] == [1.0] * 75 and lrs(long, 100)[75:] == pytest.approx([1 - k / 25 for k in range(1, 26)])


def test_wsd_resumed_in_its_stable_phase_replans_the_decay_for_the_new_length():
    f = Schedule(1.0, 0.1, 2, 10, "wsd", 0.2)
    lines = f.resume(step=4, max_steps=20, lr=1.0)
    assert "resumed at step 4 in its stable phase: decay re-planned for --max-steps 20" in lines[0]
    assert (f.total, f.decay_start) == (20, 16)
    assert lrs(f, 20)[4:] == pytest.approx([1.0] * 12 + [0.775, 0.55, 0.325, 0.1])  # steps 5-20
    shorter = Schedule(1.0, 0.1, 2, 100, "wsd", 0.2)  # shortened below what was planned, still stable
    shorter.resume(step=10, max_steps=12, lr=1.0)
    assert shorter.decay_start == 10 and lrs(shorter, 12)[10:] == pytest.approx([0.55, 0.1])  # decays from step 11


def test_a_schedule_that_cannot_be_stretched_keeps_its_length_and_says_so():
    cosine = Schedule(1.0, 0.1, 2, 6)
    lines = cosine.resume(step=6, max_steps=10, lr=3e-3)
    assert len(lines) == 1 and "keeps its length, so steps 7-10 train at min-lr 0.0003" in lines[0]
    assert cosine.total == 6 and lrs(cosine, 10)[6:] == pytest.approx([0.1] * 4)
    decaying = Schedule(1.0, 0.1, 2, 10, "wsd", 0.2)
    assert "in its decay: it keeps its length" in decaying.resume(step=9, max_steps=20, lr=1.0)[0]
    assert decaying.total == 10
    assert Schedule(1.0, 0.1, 2, 10).resume(step=4, max_steps=10, lr=1.0) == []  # same length: nothing to say


def test_a_plan_shorter_than_its_warmup_says_what_the_steps_past_it_train_at():
    """A cosine run of 6 steps with a 10-step warmup, extended to 14: the saved plan's warmup goes on past the
    plan (the lr rises to the peak), then the lr falls to min-lr; the line says so step by step. It used to say
    "steps 7-14 train at min-lr". (A wsd plan resumed there is re-planned: its decay starts after the warmup.)"""
    plan = Schedule(1.0, 0.1, 10, 6)
    (line,) = plan.resume(step=6, max_steps=14, lr=1.0)
    got = lrs(plan, 14)
    assert got[6:10] == pytest.approx([0.7, 0.8, 0.9, 1.0])  # steps 7-10: the warmup goes on
    assert "so steps 7-10 go on with its warmup of 10 steps (longer than the plan) to lr 1, " in line
    above = [k for k in range(11, 15) if not math.isclose(got[k - 1], 0.1)]  # steps above min-lr after it
    assert above == [11] and "step 11 at lr 1, steps 12-14 at min-lr 0.1;" in line
    assert got[11:] == pytest.approx([0.1] * 3)


def test_checkpoints_of_the_cosine_only_class_load_into_a_schedule():
    # LambdaLR.load_state_dict updates the lambda object's __dict__ with what the checkpoint saved; before
    # wsd existed that was {min_ratio, warmup, total}.
    f = Schedule(1.0, 0.1, 2, 50)
    f.__dict__.update({"min_ratio": 0.1, "warmup": 4, "total": 14})
    assert f(9) == pytest.approx(0.55) and f.kind == "cosine"
