"""The training run as an object: `run(cfg) -> RunResult` builds a `Trainer` from a frozen `RunPlan`.

    plan_run(cfg, world)   everything decided before any process touches disk or builds a model (run_plan.py,
                           through resolution.resolve, the one resolution `zerotrain plan` and `dry_run` use too)
    Trainer(plan)          process group, run directory, model, engine, data, components, resume
    Trainer.train()        the loop: a list of calls to small components

The Trainer calls the components (launcher/components/: one concern each, listed in its __init__; the one engine
builder, the checkpointer, evaluation, guards, the step's participants, DeepSpeed's private names in ds_compat/),
the feature rooms (launcher/offload/, launcher/sequence/, launcher/resize/: ZeRO-Offload, sequence parallelism,
a resume on another world size) and the planner (launcher/planning/). How a run ends: StopRun by kind
(launcher/errors.py), each kind's exit code in launcher/ends.py's END_KINDS.

Per step there is one small collective besides DeepSpeed's own, and one host sync: an all-gather
(Trainer.agree) of each rank's row of NAMED fields: this step's loss sum, rank 0's gradient norm and the
NEXT step's data (ended? error? batch digest, labelled tokens: fetched ahead so that it rides on the same
collective), plus whatever the step's participants add (components/participants/: signal flags, rank 0's
clock for save-by-hours and the budgets, each rank's step times for the health check). Every decision is
therefore taken on the same values on every rank, at the same step. The monitors of the step (finite,
spikes, evaluation and best, checkpointing, signals, budget, early stop, health, golden) are participants:
adding one is a new module there and its place in participants.ORDER, not an edit of the Trainer.

The Trainer keeps what the participants share (the counters, the engine, save and rollback); what stands
alone lives in components/ (StepLogger in observe/metrics.py, DeepSpeed's internals in ds_compat/).
"""
from __future__ import annotations

import _thread
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.dataio.errors import DataError
from zerotrain.dataio.hub import hub_lines
from zerotrain.dataio.loader import MODEL_KEYS, Batches, batch_digest, trainable_tokens
from zerotrain.dataio.reshard import reshard_loader_states
from zerotrain import durable, torch_private
from zerotrain.launcher import planning
from zerotrain.launcher.components import ds_compat, manifest, oom
from zerotrain.launcher.components.checkpoints import checkpoint, checkpointer
from zerotrain.launcher.components.engine import build_engine, spec_from_plan
from zerotrain.launcher.components.observe import watchdog
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.components.guards import SignalStop
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.observe.metrics import MetricsLogger, StepLogger, read_metrics
from zerotrain.launcher.components.observe.phases import PhaseClock, device_done
from zerotrain.launcher.components import participants
from zerotrain.launcher.components.participants.base import STEP_FIELDS, Agreed, Layout, StepState
from zerotrain.launcher.components.process_group import init_process_group
from zerotrain.launcher.components.checkpoints.run_lock import take_lock
from zerotrain.launcher.components.schedule import reapply
from zerotrain.launcher.config import RunConfig, config_from
from zerotrain.launcher.ends import END_KINDS
from zerotrain.launcher.errors import CheckpointError, StopRun
from zerotrain.launcher.rank_ends import report_exit, report_rank_end  # report_exit: pre-flight too
from zerotrain.launcher.resize import universal
from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.optimizers import describe as describe_optimizer
from zerotrain.launcher.profiles import load_profile
from zerotrain.launcher.settings import profile_value
from zerotrain.launcher.run_plan import RunPlan, say_rank0, describe, finished_again, plan_run, single_process_env
from zerotrain.modeling.model import count_params, flops_per_token, global_token_mean_scale

# DeepSpeed 0.19 still calls torch.distributed's deprecated *_tensor collectives under ZeRO-3.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


@dataclass
class RunResult:
    """How a run ended. `stop` is its kind, `exit_code` what `zerotrain train` exits with (both from
    launcher/errors.py's END_KINDS)."""
    run_dir: Path
    step: int
    tokens_seen: int
    stop: str  # the end kind: a key of launcher/errors.py END_KINDS (finished, signal, diverged, ...)
    message: str
    exit_code: int
    last_checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)


class QuietExit(Exception):
    """Another rank met a data error and says so; this rank leaves without a second message."""


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------

