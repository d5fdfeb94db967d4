"""The step's participants without a process group (fakes for the run; the gather done by hand over the
rows of a few ranks, as StepRunner.agree does with one all-gather): the named fields reduce the same on every
rank, each monitor's decision is the one the loop acts on, and what survives a resume round-trips."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zerotrain.launcher.components import participants
from zerotrain.launcher.components.guards import Budget, SignalStop
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import (REWOUND, STEP_FIELDS, STEP_PROVIDES, Agreed, Field,
                                                             Layout, Participant, StepState, order)
from zerotrain.launcher.components.participants.budget import BudgetStop
from zerotrain.launcher.components.participants.early_stop import EarlyStop
from zerotrain.launcher.components.participants.finite import Finite
from zerotrain.launcher.components.participants.signals import Signals
from zerotrain.launcher.components.participants.spikes import ROLLBACKS_MAX, Spikes
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.errors import StopRun
from zerotrain.modeling.sizes import PRESETS


def gather(layout: Layout, rows: list[dict]) -> Agreed:
    """What StepRunner.agree's all-gather returns on every rank, from each rank's values."""
    return layout.unpack(torch.stack([layout.pack(values) for values in rows]))


def a_step(step: int = 5, **kw) -> StepState:
    return StepState(step, "sha", 1e-3, step_time=kw.pop("step_time", 1.0), trained_at=kw.pop("trained_at", 100.0),
                     last=kw.pop("last", False), **kw)


class FakeRun:
    """The counters and actions a participant may use (participants/base.py Run, and its `state`: the counters,
    save and rollback of components/run_state.py RunState, the same fake), recorded."""

    def __init__(self, **kw):
        self.step, self.tokens_seen, self.rollbacks, self.last_saved, self.last_save_s = 5, 0, 0, None, 0.0
        self.said, self.rolled_back, self.saves = [], [], 0
        self.state = self
        self.__dict__.update(kw)

    def say(self, line):
        self.said.append(line)

    def elapsed(self, at=None):
        return at

    def save(self):
        self.saves += 1
        return Path("ckpt")

    def rollback(self, what):
        self.rollbacks += 1
        self.rolled_back.append(what)


def test_named_fields_reduce_the_same_on_every_rank():
    layout = Layout(STEP_FIELDS + [Field("flag", "any", "flag"), Field("clock", "rank0", "flag"),
                                   Field("work", "every")])
    losses = [0.1, 0.2, 0.30000000000000004]
    rows = [{"loss_sum": torch.tensor(losses[r], dtype=torch.float64), "batch_digest": (2 ** 63 - 1) - r,
             "labelled": 10 + r, "flag": r == 2, "clock": r == 1, "work": 0.5 * r} for r in range(3)]
    rows[0]["grad_norm"] = 1.5  # rank 0 reads it; the others send nothing
    agreed = gather(layout, rows)
    assert agreed["loss_sum"] == sum(losses)  # in rank order: the same float everywhere
    assert agreed["batch_digest"] == [2 ** 63 - 1, 2 ** 63 - 2, 2 ** 63 - 3]  # 63-bit digests intact
    assert agreed["labelled"] == [10, 11, 12] and agreed["data_ended"] == [0, 0, 0]
    assert agreed["flag"] is True and agreed["clock"] is False  # any rank / rank 0's alone
    assert agreed["grad_norm"] == 1.5 and agreed["work"] == [0.0, 0.5, 1.0]
    assert gather(layout, [{}, {}])["grad_norm"] is None  # not read: None, not 0.0


def test_a_field_claimed_twice_or_a_value_nobody_declared_is_refused():
    with pytest.raises(ValueError, match="claimed twice.*signal"):
        Layout([Field("signal", "any", "flag"), Field("signal", "rank0")])
    with pytest.raises(ValueError, match="nobody declared: typo"):
        Layout(STEP_FIELDS).pack({"typo": 1.0})
    with pytest.raises(ValueError, match="reduce 'mean'"):
        Field("x", "mean")


def test_every_participant_of_the_run_fits_one_gather():
    """All of ORDER built for one run: their fields and the step's own share one layout (no name twice)."""
    dist = SimpleNamespace(broadcast_object_list=lambda box, src: None)
    run = FakeRun(plan=SimpleNamespace(golden=object(), run_dir=Path("r"), ckpt_dir=Path("r/c"), zt={},
                                       model_args=PRESETS["debug"], best_higher=None, eval_tasks=object(), eval_tasks_every=5,
                                       tokenizer=None, ds_config={"train_micro_batch_size_per_gpu": 1}, data_rank=1,
                                       data_world=2, sequence_parallel=1,
                                       settings=SimpleNamespace(eval_limit=None, best_by=None)),
                  cfg=RunConfig.from_flat(dict(on_spike="rollback", eval_every_steps=10, golden_strict=False,
                                               early_stop_patience=2, seq_len=8, torch_profile="5:3")),
                  rank=1, world=2, is_main=False, dist=dist, engine=SimpleNamespace(device="cpu"),
                  clock=PhaseClock(), hooks=None, metrics=None,
                  checkpointer=SimpleNamespace(sync_best=lambda: []), signals=SignalStop(),
                  budget=Budget(), evaluator=None, tokens_per_step=64)
    built = participants.build(run)
    assert [type(p) for p in built] == list(participants.ORDER)
    layout = Layout(STEP_FIELDS + [f for p in built for f in p.fields()])
    assert {"signal", "save_hours", "over_budget", "step_work_s", "data_wait_s"} <= set(layout.slot)
    assert all(isinstance(p, Participant) for p in built)


