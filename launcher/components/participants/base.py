"""The step's participants: what a monitor of the training step is, and the one gather they share.

A participant is a small object the Trainer calls at fixed points of every step (OLMo-core's callbacks,
with one difference: every rank decides on the same values, because what a decision needs from other
ranks rides on the step's one collective, `StepRunner.agree`):

    fields()          the NAMED fields it adds to the step's gather (`Field`: how each is reduced over ranks)
    open()            once, when the loop starts (say what it watches)
    over_before()     once, before this launch's first step: a StopRun that holds already (a signal during
                      start-up; a resumed run that ended on its budget or patience), so that it ends with nothing
                      trained rather than one step past its end; every rank calls it, the same way
    contribute(step)  before the gather: this rank's value of each of its fields
    observe(step)     after the gather, before the step's record is written (`step.agreed[name]`)
    logged(step)      after the record is written
    rewind()          after a rollback to an earlier checkpoint
    state_dict() / load_state_dict(state)   what survives a resume (`saved_as`: its key in the checkpoint)
    close()

`observe` and `logged` return None to go on, a `StopRun` to end the run (its kind and message; the
Trainer saves if the kind saves), or `REWOUND` when the step was abandoned (a rollback: the loop goes on
from the restored step). Each participant declares the StepState fields it `reads` and `writes` in observe (and
contribute), and `reads_logged`/`writes_logged` in logged; `order` calls every writer before its readers in the
same hook (Evaluation's val before EarlyStop, EarlyStop's ending before the tasks, Checkpointing's saved before
Signals): every observe runs before any logged, so a field written in observe constrains no logged reader. The
listed order decides the rest; the first StopRun wins.

`Layout` packs the named fields of every rank into one int64 row (floats ride as their bits) and
reduces the gathered table into an `Agreed` mapping: pure torch on tensors, no process group, so
the gather's meaning is unit-tested without one. A participant never imports the Trainer: what it
may ask of the run is the `Run` protocol below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch

from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.errors import StopRun

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer
    from zerotrain.launcher.components.evaluate import Evaluator
    from zerotrain.launcher.components.guards import Budget, SignalStop
    from zerotrain.launcher.components.observe.metrics import MetricsLogger
    from zerotrain.launcher.components.observe.phases import PhaseClock
    from zerotrain.launcher.components.run_state import Plan, RunState

KINDS = ("int", "float", "flag", "optional")  # optional: a float or None (one more slot says which)
REDUCTIONS = ("every", "sum", "any", "rank0")


@dataclass(frozen=True)
class Field:
    """One named value of a rank's row. `reduce`: "every" (a list, one per rank, in rank order), "sum"
    (summed in rank order: the same float on every rank), "any" (True when any rank's is nonzero) or
    "rank0" (rank 0's: its clock and the engine's gradient norm are read once). `kind` int rides as an
    int64, the others as float64 (flag -> bool, optional -> float or None)."""
    name: str
    reduce: str
    kind: str = "float"

    def __post_init__(self):
        if self.reduce not in REDUCTIONS or self.kind not in KINDS:
            raise ValueError(f"field {self.name}: reduce {self.reduce!r} / kind {self.kind!r}"
                             f" (known: {', '.join(REDUCTIONS)} / {', '.join(KINDS)})")


# The step's own fields (the Trainer's): the next step's data (ended? error? batch digest, labelled tokens:
# every rank's), this step's loss sum (summed in rank order) and rank 0's gradient norm (None: not read).
STEP_FIELDS = [Field("data_ended", "every", "int"), Field("data_error", "every", "int"),
               Field("batch_digest", "every", "int"), Field("labelled", "every", "int"),
               Field("loss_sum", "sum"), Field("grad_norm", "rank0", "optional")]


class Agreed(dict):
    """The gathered fields by name, reduced: identical on every rank."""


class Layout:
    """Where each named field sits in a rank's row: int fields first, then float64 slots."""

    def __init__(self, fields: list[Field]):
        names = [f.name for f in fields]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"fields claimed twice in the step's gather: {', '.join(twice)}")
        self.ints = [f for f in fields if f.kind == "int"]
        self.floats = [f for f in fields if f.kind != "int"]
        self.slot, n = {}, 0
        for f in self.floats:
            self.slot[f.name] = n
            n += 2 if f.kind == "optional" else 1
        self.n_floats = n

    def pack(self, values: Mapping[str, Any], device=None) -> torch.Tensor:
        """This rank's row; a field missing from `values` is 0 (None for optional). A float may be a
        device tensor: it is copied on the device (no host sync)."""
        unknown = set(values) - {f.name for f in self.ints} - set(self.slot)
        if unknown:
            raise ValueError(f"values for fields nobody declared: {', '.join(sorted(unknown))}")
        floats = torch.zeros(self.n_floats, dtype=torch.float64, device=device)
        for f in self.floats:
            value, i = values.get(f.name), self.slot[f.name]
            if f.kind == "optional":
                if value is not None:
                    floats[i], floats[i + 1] = 1.0, value
            elif value is not None:
                floats[i] = value if isinstance(value, torch.Tensor) else float(value)
        ints = torch.tensor([int(values.get(f.name) or 0) for f in self.ints], dtype=torch.int64, device=device)
        return torch.cat([ints, floats.view(torch.int64)])

    def unpack(self, table: torch.Tensor) -> Agreed:
        """Every rank's rows (world x row, int64, on the host) reduced field by field."""
        n = len(self.ints)
        int_rows = table[:, :n].tolist()
        float_rows = table[:, n:].contiguous().view(torch.float64).tolist()
        agreed = Agreed()
        for j, f in enumerate(self.ints):
            agreed[f.name] = _reduce(f, [row[j] for row in int_rows])
        for f in self.floats:
            i = self.slot[f.name]
            if f.kind == "optional":
                per_rank = [row[i + 1] if row[i] > 0 else None for row in float_rows]
            elif f.kind == "flag":
                per_rank = [row[i] > 0 for row in float_rows]
            else:
                per_rank = [row[i] for row in float_rows]
            agreed[f.name] = _reduce(f, per_rank)
        return agreed


