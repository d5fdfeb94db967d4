"""The training step's participants (components/participants/base.py: the protocol, and the layout of the
step's one gather), one module each. ORDER is the order they are called at each hook (the first StopRun
wins), derived from what each reads and writes of the step (base.order: every writer before its readers) with
LISTED deciding the rest: before the step's record (observe), health's window, finite, spikes, evaluation and
best, early stop's update, then the lm-evaluation-harness tasks (and their best with --best-by: after early stop,
which says whether this step ends the run, when the tasks are scored too); after it (logged), golden, health's
verdicts, the save, then the stops by precedence: signal, budget, early stop (the tasks have no `logged`). --torch-profile's
window opens and closes first, so a stop never skips it. Adding a monitor is a new module here, its `reads` and
`writes`, and its place in LISTED; the Trainer does not change.
"""
from __future__ import annotations

from zerotrain.launcher.components.participants.base import Participant, Run, order
from zerotrain.launcher.components.participants.budget import BudgetStop
from zerotrain.launcher.components.participants.checkpointing import Checkpointing
from zerotrain.launcher.components.participants.early_stop import EarlyStop
from zerotrain.launcher.components.participants.eval_tasks import EvalTasks
from zerotrain.launcher.components.participants.evaluation import Evaluation
from zerotrain.launcher.components.participants.finite import Finite
from zerotrain.launcher.components.participants.golden import GoldenWatch
from zerotrain.launcher.components.participants.health import HealthWatch
from zerotrain.launcher.components.participants.signals import Signals
from zerotrain.launcher.components.participants.spikes import Spikes
from zerotrain.launcher.components.participants.torch_profile import TorchProfile

LISTED: tuple[type[Participant], ...] = (TorchProfile, GoldenWatch, HealthWatch, Finite, Spikes, Evaluation,
                                         Checkpointing, Signals, BudgetStop, EarlyStop, EvalTasks)
ORDER = order(LISTED)  # a cycle or a field read that nobody writes fails here, at import


def build(run: Run) -> list[Participant]:
    """This run's participants, in ORDER (those that do not take part left out)."""
    return [p for p in (cls.from_run(run) for cls in ORDER) if p is not None]