def test_a_non_finite_loss_or_gradient_norm_stops_naming_the_last_checkpoint():
    finite = Finite(FakeRun(last_saved=Path("ckpt/step_00000004")))
    assert finite.observe(a_step(loss=2.0, grad_norm=1.0)) is None
    stop = finite.observe(a_step(loss=math.nan))
    assert isinstance(stop, StopRun) and stop.kind == "diverged"
    assert stop.message == "step 5: loss is nan; stopping. Last checkpoint: ckpt/step_00000004"
    stop = finite.observe(a_step(loss=2.0, grad_norm=math.inf))
    assert stop.kind == "diverged" and "gradient norm is inf" in stop.message


def spiking(spikes: Spikes, steps: int = 30) -> list:
    """Feed a flat loss, then a tripled one, until the detector decides; every outcome."""
    outcomes = [spikes.observe(a_step(s, loss=2.0)) for s in range(1, steps)]
    return outcomes + [spikes.observe(a_step(steps + s, loss=6.0)) for s in range(3)]


def test_a_spike_warns_stops_or_rolls_back_and_gives_up_after_the_last_rollback():
    run = FakeRun()
    warned = spiking(Spikes(run, "warn", run.say))
    assert warned == [None] * len(warned) and "loss spike at step 32" in run.said[0]
    assert spiking(Spikes(run, "stop", run.say))[-1].kind == "diverged"
    nothing = spiking(Spikes(run, "rollback", run.say))[-1]
    assert nothing.kind == "diverged" and "no checkpoint to roll back to" in nothing.message
    run = FakeRun(last_saved=Path("ckpt/step_00000020"))
    spikes = Spikes(run, "rollback", run.say)
    assert spiking(spikes)[-1] is REWOUND and run.rollbacks == 1 and run.rolled_back[0].startswith("loss spike")
    run.rollbacks = ROLLBACKS_MAX
    assert spikes.observe(a_step(40, loss=2.0)) is None  # accepted: the next streak is a new spike
    gave_up = [spikes.observe(a_step(41 + s, loss=6.0)) for s in range(3)][-1]
    assert gave_up.kind == "diverged" and f"{ROLLBACKS_MAX} rollbacks already" in gave_up.message


