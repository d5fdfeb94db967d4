"""The run's state: its counters (steps, tokens, training seconds across resumes, saves, rollbacks) and what changes
them besides a step: `save()`, `rollback(what)` and `resume(tag_dir)`.

The step (step_runner.StepRunner) advances it by one step; the participants read it and ask for a save or a
rollback (participants/base.py `Run.state`); the Trainer (launcher/trainer.py) builds it and resumes it. What a
checkpoint carries besides DeepSpeed's own files is written here (`client_state["zerotrain"]`: the counters, every
data-parallel rank's loader state, the participants' states by their key) and read back here.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from zerotrain import durable
from zerotrain.dataio.pipeline.loader import Batches
from zerotrain.dataio.pipeline.reshard import documents_split, reshard_loader_states
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.checkpoints import checkpoint, checkpointer
from zerotrain.launcher.resize import universal
from zerotrain.launcher.components.checkpoints.checkpointer import Checkpointer
from zerotrain.launcher.components.guards import Budget
from zerotrain.launcher.components.observe.metrics import MetricsLogger
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.schedule import reapply
from zerotrain.launcher.config import RunConfig

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from zerotrain.dataio.pipeline.loader import Data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer, HFTokenizer
    from zerotrain.launcher.components.observe.golden import GoldenCheck
    from zerotrain.launcher.components.tasks.lm import Tasks
    from zerotrain.launcher.settings import Settings
    from zerotrain.modeling.sizes import ModelArgs


class Plan(Protocol):
    """What the components read of the run's plan (launcher/run_plan.py's RunPlan, a layer above them)."""
    cfg: RunConfig             # the resolved RunConfig
    world: int
    rank: int
    ds_config: dict            # the DeepSpeed dict
    settings: Settings         # every setting's value and source
    data: Data
    loader_settings: dict
    tokenizer: ByteTokenizer | HFTokenizer
    model_args: ModelArgs
    run_dir: Path
    golden: GoldenCheck | None  # --golden
    sequence_parallel: int
    eval_tasks: Tasks | None   # --eval-tasks
    eval_tasks_every: int
    best_higher: bool | None   # --best-by: whether higher is better (None: the validation loss decides)

    @property
    def data_world(self) -> int: ...
    @property
    def data_rank(self) -> int: ...
    @property
    def tokens_per_step(self) -> int: ...


class Kept(Protocol):
    """What the run state asks of a participant (participants/base.py Participant): its state across a resume,
    by its key, and a rewind after a rollback."""
    saved_as: str | None

    def state_dict(self) -> dict | None: ...
    def load_state_dict(self, state: dict | None) -> None: ...
    def rewind(self) -> None: ...


class RunState:
    """The counters the participants share, and save / rollback / resume. `loader_state` is the step's (the state
    after the last trained step: the next step's batches may be fetched already)."""

    def __init__(self, plan: Plan, *, engine: DeepSpeedEngine, dist, checkpointer: Checkpointer, budget: Budget,
                 metrics: MetricsLogger, clock: PhaseClock, say: Callable[[str], None], loader: Batches,
                 loader_state: Callable[[], dict], universal_dir: Path | None):
        self.plan, self.cfg, self.world, self.is_main = plan, plan.cfg, plan.world, plan.rank == 0
        self.engine, self.dist, self.checkpointer, self.budget = engine, dist, checkpointer, budget
        self.metrics, self.clock, self.say = metrics, clock, say
        self.loader, self.loader_state = loader, loader_state
        self.universal_dir = universal_dir  # a resume on another world size: removed once this world has saved
        self.participants: list[Kept] = []  # attach(): what they keep travels in every checkpoint
        self.step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.tokens_per_step = plan.tokens_per_step
        self.last_saved: Path | None = None
        self.last_save_s, self.rollbacks = 0.0, 0  # the last save's duration; --on-spike rollbacks so far
        self.save_seconds, self.saves, self.t_start = 0.0, 0, time.time()

    def attach(self, participants: list[Kept]) -> None:
        self.participants = participants

    def start(self) -> None:
        """The loop starts: training seconds count from now (added to those before a resume)."""
        self.save_seconds = self.last_save_s = 0.0
        self.saves = 0
        self.t_start = time.time()

    def advance(self) -> None:
        """One step trained."""
        self.step += 1
        self.tokens_seen += self.tokens_per_step

    def elapsed(self, at: float | None = None) -> float:
        """Training seconds across resumes, now (or at the time.time() `at`)."""
        return self.elapsed_before + (time.time() if at is None else at) - self.t_start

    def guard_states(self) -> dict:
        """What the participants keep across a resume, by their key (spike detector, early stopping)."""
        return {p.saved_as: p.state_dict() for p in self.participants if p.saved_as}

    # -- saving -----------------------------------------------------------------------------------
    def save(self, best_value: float | None = None) -> Path:
        """The collective save of this step; `best_value`: it is saved as one of the K best (its marker says so)."""
        with self.clock.phase("save"):
            return self._save(best_value)

    def _save(self, best_value: float | None = None) -> Path:
        plan = self.plan
        states = [None] * self.world
        self.dist.all_gather_object(states, self.loader_state())
        states = states[::plan.sequence_parallel]  # one per loader: a row group's ranks share theirs
        client_state = {"zerotrain": {"step": self.step, "tokens_seen": self.tokens_seen, "loader_states": states,
                                      "elapsed_s": self.elapsed(),
                                      "gpu_seconds": self.budget.gpu_seconds(self.elapsed()),
                                      "guards": self.guard_states()}}
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.world,
                "sequence_parallel": plan.sequence_parallel,
                "run_id": plan.run_dir.name, "loader_workers": plan.loader_settings["workers"],
                "documents": documents_split(states)}  # a resume checks its data against these before writing
        t0 = time.time()
        self.last_saved = self.checkpointer.save(self.engine, self.step, client_state, meta, best_value)
        # a conversion is not needed once this world has saved: this launch's, and one an earlier launch left
        # (it ended before its first save; a resume on its own world never removed it)
        if self.is_main:
            shutil.rmtree(plan.ckpt_dir / "universal", ignore_errors=True)
        self.universal_dir = None
        self.last_save_s = time.time() - t0
        self.save_seconds += self.last_save_s
        self.saves += 1
        return self.last_saved

    # -- resume and rollback ----------------------------------------------------------------------
    def resume(self, tag_dir: Path) -> None:
        if self.universal_dir is not None:
            state = universal.load(self.engine, self.universal_dir)["zerotrain"]
            # DeepSpeed keeps applying load_universal to every later load_checkpoint of this engine;
            # a rollback reloads one of our own (same-world) tags.
            ds_compat.stop_loading_universal(self.engine)
        else:
            state = checkpointer.load(self.engine, tag_dir)["zerotrain"]
        self.step, self.tokens_seen, self.elapsed_before = state["step"], state["tokens_seen"], state["elapsed_s"]
        self.loader.load_state_dict(self._loader_states(state)[self.plan.data_rank])
        guards = state.get("guards", {})
        for p in self.participants:
            if p.saved_as and guards.get(p.saved_as):
                p.load_state_dict(guards[p.saved_as])
        self.budget.resume(self.elapsed_before, state.get("gpu_seconds"))
        if self.budget.active:
            self.say(self.budget.describe())  # what is left, the checkpoint's spend counted
        for line in self._restore_schedule() or [self.engine.lr_scheduler.lr_lambdas[0].describe(self.cfg.schedule.lr)]:
            self.say(line)
        self.last_saved = tag_dir
        self.checkpointer.note_loaded(self.step)
        self.metrics.event("resume", self.step, checkpoint=str(tag_dir))
        self.say(f"resumed from {tag_dir} at step {self.step}")

    def _loader_states(self, state: dict) -> list[dict]:
        """One loader state per data-parallel rank of this run, re-split if another number of ranks saved them."""
        plan, states = self.plan, state["loader_states"]  # one per loader: per data-parallel rank
        if len(states) != plan.data_world:  # saved by another number of ranks: re-split what was left
            states = reshard_loader_states(plan.data, states, plan.data_world, self.cfg.run.seed, self.cfg.data.seq_len,
                                           plan.ds_config["train_micro_batch_size_per_gpu"],
                                           plan.loader_settings["packing"])
            self.say(f"data: {len(state['loader_states'])} ranks' loader states re-split over {plan.data_world}")
        return states

    def _restore_schedule(self) -> list[str]:
        """The checkpoint brought back its lr schedule (DeepSpeed saves the LambdaLR, our Schedule's state
        included): re-plan or keep it for this run's --max-steps (components/schedule.py) and put the lr of
        the next step into the optimizer. Returns what to say."""
        scheduler = self.engine.lr_scheduler
        lines = scheduler.lr_lambdas[0].resume(self.step, self.cfg.schedule.max_steps, self.cfg.schedule.lr)
        reapply(scheduler)
        return lines

    def rollback(self, what: str) -> None:
        """Reload the last good checkpoint, keep the data where it is: the window that spiked is skipped.
        The participants keep what they learnt (spike steps never enter the detector) and rewind()."""
        spiked_at, tag = self.step, self.last_saved
        first_skipped = checkpoint.read_meta(tag)["step"] + 1
        self.rollbacks += 1
        self.checkpointer.wait()
        state = checkpointer.load(self.engine, tag)["zerotrain"]
        self._restore_schedule()  # the tag may hold the plan before a resume re-planned it
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.checkpointer.note_loaded(self.step)
        self.checkpointer.discard_after(self.step)  # rank 0: no later tag of the abandoned timeline survives
        for p in self.participants:
            p.rewind()  # evaluation: best.json as it now stands
        window = {"spike_at_step": spiked_at, "rolled_back_to": str(tag), "skipped_steps": [first_skipped, spiked_at],
                  "why": what, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.is_main:
            path = self.plan.run_dir / "rollbacks.json"
            done = json.loads(path.read_text()) if path.is_file() else []
            durable.write_json(path, done + [window])
        self.metrics.event("rollback", self.step, **window)
        self.say(f"zerotrain: warning: {what}; rolled back to {tag} (step {self.step}); the data of steps"
                 f" {first_skipped}-{spiked_at} is skipped (recorded in rollbacks.json)")