class Trainer:
    """Built once from a RunPlan; `train()` runs the loop and returns a RunResult."""

    def __init__(self, plan: RunPlan, hard_exit: bool = True, watch: bool = False):
        self.plan, self.cfg = plan, plan.cfg
        self.world, self.rank, self.is_main = plan.world, plan.rank, plan.rank == 0
        self.say = say_rank0(plan.rank)
        warning = ds_compat.check_deepspeed_version()  # one line, exit 2, before anything is built or written
        if warning:
            self.say(warning)
        self.hooks = TestHooks.from_env()  # read once here, never in the step loop
        if self.hooks.variables:  # said here and recorded in manifest.json: never silently active
            self.say(self.hooks.describe())
        self.clock = PhaseClock()  # where this rank is (the watchdog) and where its time went (health)
        self.torch = torch
        # --hang-timeout, else the profile's (None: the watchdog's default rule; 0: off): launcher/settings.py
        self.hang_timeout = plan.settings.hang_timeout
        for line in offload.describe_stale_locks():  # before the process group: it loads the first op (CPU)
            self.say(f"zerotrain: warning: {line}")
        self.dist, self.accel = init_process_group(plan.settings.dist_backend, plan.settings.comm_timeout_s)
        self.budget = plan.budget  # built once, by plan_run
        if self.budget.active:
            self.say(self.budget.describe())
        self.lock = take_lock(plan.run_dir, self.dist, self.is_main, say=self.say)
        self.universal_dir = None
        if plan.resume_from is not None and plan.resume_meta["world_size"] != self.world:
            self.universal_dir = universal.convert_on_rank0(
                plan.resume_from, out_dir=plan.ckpt_dir / "universal" / plan.resume_from.name)
            self.say(f"converted {plan.resume_from} (saved by {plan.resume_meta['world_size']} ranks) to a universal"
                     f" checkpoint for {self.world} rank(s): {self.universal_dir}")
        self._write_run_dir()
        self.watchdog = self._start_watchdog(hard_exit) if watch else None  # pre-flight's scratch runs: none
        self.engine = self._build_engine(self.accel)
        for line in describe(plan, schedule=plan.resume_from is None):  # the same lines as --dry-run's
            self.say(line)
        self.loader = self._build_data()
        self._build_components(hard_exit)
        self.participants = participants.build(self)  # the step's monitors, in participants.ORDER
        self.layout = Layout(STEP_FIELDS + [f for p in self.participants for f in p.fields()])
        if plan.resume_from is not None:
            self._resume(plan.resume_from)

    # -- building ---------------------------------------------------------------------------------
    def _build_components(self, hard_exit: bool) -> None:
        plan, cfg = self.plan, self.cfg
        self.checkpointer = checkpointer.Checkpointer(
            plan.ckpt_dir, plan.run_dir.name, self.rank, self.world, save_every_steps=cfg.save_every_steps,
            save_every_hours=cfg.save_every_hours, keep_last=cfg.keep_last, keep_best=cfg.keep_best,
            mirror=Path(cfg.mirror) if cfg.mirror else None, say=self.say, hooks=self.hooks,
            best_by=(plan.settings.best_by, plan.best_higher) if plan.best_higher is not None else None)
        self.step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.tokens_per_step = plan.tokens_per_step
        self.last_saved: Path | None = None
        self.last_save_s, self.rollbacks = 0.0, 0  # the last save's duration; --on-spike rollbacks so far
        self.final_loader_state = None  # set when the data runs out: the state before the unfinished step
        self.fetched = self.state_before_fetch = None  # the next step's batches, taken ahead (fetch())
        self.metrics = MetricsLogger(plan.run_dir, self.is_main, cfg, say=self.say)  # --log sinks
        self.signals = SignalStop(hard_exit=hard_exit)  # a notebook: a 2nd signal raises KeyboardInterrupt
        self.evaluator = None
        if plan.eval_rows:
            self.evaluator = Evaluator(plan.eval_rows, plan.data_rank, plan.data_world,
                                       plan.ds_config["train_micro_batch_size_per_gpu"], plan.sequence_parallel,
                                       self.rank % plan.sequence_parallel)

    def _write_run_dir(self) -> None:
        plan = self.plan
        hosts = self._hosts()  # a collective: every rank, outside the rank-0 branch
        if self.is_main:
            plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
            resolved = {"run": self.cfg.to_dict(), "run_id": plan.run_dir.name, "profile": plan.profile_name,
                        "world_size": self.world, "model": plan.model_args.to_dict(),
                        "tokenizer": plan.tokenizer.name, "sources": [s.__dict__ for s in plan.data.specs],
                        "identity_hash": self.cfg.identity_hash(),
                        "run_sources": plan.settings.sources,  # where every setting came from (settings.py)
                        "attention": plan.attention, "deterministic": plan.deterministic}  # the kernel resolved
            durable.write_json(plan.run_dir / "config.json", resolved)  # read back: drift checks, export, resume
            durable.write_json(plan.run_dir / "ds_config.json", plan.ds_config)
            manifest.write_or_extend(plan.run_dir, run_id=plan.run_dir.name, config_hash=self.cfg.identity_hash(),
                                     profile=plan.profile_name, seed=self.cfg.seed, world_size=self.world,
                                     hosts=hosts, resumed_from=str(plan.resume_from or "") or None,
                                     test_hooks=dict(self.hooks.variables))
        self.dist.barrier()

    def _start_watchdog(self, hard_exit: bool):
        """The hang watchdog (components/observe/watchdog.py), once the run directory exists: start-up counts. A
        notebook's (hard_exit=False) interrupts the main thread instead of ending the kernel."""
        self.say(watchdog.describe(self.hang_timeout))
        if self.hang_timeout == 0:
            return None
        exit_fn = os._exit if hard_exit else (lambda code: _thread.interrupt_main())
        return watchdog.Watchdog(self.clock, self.plan.run_dir, self.rank, self.world, watchdog.launch_id(self.dist),
                                 self.hang_timeout, exit_fn=exit_fn).start()

    def _hosts(self) -> list[str]:
        hosts = [None] * self.world
        self.dist.all_gather_object(hosts, socket.gethostname())
        return sorted(set(hosts))

    def _build_engine(self, accel):
        plan, cfg = self.plan, self.cfg
        # components/engine.py: the one builder (tests use it too); each all-to-all is a phase of its own
        built = build_engine(spec_from_plan(plan, exchange_phase=lambda: self.clock.phase("all_to_all")))
        engine, ds_config, args = built.engine, built.ds_config, plan.model_args
        if plan.init_from is not None and plan.resume_from is None:
            self.say(f"initialised from {plan.init_from}")
        held = [None] * self.world
        self.dist.all_gather_object(held, built.held)
        self.say(describe_optimizer(cfg, ds_config))
        n_params = count_params(args)
        self.say(f"model {plan.model_label}: {n_params['total'] / 1e6:.2f}M params"
                 f" ({n_params['non_embedding'] / 1e6:.2f}M non-embedding),"
                 f" profile {plan.profile_name}, ZeRO-{ds_config['zero_optimization'].get('stage', 0)},"
                 f" world {self.world}, batch {plan.batch_shape} x {cfg.seq_len} tokens")
        self.say(f"parameters held per rank after construction: {', '.join(f'{n:,}' for n in held)}"
                 f" of {n_params['total']:,}" + (", compiled with torch.compile" if self.plan.settings.compile else ""))
        return engine

    def _build_data(self):
        plan, cfg = self.plan, self.cfg
        # sequence parallelism: the N ranks of a group read the same rows (each model keeps its stretch of them)
        return self.hooks.slow_training_data(Batches(plan.data, plan.data_rank, plan.data_world, cfg.seed, cfg.seq_len,
                                                     plan.ds_config["train_micro_batch_size_per_gpu"],
                                                     plan.loader_settings, plan.loader_settings["packing"]), self.rank,
                                                 plan.ds_config["gradient_accumulation_steps"])

    def _resume(self, tag_dir: Path, load_loader: bool = True) -> None:
        if self.universal_dir is not None:
            state = universal.load(self.engine, self.universal_dir)["zerotrain"]
            # DeepSpeed keeps applying load_universal to every later load_checkpoint of this engine;
            # a rollback reloads one of our own (same-world) tags.
            ds_compat.stop_loading_universal(self.engine)
        else:
            state = checkpointer.load(self.engine, tag_dir)["zerotrain"]
        self.step, self.tokens_seen, self.elapsed_before = state["step"], state["tokens_seen"], state["elapsed_s"]
        states = state["loader_states"]  # one per loader: per data-parallel rank
        plan = self.plan
        if len(states) != plan.data_world:  # saved by another number of ranks: re-split what was left
            states = reshard_loader_states(plan.data, states, plan.data_world, self.cfg.seed, self.cfg.seq_len,
                                           plan.ds_config["train_micro_batch_size_per_gpu"],
                                           plan.loader_settings["packing"])
            self.say(f"data: {len(state['loader_states'])} ranks' loader states re-split over {plan.data_world}")
        if load_loader:
            self.loader.load_state_dict(states[plan.data_rank])
        guards = state.get("guards", {})
        for p in self.participants:
            if p.saved_as and guards.get(p.saved_as):
                p.load_state_dict(guards[p.saved_as])
        self.budget.resume(self.elapsed_before, state.get("gpu_seconds"))
        for line in self._restore_schedule() or [self.engine.lr_scheduler.lr_lambdas[0].describe(self.cfg.lr)]:
            self.say(line)
        self.last_saved = tag_dir
        self.checkpointer.note_loaded(self.step)
        self.metrics.event("resume", self.step, checkpoint=str(tag_dir))
        self.say(f"resumed from {tag_dir} at step {self.step}")

    def _restore_schedule(self) -> list[str]:
        """The checkpoint brought back its lr schedule (DeepSpeed saves the LambdaLR, our Schedule's state
        included): re-plan or keep it for this run's --max-steps (components/schedule.py) and put the lr of
        the next step into the optimizer. Returns what to say."""
        scheduler = self.engine.lr_scheduler
        lines = scheduler.lr_lambdas[0].resume(self.step, self.cfg.max_steps, self.cfg.lr)
        reapply(scheduler)
        return lines

    # -- one step ---------------------------------------------------------------------------------
    def step_once(self, pending: Agreed) -> StepState:
        """Train the batches every rank agreed on, fetch the next step's, and gather: this step's loss,
        the next step's data and every participant's fields ride on the step's one collective."""
        t0 = time.time()  # step_s: from here to the end of the step's collective, host work included
        lr = self.engine.get_lr()[0]
        batches, tokens_sha = self.accept(pending)
        loss_sum = self.train_step(batches)
        now = time.time()
        # step_time: until the collective below, the compute and this step's data wait (what the budget's
        # projection of the next step reads in contribute); then the whole step
        step = StepState(self.step + 1, tokens_sha, lr, step_time=now - t0 + self.data_wait, trained_at=now,
                         last=self.step + 1 >= self.cfg.max_steps)
        # The next step's batches are taken now, so that their agreement rides on this step's one
        # collective with the loss and the participants' fields (none after the last step).
        ahead = self.fetch() if not step.last else {}
        values = {k: v for p in self.participants for k, v in p.contribute(step).items()}
        step.agreed = self.agree({**ahead, **values, "loss_sum": loss_sum})
        # with sequence parallelism each rank's loss is its share of its row group's: the sum over the ranks
        # counts every row group once
        step.loss = step.agreed["loss_sum"] / (self.plan.ds_config["gradient_accumulation_steps"]
                                               * self.plan.data_world)
        step.grad_norm = step.agreed["grad_norm"]
        # The whole step: its compute, the next step's batches (fetched here, so a slow loader shows), the
        # participants' fields and the collective with its one host sync. tokens/s and MFU count this, not the
        # device's share alone (evaluations and saves are their own phases, after it).
        step.step_time = time.time() - t0
        self.step += 1
        self.clock.set_step(self.step)
        self.tokens_seen += self.tokens_per_step
        return step

    def fetch(self) -> dict:
        """Take this rank's micro-batches for the next step; returns what the other ranks must know of
        them (data ended? data error? batch digest, labelled tokens) for the step's collective."""
        accum = self.plan.ds_config["gradient_accumulation_steps"]
        # The state a checkpoint taken before these batches are trained must record (0.2-0.4 ms on the
        # demo mix, measured; the collective this fetch-ahead folds away cost 2-3 ms on 2 gloo ranks).
        self.state_before_fetch = self.loader.state_dict()
        error = None
        try:
            with self.clock.phase("data"):
                batches = [self.loader.next() for _ in range(accum)]  # every rank: the same count, or all stop
        except DataError as e:  # a bad record met mid-stream (streamed sources), on any rank
            error, batches = e, []
        self.fetched = (batches, error, self.clock.last_stay)  # the data wait: the clock's, not timed twice
        ended = error is None and any(b is None for b in batches)
        digest = 0 if (ended or error) else batch_digest(batches)
        # Each rank's labelled tokens: a token-weighted (SFT) loss needs the global count before the
        # first backward (zerotrain.modeling.model.global_token_mean_scale).
        labelled = 0 if (ended or error) else sum(trainable_tokens(b) for b in batches)
        return {"data_ended": int(ended), "data_error": int(error is not None), "batch_digest": digest,
                "labelled": labelled}

    def agree(self, values: dict) -> Agreed:
        """The step's one collective: an all-gather of every rank's row of named fields (STEP_FIELDS and
        the participants'), and its one host sync. Returns the fields reduced (participants/base.py
        Layout): the same values on every rank, so every rank takes the same decisions at the same step."""
        with self.clock.phase("agree"):
            return self._agree(values)

    def _agree(self, values: dict) -> Agreed:
        torch = self.torch
        if self.is_main and "loss_sum" in values:  # the same on every rank: one reader suffices
            values = {**values, "grad_norm": self.engine.get_global_grad_norm()}
        mine = self.layout.pack(values, device=self.engine.device)  # the loss: a device-side copy, no sync
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        self.dist.all_gather(every, mine)
        return self.layout.unpack(torch.stack(every).cpu())  # the host sync

    def accept(self, agreed: Agreed):
        """The fetched micro-batches, once every rank's fields say they may be trained; else the stop all
        ranks agree on (a StopRun, a DataError on the rank that met it, QuietExit on the others)."""
        batches, error, self.data_wait = self.fetched
        self.fetched = None
        if error is not None:
            error.any_rank = True  # this rank met it: it prints the run's one line, whatever its rank (exit 2)
            raise error
        if any(agreed["data_error"]):
            raise QuietExit()
        if any(agreed["data_ended"]):
            self.final_loader_state = self.state_before_fetch
            where = f": {self.loader.exhausted!r}" if self.loader.exhausted else " on another rank"
            raise StopRun("data-exhausted", f"data ran out before step {self.step + 1} (a source with on_exhausted:"
                          f" stop{where})")
        tokens_sha = hashlib.blake2b(b"".join(int(d).to_bytes(8, "little") for d in agreed["batch_digest"]),
                                     digest_size=8).hexdigest()
        # each row group's N ranks hold the same rows: its labelled tokens are counted N times
        self.step_labelled = sum(int(n) for n in agreed["labelled"]) // self.plan.sequence_parallel
        if self.step_labelled == 0:  # the same sum on every rank: all stop together, nothing trained
            raise DataError(f"step {self.step + 1}: the global batch holds no token with a label (nothing to train"
                            " on); the data has records or documents without trainable tokens")
        return batches, tokens_sha

    def loader_state(self) -> dict:
        """The loader's state after the last trained step (the next step's batches may be fetched already)."""
        if self.final_loader_state is not None:
            return self.final_loader_state
        return self.state_before_fetch if self.fetched is not None else self.loader.state_dict()

    def train_step(self, batches) -> float:
        """Forward, backward and optimizer step over the micro-batches; returns the rank-mean loss sum."""
        with self.clock.phase("compute"):
            loss_sum = self._train_step(batches)
            device_done(self.accel)  # the device has finished the step before any clock is read
            return loss_sum

    def _train_step(self, batches) -> float:
        # Pretraining mixes: each micro-batch's mean loss, as before (bit-compatible runs). A mix with an
        # SFT source: each micro-batch's loss SUM, scaled so that DeepSpeed's backward (/ accum, mean over
        # ranks) gives the mean over the global batch's labelled tokens.
        scale = None
        if self.plan.data.token_weighted:
            scale = global_token_mean_scale(self.plan.ds_config["gradient_accumulation_steps"], self.plan.data_world,
                                            self.step_labelled)
        device = self.engine.device
        loss_sum = self.torch.zeros((), dtype=self.torch.float64, device=device)
        for batch in batches:
            # the documents' layout is read from the host's position_ids before the copy, and the copy does not
            # wait (the loader pins the batch on an accelerator): nothing in the forward waits for the host
            documents = self.engine.module.document_layout(batch["position_ids"], device)
            batch = {k: batch[k].to(device, non_blocking=True) for k in MODEL_KEYS}
            batch["documents"] = documents
            loss = self.engine(**batch) if scale is None else self.engine(**batch, loss_reduction="sum") * scale
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.detach().double()
        return loss_sum * (self.hooks.spike_factor(self.rank, self.step + 1) if not self.rollbacks else 1.0)

    # -- saving -----------------------------------------------------------------------------------
    def save(self) -> Path:
        with self.clock.phase("save"):
            self.hooks.hang_here(self.rank, "save", self.step, self.plan.run_dir)
            return self._save()

    def _save(self) -> Path:
        states = [None] * self.world
        self.dist.all_gather_object(states, self.loader_state())
        states = states[::self.plan.sequence_parallel]  # one per loader: a row group's ranks share theirs
        client_state = {"zerotrain": {"step": self.step, "tokens_seen": self.tokens_seen, "loader_states": states,
                                      "elapsed_s": self.elapsed(),
                                      "gpu_seconds": self.budget.gpu_seconds(self.elapsed()),
                                      "guards": self.guard_states()}}
        meta = {"step": self.step, "tokens_seen": self.tokens_seen, "world_size": self.world,
                "sequence_parallel": self.plan.sequence_parallel,
                "run_id": self.plan.run_dir.name, "loader_workers": self.plan.loader_settings["workers"]}
        t0 = time.time()
        self.last_saved = self.checkpointer.save(self.engine, self.step, client_state, meta)
        if self.universal_dir is not None:  # the conversion is not needed once this world has saved
            if self.is_main:
                shutil.rmtree(self.universal_dir.parent, ignore_errors=True)
            self.universal_dir = None
        self.last_save_s = time.time() - t0
        self.save_seconds += self.last_save_s
        self.saves += 1
        return self.last_saved

    def guard_states(self) -> dict:
        """What the participants keep across a resume, by their key (spike detector, early stopping)."""
        return {p.saved_as: p.state_dict() for p in self.participants if p.saved_as}

    def elapsed(self, at: float | None = None) -> float:
        """Training seconds across resumes, now (or at the time.time() `at`)."""
        return self.elapsed_before + (time.time() if at is None else at) - self.t_start

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> RunResult:
        self.signals.install()
        self.save_seconds = self.last_save_s = 0.0
        self.saves = 0
        self.t_start = time.time()
        for p in self.participants:
            p.open()
        logger = StepLogger(self.metrics, self.budget, is_main=self.is_main, world=self.world,
                            tokens_per_step=self.tokens_per_step, max_steps=self.cfg.max_steps, first_step=self.step,
                            flops_per_token=flops_per_token(self.plan.model_args, self.cfg.seq_len),
                            peak_flops=self.plan.settings.peak_flops_per_device, accelerator=self.accel)
        self.clock.take_window()  # set-up is not a window
        try:
            stop = self._loop(logger)
            logger.close()
            if stop.save and self.last_saved != self.plan.ckpt_dir / checkpoint.tag_for(self.step):
                try:
                    self.save()
                except CheckpointError as e:
                    stop = StopRun("save-failed", str(e))
            with self.clock.phase("mirror"):
                self.checkpointer.wait()  # pending hashing and mirror copies
            self.hooks.die_after_end_here(self.rank)
        finally:
            self.signals.restore()
            logger.close()
        return self._finish(stop)

    def _loop(self, logger: StepLogger) -> StopRun:
        """Each step: train, gather once, then the participants observe it, the record is written, and
        they act on it (participants/base.py); the first StopRun ends the run, REWOUND goes on."""
        pending = None  # every rank's fields for the fetched batches, from the last collective
        first = self.plan.settings.compile  # the first step compiles the blocks: say how long that took
        try:
            while self.step < self.cfg.max_steps:
                if pending is None:  # the first step (or a rollback from the last): fetch and agree alone
                    pending = self.agree(self.fetch())
                step = self.step_once(pending)
                if first:
                    first = False
                    self.say(f"torch.compile: the first step took {step.step_time:.1f} s, compiling included")
                pending = step.agreed if self.fetched is not None else None
                outcome = self.call("observe", step)
                if outcome is None:
                    with self.clock.phase("log"):
                        step.record = self.log_step(step, logger)
                    outcome = self.call("logged", step)
                if isinstance(outcome, StopRun):
                    return outcome
            return StopRun("finished", f"reached --max-steps {self.cfg.max_steps}")
        except StopRun as s:
            return s
        except CheckpointError as e:
            return StopRun("save-failed", str(e))

    def call(self, hook: str, step: StepState):
        """Each participant's `hook` in turn, until one returns a StopRun or REWOUND."""
        for p in self.participants:
            outcome = getattr(p, hook)(step)
            if outcome is not None:
                return outcome
        return None

    def log_step(self, step: StepState, logger: StepLogger) -> dict:
        """The step's record (metrics.jsonl, the sinks, the progress bar)."""
        window = step.window
        return logger.log(step.step, step.loss, step.lr, step.tokens_sha, step.step_time, data_wait_s=self.data_wait,
                          grad_norm=step.grad_norm, tokens_seen=self.tokens_seen, elapsed_s=self.elapsed(),
                          val=step.val, data_shares=self.data_shares(), window=window and window[0].figures())

    def _finish(self, stop: StopRun) -> RunResult:
        """The end of the run recorded and said (rank 0's manifest before any rank exits)."""
        self.metrics.event("stop", self.step, reason=stop.kind, message=stop.message, saves=self.saves,
                           save_blocked_s=round(self.save_seconds, 3))
        self.metrics.close()
        if self.is_main:
            manifest.record_end(self.plan.run_dir, stop, self.step)  # the kind, its exit code and the message
            report_exit(stop.exit_code)
        # Nobody exits before rank 0's last write: DeepSpeed's launcher SIGTERMs the other ranks as
        # soon as one exits non-zero (codes 3-7 are non-zero by design).
        self.dist.barrier()
        if stop.end.failed:  # one line on stderr, as for bad input
            if self.is_main:
                print(f"zerotrain: error: {stop.message}", file=sys.stderr, flush=True)
        else:
            self.say(f"{stop.message}; saved checkpoint {self.last_saved}" if stop.save else stop.message)
        if self.plan.settings.compile:
            self.say(f"torch.compile: {torch_private.compiled_graphs()} graphs compiled")
        self.say(f"run directory: {self.plan.run_dir.resolve()}")
        return RunResult(run_dir=self.plan.run_dir, step=self.step, tokens_seen=self.tokens_seen, stop=stop.kind,
                         message=stop.message, exit_code=stop.exit_code, last_checkpoint=self.last_saved,
                         extra={"offload": offload.offloaded(self.plan.ds_config)})

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

    def close(self) -> None:
        if self.watchdog is not None:  # first: a watchdog that has fired ends the process from here
            self.watchdog.stop()
            self.watchdog = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        for p in self.participants:
            p.close()
        self.checkpointer.close()
        self.loader.close()
        # A notebook calls run() again in this process: without this each run kept its
        # whole engine alive (~1 GB for `tiny`). ZeRO-3's hooks on tensors hold the engine where
        # gc cannot see them (destroy() removes them); DeepSpeed 0.19 also keeps modules in globals.
        self.engine.destroy()
        ds_compat.release_zero3_globals(self.engine.module)

    # -- what a step's record needs from every rank -----------------------------------------------
    def data_shares(self) -> list[tuple[str, float, float]] | None:
        """Every --log-data-every-steps: each source's share of the tokens trained so far, summed over the
        ranks (an all-reduce, every rank), with its weight in the mix; None at other steps."""
        every = self.cfg.log_data_every_steps
        if not every or self.step % every:
            return None
        torch = self.torch
        per_source = torch.tensor(self.loader.tokens_per_source(), dtype=torch.float64, device=self.engine.device)
        self.dist.all_reduce(per_source)
        shares = (per_source / per_source.sum()).tolist()
        return [(s.name, x, s.weight) for s, x in zip(self.plan.data.specs, shares)]