def test_rank_0s_clock_stops_every_rank_at_the_same_step():
    """--max-hours: only rank 0's clock counts (another rank's clock may say otherwise); every rank
    reads the same flag from the gather and stops with the budget's kind."""
    ranks = [BudgetStop(FakeRun(), Budget(max_hours=1.0), tokens_per_step=64) for _ in range(2)]
    layout = Layout(STEP_FIELDS + ranks[0].fields())
    steps = [a_step(trained_at=3599.5), a_step(trained_at=10.0)]  # rank 0 is near the hour, rank 1 is not
    agreed = gather(layout, [p.contribute(s) for p, s in zip(ranks, steps)])
    stops = []
    for p, s in zip(ranks, steps):
        s.agreed = agreed
        stops.append(p.logged(s))
    assert [s.kind for s in stops] == ["budget", "budget"]
    assert stops[0].message.startswith("budget reached at step 5: --max-hours 1")
    assert stops[1].message == "budget reached at step 5: rank 0 clock (--max-hours / --budget-usd)"


def test_the_budget_counts_the_next_steps_fetch_from_when_it_was_made():
    """contribute runs after the next step's batches were fetched: the projection starts there (a slow loader's
    wait was left out before, and a run went one fetch past --max-hours)."""
    budget = BudgetStop(FakeRun(), Budget(max_hours=0.001), tokens_per_step=64)  # 3.6 s
    budget.contribute(a_step(step_time=0.5, trained_at=2.8))
    assert budget.why is None  # 2.8 + 0.5 fits, as the fetch was not counted
    budget.contribute(a_step(step_time=0.5, trained_at=2.8, fetched_at=3.3))
    assert budget.why is not None and "3.3s trained" in budget.why  # 3.3 + 0.5 does not


def test_a_run_stopped_by_max_hours_and_started_again_trains_no_step():
    """The stop reserved the next step's time and the last save's; the checkpoint keeps both (state_dict, under
    "budget"), so the run started again decides the same before its first step. It used to reserve 0 s there
    and trained one step past --max-hours. A checkpoint without them (an older one) reserves 0 s, as before."""
    first = BudgetStop(FakeRun(last_save_s=2.0), Budget(max_hours=1.0), tokens_per_step=64)
    first.contribute(a_step(step_time=30.0, trained_at=3570.0))  # 3570 + 30 + 2 s > 1 h
    assert first.why is not None
    kept = json.loads(json.dumps(first.state_dict()))  # as the checkpoint's client_state carries it
    again = BudgetStop(FakeRun(elapsed_before=3570.0), Budget(max_hours=1.0), tokens_per_step=64)
    again.load_state_dict(kept)
    stop = again.over_before()
    assert stop.kind == "budget" and stop.message.startswith("budget reached before step 6: --max-hours 1")
    assert "the next step (~30.0 s + 2.0 s to save)" in stop.message
    longer = BudgetStop(FakeRun(elapsed_before=3570.0), Budget(max_hours=2.0), tokens_per_step=64)
    longer.load_state_dict(kept)
    assert longer.over_before() is None  # a larger --max-hours goes on
    older = BudgetStop(FakeRun(elapsed_before=3570.0), Budget(max_hours=1.0), tokens_per_step=64)
    older.load_state_dict(None)
    assert older.over_before() is None


def test_a_signal_on_one_rank_stops_every_rank():
    signals = [SignalStop(), SignalStop()]
    signals[1].requested = "SIGTERM"
    ranks = [Signals(s, dist=None, device="cpu") for s in signals]
    layout = Layout(STEP_FIELDS + ranks[0].fields())
    agreed = gather(layout, [p.contribute(a_step()) for p in ranks])
    stops = [p.logged(a_step(agreed=agreed)) for p in ranks]
    assert [s.kind for s in stops] == ["signal", "signal"]
    assert "a signal on another rank" in stops[0].message and "SIGTERM" in stops[1].message
    assert ranks[0].logged(a_step(agreed=gather(layout, [{}, {}]))) is None


