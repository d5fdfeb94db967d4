"""The training run as an object: `run(cfg) -> RunResult` builds a `Trainer` from a frozen `RunPlan`.

    plan_run(cfg, world)   everything decided before any process touches disk or builds a model (run_plan.py,
                           through resolution.resolve, the one resolution `zerotrain plan` and `dry_run` use too)
    Trainer(plan)          process group, run directory, model, engine, data, components, resume
    Trainer.train()        the loop: a list of calls to small components

The Trainer composes three things, each its own module: the step (components/step_runner.py: fetch-ahead, the
forward/backward/optimizer step, the step's one collective), the run's state (components/run_state.py: the
counters, save, rollback, resume) and the step's participants (components/participants/: finite, spikes,
evaluation and best, checkpointing, signals, budget, early stop, health, golden; each declares what it reads and
writes of the step, and their order follows from that). Adding a monitor is a new participant, not an edit of the
Trainer. The other components are listed in docs/layout.md. Test faults are planted by stand-ins (a clock, a
checkpointer, a loader, the step's compute: components/faults.py), built in place of the real ones only when a
ZEROTRAIN_TEST_* variable is set. The feature rooms (launcher/offload/, launcher/sequence/, launcher/resize/:
ZeRO-Offload, sequence parallelism, a resume on another world size) and the planner (launcher/planning/) are
called, not held. How a run ends: StopRun by kind (launcher/errors.py), each kind's exit code in launcher/ends.py.
"""
from __future__ import annotations

import _thread
import dataclasses
import os
import socket
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.dataio.pipeline.loader import Batches
from zerotrain.dataio.sources.hub import hub_lines
from zerotrain import durable, torch_private
from zerotrain.launcher import planning
from zerotrain.launcher.components import ds_compat, faults, manifest, oom, startup_gc
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.components.engine import build_engine, spec_from_plan
from zerotrain.launcher.components.observe import watchdog
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.components.guards import SignalStop
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.observe.metrics import MetricsLogger, StepLogger, read_metrics
from zerotrain.launcher.components import participants
from zerotrain.launcher.components.participants.base import StepState
from zerotrain.launcher.components.run_state import RunState
# QuietExit: commands/train.py imports it from here
from zerotrain.launcher.components.step_runner import QuietExit, StepRunner  # noqa: F401
from zerotrain.launcher.components.process_group import init_process_group
from zerotrain.launcher.components.checkpoints.run_dir_snapshot import RunDirSnapshot
from zerotrain.launcher.components.checkpoints.run_lock import take_lock
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.config_resolve import config_from, identity_hash
from zerotrain.launcher.ends import END_KINDS, EXIT_SIGNAL_HARD
from zerotrain.launcher.errors import CheckpointError, StopRun, UsageError
from zerotrain.launcher.rank_ends import report_exit, report_rank_end  # report_exit: pre-flight too
from zerotrain.launcher.resize import universal
from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.optimizers import describe as describe_optimizer
from zerotrain.launcher.profiles import load_profile
from zerotrain.launcher.settings import profile_value
from zerotrain.launcher.run_plan import RunPlan, say_rank0, describe, finished_again, plan_run, single_process_env
from zerotrain.modeling.model import count_params, flops_per_token

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


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------