def _reduce(f: Field, per_rank: list):
    if f.reduce == "every":
        return per_rank
    if f.reduce == "rank0":
        return per_rank[0]
    if f.reduce == "any":
        return any(bool(x) for x in per_rank)
    return sum(per_rank)  # in rank order: the same float on every rank


class _Rewound:
    def __repr__(self) -> str:
        return "REWOUND"


REWOUND = _Rewound()  # observe()/logged(): this step was abandoned (rolled back), the loop goes on


@dataclass
class StepState:
    """One step as the participants see it, filled in as the step goes (one object per step)."""
    step: int                  # the step being trained; after the gather, the step just completed
    tokens_sha: str            # every rank's batch digests of this step, hashed
    lr: float
    step_time: float           # seconds of the whole step (its compute, fetch-ahead, collective); in contribute:
    #                            the compute and its data wait, the collective still to come
    trained_at: float          # time.time() when this step's work ended (before the next step's fetch)
    last: bool                 # the run's last step (--max-steps)
    agreed: Agreed = field(default_factory=Agreed)
    fetched_at: float | None = None  # time.time() once the next step's batches were fetched (contribute: after it)
    loss: float | None = None
    grad_norm: float | None = None  # rank 0's, agreed
    window: Any = None         # the health check's (window, verdicts) when a window closed here (rank 0)
    val: dict | None = None    # the evaluation's metrics at an eval step
    scores: dict | None = None  # the lm-evaluation-harness tasks' metrics at a scoring step ({"eval", "eval_tasks_s"})
    new_best: bool = False     # among the K best: by validation loss, or by --best-by's score
    best_value: float | None = None  # the value new_best was decided on
    record: dict | None = None  # the step's logged record
    saved: bool = False        # a checkpoint of this step was written in the loop
    ending: str | None = None  # the end already known at observe for a run that ends normally after this step
    #                            ("early-stop": set by its participant; "data-exhausted": the next step's data ran
    #                            out), read by what acts at the end (the tasks' scoring); never a signal or budget

    @property
    def evaluated(self) -> dict | None:
        """What the step's record carries of its evaluations: the validation loss's figures and the tasks' scores."""
        if self.val is None and self.scores is None:
            return None
        return {**(self.val or {}), **(self.scores or {})}

    @property
    def final(self) -> bool:
        """The run ends normally after this step: --max-steps, an early stop, the data ran out."""
        return self.last or self.ending is not None or any(self.agreed.get("data_ended") or ())