# ------------------------------------------------------------------------------------------------
# The one entry: the CLI (launcher/train.py) and the notebook call this
# ------------------------------------------------------------------------------------------------

def run(cfg: RunConfig | dict, *, hard_exit: bool = True) -> RunResult:
    """Plan, build and train one run in this process (one rank of a launch, or a world of 1).

    Raises UsageError / DataError (bad input: nothing was written) — the CLI turns them into
    exit status 2. hard_exit=False (a notebook): a second SIGINT raises KeyboardInterrupt instead of
    os._exit, which would kill the kernel. A run that ends otherwise returns a RunResult whose exit_code says how.
    """
    if isinstance(cfg, dict):
        cfg = config_from(cfg)
    if cfg.dry_run:
        return dry_run(cfg)
    single_process_env()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    plan = plan_run(cfg, world, rank)
    if plan.finished:  # started again after its last save: nothing to train
        stop, meta = finished_again(plan), plan.resume_meta
        return RunResult(run_dir=plan.run_dir, step=meta["step"], tokens_seen=meta.get("tokens_seen", 0), stop=stop.kind,
                         message=stop.message, exit_code=stop.exit_code, last_checkpoint=plan.resume_from)
    try:
        trainer = Trainer(plan, hard_exit=hard_exit, watch=True)
    except BaseException:
        watchdog.stop_all()  # a Trainer that failed to build leaves no watchdog behind (a notebook goes on)
        raise
    try:
        return trainer.train()
    except BaseException as e:
        if not oom.is_out_of_memory(e):
            raise
        return out_of_memory(trainer, e)  # world of 1: the end recorded and returned; else this rank exits here
    finally:
        trainer.close()