def test_early_stopping_learns_from_evaluations_and_its_state_survives_a_resume():
    early = EarlyStop(patience=2)
    for step, loss in ((10, 3.0), (20, 3.1), (30, 3.2)):
        s = a_step(step, val={"val_loss": loss})
        early.observe(s)
    stop = early.logged(s)
    assert stop.kind == "early-stop" and stop.message.startswith("early stop at step 30")
    resumed = EarlyStop(patience=2)
    resumed.load_state_dict(early.state_dict())
    assert resumed.logged(a_step(30)).kind == "early-stop"
    assert EarlyStop(patience=None).state_dict() is None and EarlyStop(None).logged(a_step()) is None


# -- the order, from what each participant reads and writes ------------------------------------------------------

def test_the_shipped_order_puts_every_writer_before_its_readers():
    """The derived order holds every shipped participant once; each StepState field a participant reads is the
    step's own or written by an earlier participant in the same hook (or itself, or in observe for a logged
    reader); the listed order decides the rest, so the stops keep their precedence (signal, budget, early stop)."""
    derived = participants.ORDER
    assert sorted(c.__name__ for c in derived) == sorted(c.__name__ for c in participants.LISTED)
    for i, reader in enumerate(derived):
        for name, writes in [(n, "writes") for n in reader.reads] + [(n, "writes_logged") for n in reader.reads_logged]:
            writers = [w for w in derived if name in getattr(w, writes)]  # health reads the window it wrote
            in_observe = [w for w in derived if name in w.writes]
            assert name in STEP_PROVIDES or writers or (writes == "writes_logged" and in_observe), (reader, name)
            assert all(derived.index(w) < i for w in writers if w is not reader), (reader.__name__, name, writers)
    at = {c.__name__: derived.index(c) for c in derived}
    # the tasks score after early stop has said whether this step ends the run (a final step is scored)
    assert at["Evaluation"] < at["EarlyStop"] < at["EvalTasks"]
    assert at["Checkpointing"] < at["Signals"]  # a signal during the save is asked for once the save is done
    assert at["Signals"] < at["BudgetStop"] < at["EarlyStop"]  # the stops' precedence, from the listed order


def test_a_logged_read_of_a_field_written_in_observe_orders_nothing():
    """Every observe runs before any logged: a participant that reads in logged what another writes in observe
    keeps its listed place (the save reads the best that the tasks decide in observe, yet is listed, and called,
    before them); a field written only in logged is not there for an observe reader."""
    class Saver(Participant):
        reads_logged = ("new_best",)

    class Scorer(Participant):
        writes = ("new_best",)

    assert order((Saver, Scorer)) == (Saver, Scorer)

    class LateWriter(Participant):
        writes_logged = ("saved",)

    class EarlyReader(Participant):
        reads = ("saved",)

    with pytest.raises(ValueError, match="^participant EarlyReader reads saved, which no participant writes"):
        order((LateWriter, EarlyReader))


def test_the_order_follows_the_declarations_not_the_listing():
    """A reader listed before its writer is called after it; the others keep their listed order."""
    class Reader(Participant):
        reads = ("val",)

    class Other(Participant):
        pass

    class Writer(Participant):
        writes = ("val",)

    assert order((Reader, Other, Writer)) == (Other, Writer, Reader)
    assert order((Other, Writer, Reader)) == (Other, Writer, Reader)


def test_a_cycle_or_a_field_nobody_writes_is_refused():
    class First(Participant):
        reads, writes = ("saved",), ("val",)

    class Second(Participant):
        reads, writes = ("val",), ("saved",)

    with pytest.raises(ValueError, match=r"^participants' reads and writes form a cycle: First reads what Second"
                                         r" writes; Second reads what First writes$"):
        order((First, Second))

    class Orphan(Participant):
        reads = ("new_best",)

    with pytest.raises(ValueError, match="^participant Orphan reads new_best, which no participant writes and the"
                                         " step does not provide$"):
        order((Orphan,))

    class Typo(Participant):
        writes = ("vall",)

    with pytest.raises(ValueError, match="^participant Typo names no StepState field: vall$"):
        order((Typo,))