class Trainer:
    """Built once from a RunPlan; `train()` runs the loop and returns a RunResult. It composes the step
    (components/step_runner.py), the run's state (components/run_state.py) and the participants."""

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
        # where this rank is (the watchdog) and where its time went (health); a test's hang or death plants here
        self.clock = faults.clock(self.hooks, self.rank, plan.run_dir, step_of=lambda: self.state.step)
        # --hang-timeout, else the profile's (None: the watchdog's default rule; 0: off): launcher/settings.py
        self.hang_timeout = plan.settings.hang_timeout
        for line in offload.describe_stale_locks():  # before the process group: it loads the first op (CPU)
            self.say(f"zerotrain: warning: {line}")
        self.dist, self.accel = init_process_group(plan.settings.dist_backend, plan.settings.comm_timeout_s)
        self.budget = plan.budget  # built once, by plan_run
        if self.budget.active and plan.resume_from is None:  # a resume says it once it knows what was spent
            self.say(self.budget.describe())
        # SIGTERM / SIGINT handled from before the run directory is written: a preemption during start-up (the
        # engine's build, a checkpoint's load: minutes for a large model) ends the run as one in the loop does.
        # A notebook's second signal raises KeyboardInterrupt; a launched rank's records the end and exits.
        # Pre-flight's scratch trainers (watch=False) leave signals to pre-flight until they train.
        self.signals = SignalStop(hard_exit=hard_exit, on_hard_exit=self._record_hard_exit)
        if watch:
            self.signals.install()
        self.lock = self.watchdog = self.snapshot = None
        try:
            self._build(plan, hard_exit, watch)
        except BaseException as e:
            self._abandon(e)
            raise

    def _abandon(self, error: BaseException) -> None:
        """A build that failed (bad input found while loading: --init-from weights with NaN, a checkpoint's loader
        state) leaves nothing running: the signal handlers restored, the watchdog stopped (a notebook goes on:
        it would fire later), the lock released. Bad input leaves the run directory as it was (a new one removed):
        only a launch that took the lock (rank 0) puts it back, never one refused because another process holds it."""
        self.signals.restore()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            if isinstance(error, UsageError) and self.snapshot is not None:  # bad input: the directory as it was
                self.snapshot.restore()

    def _build(self, plan: RunPlan, hard_exit: bool, watch: bool) -> None:
        existed, out_existed = plan.run_dir.is_dir(), plan.run_dir.parent.is_dir()  # the lock creates them
        self.lock = take_lock(plan.run_dir, self.dist, self.is_main, say=self.say, still=self._changed_since_plan)
        # what bad input found from here on puts back (_abandon): taken under the lock, so only this launch writes
        self.snapshot = RunDirSnapshot.take(plan.run_dir, existed, out_existed) if self.is_main else None
        universal_dir = self._universal_dir()
        self._write_run_dir()
        self.watchdog = self._start_watchdog(hard_exit) if watch else None  # pre-flight's scratch runs: none
        self.hooks.sleep(self.hooks.slow_start_s)  # ZEROTRAIN_TEST_SLOW_START: a start-up a signal can fall into
        startup_gc.freeze()  # a launched rank's imports and plan, before the engine (components/startup_gc.py)
        self.engine = self._build_engine(self.accel)
        for line in describe(plan, schedule=plan.resume_from is None):  # the same lines as --dry-run's
            self.say(line)
        self._build_components(universal_dir)
        self.participants = participants.build(self)  # the step's monitors, in participants.ORDER
        self.runner.attach(self.participants)
        self.state.attach(self.participants)
        if plan.resume_from is not None:
            self.state.resume(plan.resume_from)
        else:
            self.metrics.fresh_start()

    # -- building ---------------------------------------------------------------------------------
    def _changed_since_plan(self) -> str | None:
        """Rank 0, the lock held: the refusal when the run directory's checkpoints are not the ones the plan saw
        (another launch wrote or rotated them between the plan and the lock: it ended meanwhile), else None."""
        plan = self.plan
        now = tuple(checkpoint.complete_checkpoints(plan.ckpt_dir))
        if now == plan.checkpoints_seen:
            return None
        return (f"run directory {plan.run_dir} changed while this launch started (its checkpoints were"
                f" {_tags(plan.checkpoints_seen)}, now {_tags(now)}: another launch wrote it meanwhile); run the"
                " command again")

    def _universal_dir(self) -> Path | None:
        """A resume on another world size: the checkpoint converted to DeepSpeed's universal format (rank 0)."""
        plan = self.plan
        if plan.resume_from is None or plan.resume_meta["world_size"] == self.world:
            return None
        universal_dir = universal.convert_on_rank0(
            plan.resume_from, out_dir=plan.ckpt_dir / "universal" / plan.resume_from.name)
        self.say(f"converted {plan.resume_from} (saved by {plan.resume_meta['world_size']} rank(s)) to a universal"
                 f" checkpoint for {self.world} rank(s): {universal_dir}")
        return universal_dir

    def _build_components(self, universal_dir: Path | None) -> None:
        plan, cfg = self.plan, self.cfg
        self.checkpointer = faults.checkpointer(  # a test's failed or slow saves: its stand-in
            self.hooks, plan.ckpt_dir, plan.run_dir.name, self.rank, self.world,
            save_every_steps=cfg.checkpoints.save_every_steps, save_every_hours=cfg.checkpoints.save_every_hours,
            keep_last=cfg.checkpoints.keep_last, keep_best=cfg.checkpoints.keep_best,
            mirror=Path(cfg.checkpoints.mirror) if cfg.checkpoints.mirror else None, say=self.say,
            best_by=(plan.settings.best_by, plan.best_higher) if plan.best_higher is not None else None)
        self.tokens_per_step = plan.tokens_per_step
        self.metrics = MetricsLogger(plan.run_dir, self.is_main, cfg, say=self.say)  # --log sinks
        self.evaluator = None
        if plan.eval_rows:
            self.evaluator = Evaluator(plan.eval_rows, plan.data_rank, plan.data_world,
                                       plan.ds_config["train_micro_batch_size_per_gpu"], plan.sequence_parallel,
                                       self.rank % plan.sequence_parallel)
        self.runner = self._build_step()
        self.state = RunState(plan, engine=self.engine, dist=self.dist, checkpointer=self.checkpointer,
                              budget=self.budget, metrics=self.metrics, clock=self.clock, say=self.say,
                              loader=self.runner.loader, loader_state=self.runner.loader_state,
                              universal_dir=universal_dir)
        self.runner.compute = faults.spiked(self.hooks, self.runner.compute, self.rank, self.state)  # a test's spike

    def _build_step(self) -> StepRunner:
        plan = self.plan
        return StepRunner(engine=self.engine, loader=self._build_data(), clock=self.clock, dist=self.dist,
                          accel=self.accel, rank=self.rank, world=self.world,
                          accum=plan.ds_config["gradient_accumulation_steps"], data_world=plan.data_world,
                          sequence_parallel=plan.sequence_parallel, token_weighted=plan.data.token_weighted,
                          max_steps=self.cfg.schedule.max_steps)

    def _build_data(self):
        plan, cfg = self.plan, self.cfg
        # sequence parallelism: the N ranks of a group read the same rows (each model keeps its stretch of them)
        loader = Batches(plan.data, plan.data_rank, plan.data_world, cfg.run.seed, cfg.data.seq_len,
                         plan.ds_config["train_micro_batch_size_per_gpu"], plan.loader_settings,
                         plan.loader_settings["packing"])
        # a test's slow data or OOM: the loader wrapped (components/hooks.py)
        return self.hooks.slow_training_data(loader, self.rank, plan.ds_config["gradient_accumulation_steps"])

    @property
    def loader(self):
        """The training loader (the step's; pre-flight's sweep replaces it before the first step)."""
        return self.runner.loader

    @loader.setter
    def loader(self, loader) -> None:
        self.runner.loader = loader

    def _write_run_dir(self) -> None:
        plan = self.plan
        hosts = self._hosts()  # a collective: every rank, outside the rank-0 branch
        if self.is_main:
            plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
            resolved = {"run": self.cfg.to_dict(), "run_id": plan.run_dir.name, "profile": plan.profile_name,
                        "world_size": self.world, "model": plan.model_args.to_dict(),
                        "tokenizer": plan.tokenizer.name,
                        "tokenizer_sha256": getattr(plan.tokenizer, "sha256", None),  # export checks it
                        "sources": [s.__dict__ for s in plan.data.specs],
                        "identity_hash": identity_hash(self.cfg),
                        "run_sources": plan.settings.sources,  # where every setting came from (settings.py)
                        "attention": plan.attention, "deterministic": plan.deterministic}  # the kernel resolved
            durable.write_json(plan.run_dir / "config.json", resolved)  # read back: drift checks, export, resume
            durable.write_json(plan.run_dir / "ds_config.json", plan.ds_config)
            manifest.write_or_extend(plan.run_dir, run_id=plan.run_dir.name, config_hash=identity_hash(self.cfg),
                                     profile=plan.profile_name, seed=self.cfg.run.seed, world_size=self.world,
                                     hosts=hosts, resumed_from=str(plan.resume_from or "") or None,
                                     test_hooks=dict(self.hooks.variables))
        self.dist.barrier()

    def _record_hard_exit(self, message: str) -> None:
        """A second signal's end (guards.SignalStop, just before os._exit): rank 0 records it in manifest.json and
        leaves its exit code for `zerotrain launch`, which would otherwise see the launcher's SIGTERM (143)."""
        if self.is_main:
            state = getattr(self, "state", None)
            manifest.record_end(self.plan.run_dir, StopRun("hard-signal", message), state.step if state else 0)
            report_exit(EXIT_SIGNAL_HARD)

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
                 f" world {self.world}, batch {plan.batch_shape} x {cfg.data.seq_len} tokens")
        self.say(f"parameters held per rank after construction: {', '.join(f'{n:,}' for n in held)}"
                 f" of {n_params['total']:,}" + (", compiled with torch.compile" if self.plan.settings.compile else ""))
        return engine

    # -- the loop ---------------------------------------------------------------------------------
    def train(self) -> RunResult:
        self.signals.install()
        self.state.start()
        for p in self.participants:
            p.open()
        logger = StepLogger(self.metrics, self.budget, is_main=self.is_main, world=self.world,
                            tokens_per_step=self.tokens_per_step, max_steps=self.cfg.schedule.max_steps,
                            first_step=self.state.step,
                            flops_per_token=flops_per_token(self.plan.model_args, self.cfg.data.seq_len),
                            peak_flops=self.plan.settings.peak_flops_per_device, accelerator=self.accel)
        startup_gc.resume()  # a launched rank's start-up is over (components/startup_gc.py; in-process: nothing)
        self.clock.take_window()  # set-up is not a window
        first_step = self.state.step  # a stop before any step of this launch saves nothing (nothing new)
        try:
            # a stop that holds before this launch's first step (participants/base.py `over_before`: a signal during
            # start-up, a resumed run that ended on its budget or patience) ends it with nothing trained
            stop = self.call("over_before")
            stop = self._loop(logger) if stop is None else stop
            logger.close()
            tag = self.plan.ckpt_dir / checkpoint.tag_for(self.state.step)
            if stop.save and self.state.step > first_step and self.state.last_saved != tag:
                try:
                    self.state.save()
                except CheckpointError as e:
                    stop = StopRun("save-failed", str(e))
            with self.clock.phase("mirror"):
                self.checkpointer.wait()  # pending hashing and mirror copies
        finally:
            self.signals.restore()
            logger.close()
        return self._finish(stop)

    def _loop(self, logger: StepLogger) -> StopRun:
        """Each step: train, gather once, then the participants observe it, the record is written, and
        they act on it (participants/base.py); the first StopRun ends the run, REWOUND goes on."""
        pending, runner = None, self.runner  # pending: every rank's fields for the fetched batches
        first = self.plan.settings.compile  # the first step compiles the blocks: say how long that took
        try:
            while self.state.step < self.cfg.schedule.max_steps:
                if pending is None:  # the first step (or a rollback from the last): fetch and agree alone
                    pending = runner.agree(runner.fetch())
                step = runner.step_once(pending, self.state)
                if first:
                    first = False
                    self.say(f"torch.compile: the first step took {step.step_time:.1f} s, compiling included")
                pending = step.agreed if runner.fetched is not None else None
                outcome = self.call("observe", step)
                if outcome is None:
                    with self.clock.phase("log"):
                        step.record = self.log_step(step, logger)
                    outcome = self.call("logged", step)
                if isinstance(outcome, StopRun):
                    return outcome
            return StopRun("finished", f"reached --max-steps {self.cfg.schedule.max_steps}")
        except StopRun as s:
            return s
        except CheckpointError as e:
            return StopRun("save-failed", str(e))

    def call(self, hook: str, *step: StepState):
        """Each participant's `hook` in turn (with the step, where the hook takes one), until one returns a StopRun
        or REWOUND; every rank calls the same hooks in the same order."""
        for p in self.participants:
            outcome = getattr(p, hook)(*step)
            if outcome is not None:
                return outcome
        return None

    def log_step(self, step: StepState, logger: StepLogger) -> dict:
        """The step's record (metrics.jsonl, the sinks, the progress bar)."""
        window, state = step.window, self.state
        return logger.log(step.step, step.loss, step.lr, step.tokens_sha, step.step_time,
                          data_wait_s=self.runner.data_wait, grad_norm=step.grad_norm, tokens_seen=state.tokens_seen,
                          elapsed_s=state.elapsed(), val=step.evaluated, data_shares=self.data_shares(),
                          window=window and window[0].figures())

    def _finish(self, stop: StopRun) -> RunResult:
        """The end of the run recorded and said (rank 0's manifest before any rank exits)."""
        state = self.state
        self.metrics.event("stop", state.step, reason=stop.kind, message=stop.message, saves=state.saves,
                           save_blocked_s=round(state.save_seconds, 3))
        self.metrics.close()
        if self.is_main:
            try:
                manifest.record_end(self.plan.run_dir, stop, state.step)  # the kind, its exit code and the message
            except OSError as e:  # a full or read-only disk (often why a save failed): the exit code still says it
                self.say(f"zerotrain: warning: {self.plan.run_dir / manifest.MANIFEST}: the run's end could not be"
                         f" recorded ({e.strerror or e})")
            report_exit(stop.exit_code)
        # Nobody exits before rank 0's last write: DeepSpeed's launcher SIGTERMs the other ranks as
        # soon as one exits non-zero (codes 3-7 are non-zero by design).
        self.dist.barrier()
        if stop.end.failed:  # one line on stderr, as for bad input
            if self.is_main:
                print(f"zerotrain: error: {stop.message}", file=sys.stderr, flush=True)
        else:
            kept = "saved" if state.saves else "last"  # a stop before this launch's first step saved nothing
            self.say(f"{stop.message}; {kept} checkpoint {state.last_saved}" if stop.save and state.last_saved
                     else stop.message)
        if self.plan.settings.compile:
            self.say(f"torch.compile: {torch_private.compiled_graphs()} graphs compiled")
        self.say(f"run directory: {self.plan.run_dir.resolve()}")
        return RunResult(run_dir=self.plan.run_dir, step=state.step, tokens_seen=state.tokens_seen, stop=stop.kind,
                         message=stop.message, exit_code=stop.exit_code, last_checkpoint=state.last_saved,
                         extra={"offload": offload.offloaded(self.plan.ds_config)})

    def close(self) -> None:
        self.signals.restore()  # the handlers before this run's (a notebook goes on)
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

    def data_shares(self) -> list[tuple[str, float, float]] | None:
        """Every --log-data-every-steps: each source's share of the tokens trained so far, summed over the
        ranks (an all-reduce, every rank), with its weight in the mix; None at other steps."""
        every = self.cfg.data.log_data_every_steps
        if not every or self.state.step % every:
            return None
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
    if cfg.run.dry_run:
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
    stop = StopRun("oom", oom.out_of_memory_message(plan, trainer.state.step, error, plan.node.device))
    if plan.world == 1:
        return trainer._finish(stop)
    try:  # whichever rank it is, as the hang watchdog does: rank 0 may be the one waiting
        manifest.record_end(plan.run_dir, stop, trainer.state.step, rank0_only=False)
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
        profile = cfg.parallel.profile
        hw = profile_value(load_profile(profile)[1], "hardware", {}) if profile != "auto" else {}
        world = int(os.environ.get("WORLD_SIZE") or hw.get("devices_per_node", 1) * hw.get("nodes", 1))
    dry = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dry_run=True))
    plan = plan_run(dry, world, 0)  # no fit check against this machine
    cfg = plan.cfg  # resolved: lr and the schedule from the flags, the recipe, the profile or the model
    ds, s, args = plan.ds_config, plan.settings, plan.model_args
    n = count_params(args)
    lines = [f"dry run: {plan.run_dir} (nothing built or written)",
             f"profile {plan.profile_name}, world {world}, ZeRO-{ds['zero_optimization'].get('stage', 0)},"
             f" batch {plan.batch_shape} x {cfg.data.seq_len} = {ds['train_batch_size'] * cfg.data.seq_len:,} tokens per"
             " step",
             f"model {plan.model_label}: {n['total']:,} parameters ({n['non_embedding']:,} non-embedding),"
             f" vocab {args.vocab_size:,} (tokenizer {plan.tokenizer.name}: {plan.tokenizer.vocab_size:,}),"
             f" optimizer {cfg.schedule.optimizer or 'adamw'}",
             *describe(plan),  # the start-up's lines (run_plan.describe)
             *(f"zerotrain: warning: {line}" for line in offload.describe_stale_locks())]
    lines += hub_lines(plan.data.specs, plan.tokenizer)  # each hub name: cached, reachable, or refused (exit 2)
    fits = None
    hw = s.hardware
    if "device_memory_gib" in hw or hw.get("accelerator") == "cpu":
        nodes = hw.get("nodes", 1) if world >= hw.get("nodes", 1) else 1
        setup = planning.setup_from(ds, s.values, world=world, nodes=nodes, optimizer=cfg.schedule.optimizer, args=args,
                                   attention=plan.attention)
        p = planning.make_plan(args, setup, planning.stage_key(ds), ds["train_micro_batch_size_per_gpu"],
                              ds["gradient_accumulation_steps"], cfg.data.seq_len, bool(s.activation_checkpointing),
                              peak_flops=s.peak_flops_per_device, mfu=s.expected_mfu,
                              total_tokens=cfg.schedule.total_tokens, max_hours=cfg.budget.max_hours,
                              budget_usd=cfg.budget.budget_usd,
                              gpu_hour_usd=cfg.budget.gpu_hour_usd, max_steps=cfg.schedule.max_steps)
        fits = p["fits"]
        lines.append("plan: " + planning.verdict(p))
    for line in lines:
        print(line, flush=True)
    return RunResult(run_dir=plan.run_dir, step=0, tokens_seen=0, stop="dry-run", message="dry run",
                     exit_code=END_KINDS["dry-run"].exit_code,
                     extra={"fits": fits, "world": world, "ds_config": ds})


def _tags(checkpoints) -> str:
    return ", ".join(p.name for p in checkpoints) or "none"