def out_of_memory(trainer: Trainer, error: BaseException) -> RunResult:
    """A rank out of memory (components/oom.py) ends the run as "oom": its exit code (never restarted) and one line.
    In a world of 1 the end is recorded as any other (`_finish`); with more ranks the others wait in the step's
    collective for this one, so this rank records the end itself (manifest.json, its exit code for `zerotrain launch`),
    says the line and leaves at once: its launcher then ends the others."""
    plan = trainer.plan
    stop = StopRun("oom", oom.out_of_memory_message(plan, trainer.step, error, plan.node.device))
    if plan.world == 1:
        return trainer._finish(stop)
    try:  # whichever rank it is, as the hang watchdog does: rank 0 may be the one waiting
        manifest.record_end(plan.run_dir, stop, trainer.step, rank0_only=False)
    except OSError:
        pass  # the exit code still says it
    report_exit(stop.exit_code)  # written before any other rank can fail on this one's absence
    report_rank_end(stop.exit_code)
    print(f"zerotrain: error: {stop.message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(stop.exit_code)


def dry_run(cfg: RunConfig, world: int | None = None) -> RunResult:
    """`--dry-run`: the run resolved against its profile's hardware (or the launch's world size when
    launched), printed; nothing built, nothing written. Recipes are checked this way in CI."""
    if world is None:
        hw = profile_value(load_profile(cfg.profile)[1], "hardware", {}) if cfg.profile != "auto" else {}
        world = int(os.environ.get("WORLD_SIZE") or hw.get("devices_per_node", 1) * hw.get("nodes", 1))
    plan = plan_run(dataclasses.replace(cfg, dry_run=True), world, 0)  # no fit check against this machine
    cfg = plan.cfg  # resolved: lr and the schedule from the flags, the recipe, the profile or the model
    ds, s, args = plan.ds_config, plan.settings, plan.model_args
    n = count_params(args)
    lines = [f"dry run: {plan.run_dir} (nothing built or written)",
             f"profile {plan.profile_name}, world {world}, ZeRO-{ds['zero_optimization'].get('stage', 0)},"
             f" batch {plan.batch_shape} x {cfg.seq_len} = {ds['train_batch_size'] * cfg.seq_len:,} tokens per step",
             f"model {plan.model_label}: {n['total']:,} parameters ({n['non_embedding']:,} non-embedding),"
             f" vocab {args.vocab_size:,} (tokenizer {plan.tokenizer.name}: {plan.tokenizer.vocab_size:,}),"
             f" optimizer {cfg.optimizer or 'adamw'}",
             *describe(plan),  # the start-up's lines (run_plan.describe)
             *(f"zerotrain: warning: {line}" for line in offload.describe_stale_locks())]
    lines += hub_lines(plan.data.specs, plan.tokenizer)  # each hub name: cached, reachable, or refused (exit 2)
    fits = None
    hw = s.hardware
    if "device_memory_gib" in hw or hw.get("accelerator") == "cpu":
        nodes = hw.get("nodes", 1) if world >= hw.get("nodes", 1) else 1
        setup = planning.setup_from(ds, s.values, world=world, nodes=nodes, optimizer=cfg.optimizer, args=args,
                                   attention=plan.attention)
        p = planning.make_plan(args, setup, planning.stage_key(ds), ds["train_micro_batch_size_per_gpu"],
                              ds["gradient_accumulation_steps"], cfg.seq_len, bool(s.activation_checkpointing),
                              peak_flops=s.peak_flops_per_device, mfu=s.expected_mfu,
                              total_tokens=cfg.total_tokens, max_hours=cfg.max_hours, budget_usd=cfg.budget_usd,
                              gpu_hour_usd=cfg.gpu_hour_usd, max_steps=cfg.max_steps)
        fits = p["fits"]
        lines.append("plan: " + planning.verdict(p))
    for line in lines:
        print(line, flush=True)
    return RunResult(run_dir=plan.run_dir, step=0, tokens_seen=0, stop="dry-run", message="dry run",
                     exit_code=END_KINDS["dry-run"].exit_code,
                     extra={"fits": fits, "world": world, "ds_config": ds})