# What the step fills in before any participant sees it (the step runner; `record`: the trainer, between observe
# and logged); the other StepState fields are the participants' (their `writes`).
STEP_PROVIDES = ("step", "tokens_sha", "lr", "step_time", "trained_at", "last", "agreed", "loss", "grad_norm",
                 "record")


def order(listed: Sequence[type["Participant"]]) -> tuple[type["Participant"], ...]:
    """The participants in the order they are called: each writer of a StepState field before every other
    participant that reads it in the same hook (observe: `reads`/`writes`; logged: `reads_logged`/`writes_logged`;
    every observe runs before any logged, so a logged read of a field written in observe orders nothing);
    otherwise as `listed` (the tie-break: the stops' precedence). A field nobody writes (by then) and the step
    does not provide, an unknown field, or a cycle is refused (ValueError)."""
    fields = {f.name for f in dataclasses.fields(StepState)}
    in_observe: dict[str, list[type[Participant]]] = {}
    in_logged: dict[str, list[type[Participant]]] = {}
    for cls in listed:
        unknown = sorted(set(cls.reads + cls.writes + cls.reads_logged + cls.writes_logged) - fields)
        if unknown:
            raise ValueError(f"participant {cls.__name__} names no StepState field: {', '.join(unknown)}")
        for name in cls.writes:
            in_observe.setdefault(name, []).append(cls)
        for name in cls.writes_logged:
            in_logged.setdefault(name, []).append(cls)
    before: dict[type[Participant], set] = {cls: set() for cls in listed}  # who must be called before each
    for cls in listed:
        for name, writers, written in ([(n, in_observe, in_observe) for n in cls.reads]
                                       + [(n, in_logged, {**in_observe, **in_logged}) for n in cls.reads_logged]):
            if name not in STEP_PROVIDES and name not in written:
                raise ValueError(f"participant {cls.__name__} reads {name}, which no participant writes and the"
                                 " step does not provide")
            before[cls] |= {w for w in writers.get(name, ()) if w is not cls}
    done: list[type[Participant]] = []
    while len(done) < len(listed):
        ready = [cls for cls in listed if cls not in done and before[cls] <= set(done)]
        if not ready:
            left = [cls for cls in listed if cls not in done]
            raise ValueError("participants' reads and writes form a cycle: " + "; ".join(
                f"{cls.__name__} reads what {', '.join(sorted(w.__name__ for w in before[cls] - set(done)))}"
                f" writes" for cls in left))
        done.append(ready[0])
    return tuple(done)


class Run(Protocol):
    """What a participant may ask of the run (the Trainer satisfies it; participants never import it):
    what it is built from (`from_run`), and the run's state they share (counters, save, rollback)."""
    plan: Plan                 # what of the RunPlan components read (run_state.Plan)
    cfg: RunConfig             # the resolved RunConfig
    rank: int
    world: int
    is_main: bool
    dist: ModuleType           # torch.distributed
    engine: DeepSpeedEngine
    clock: PhaseClock
    metrics: MetricsLogger
    checkpointer: Checkpointer
    signals: SignalStop
    budget: Budget
    evaluator: Evaluator | None
    tokens_per_step: int
    state: RunState            # the counters (step, tokens_seen, last_saved, ...), save(), rollback(what)

    def say(self, line: str) -> None: ...


class Participant:
    """A monitor of the step. Every hook is optional; see the module docstring for when each runs.
    `reads` and `writes` name the StepState fields it reads and fills in in observe (and contribute),
    `reads_logged` and `writes_logged` in logged: the order the participants are called in follows from them
    (`order`)."""
    name = "participant"
    saved_as: str | None = None  # its key under the checkpoint's "guards" (None: nothing to keep)
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    reads_logged: tuple[str, ...] = ()
    writes_logged: tuple[str, ...] = ()

    @classmethod
    def from_run(cls, run: Run) -> "Participant | None":
        """Built for this run (None: not taking part, e.g. golden without --golden)."""
        return cls()

    def fields(self) -> list[Field]:
        return []

    def open(self) -> None:
        pass

    def over_before(self) -> StopRun | None:
        return None

    def contribute(self, step: StepState) -> dict:
        return {}

    def observe(self, step: StepState) -> StopRun | _Rewound | None:
        return None

    def logged(self, step: StepState) -> StopRun | _Rewound | None:
        return None

    def rewind(self) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def close(self) -> None:
        pass
