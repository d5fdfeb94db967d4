"""Pre-flight's harness: the command line, the runner that takes the stages in turn, the verdict every
rank agrees on for each check, and what is printed and written. The stages themselves: stability.py
(v1), throughput.py (v2), rehearsal.py (v3); what they measure with: measure.py.

Every rank runs every check; each check's verdict is agreed by all ranks (one all-gather), rank 0
prints it as PASS/FAIL/SKIP with its time and writes RUN_DIR/preflight/<stage>.json. Any FAIL exits
with the "preflight-failed" code (launcher/ends.py) and says what to fix. The training it does runs in
scratch run directories, RUN_DIR/preflight/scratch/<name>/ (wiped before use, checkpoints deleted
after), built with the driver's own pieces (`plan_run`, `Trainer`) from the run's RunConfig with only
run-kind fields changed (steps, out, run id, resume; no mirror, no sinks, no budgets): nothing of the
real run's checkpoints or metrics is touched. The driver's own output goes to RUN_DIR/preflight/<stage>.log.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import shutil
import sys
import time
import traceback

import torch

from zerotrain import durable
from zerotrain.cli_args import Parser
from zerotrain.launcher.commands.preflight.measure import device_description, reset_peak_rss, slowed
from zerotrain.launcher.commands.preflight.rehearsal import Rehearsal
from zerotrain.launcher.commands.preflight.stability import Stability
from zerotrain.launcher.commands.preflight.throughput import Throughput
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.observe.metrics import read_metrics
from zerotrain.launcher.components.process_group import init_process_group, rendezvous_store
from zerotrain.launcher.components.checkpoints.run_lock import take_lock
from zerotrain.launcher.config import with_values
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.ends import EXIT_PREFLIGHT_FAILED, EXIT_USAGE
from zerotrain.launcher.errors import UsageError, ZerotrainError, fail
from zerotrain.launcher.hparams import size_in_tokens
from zerotrain.launcher.profiles import resolve_ds_config
from zerotrain.launcher.sequence.checks import check_sequence_parallel_plan
from zerotrain.launcher.run_plan import identify, load_eval_tasks, plan_run, single_process_env
from zerotrain.launcher.trainer import Trainer, report_exit

STAGES = {stage.name: stage for stage in (Stability, Throughput, Rehearsal)}
# How long a rank that ran out of memory waits for the others' outcome of a sweep candidate before it concludes
# that one of them is stuck inside a collective of the step (far below the comm timeout, 30 minutes; ranks that
# ran out of memory together report within moments of each other).
OUTCOME_WAIT_S = 20.0  # --stage name -> its checks


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(pre-flight's own options, the train flags)."""
    p = Parser(prog="zerotrain preflight", allow_abbrev=False,
               description="Staged checks before a long run (docs/preflight.md).",
               epilog="Then the run's own flags, exactly as for `zerotrain train` (see its --help).")
    p.add_argument("--stage", required=True, help="v1 (stability), v2 (throughput), v3 (dress rehearsal), or"
                                                  " several separated by commas")
    p.add_argument("--steps", type=int, default=None, help="v3: steps of the rehearsal (default: 1%% of --max-steps,"
                                                           " 20 to 200)")
    p.add_argument("--sweep", default=None, help="v2: micro-batches to try, e.g. 4,8,16 (default: half, 1x, 2x, 4x"
                                                 " the run's)")
    p.add_argument("--sweep-steps", type=int, default=5, help="v2: steps per micro-batch (default 5)")
    p.add_argument("--loader-seconds", type=float, default=3.0, help="v2: how long to time the loader alone")
    ns, rest = p.parse_known_args(argv)
    stages = [s.strip() for s in ns.stage.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if not stages or bad:
        raise UsageError(f"--stage {ns.stage}: choose v1, v2 or v3 (or several, e.g. v1,v2)")
    ns.stages = list(dict.fromkeys(sorted(stages)))
    for name in ("steps", "sweep_steps"):
        v = getattr(ns, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer, got {v}")
    if not ns.loader_seconds > 0:
        raise UsageError(f"--loader-seconds: must be a positive number, got {ns.loader_seconds}")
    if ns.sweep is not None:
        try:
            ns.sweep = sorted({int(x) for x in ns.sweep.split(",")})
        except ValueError:
            raise UsageError(f"--sweep {ns.sweep}: expected micro-batch sizes separated by commas, e.g. 4,8,16") \
                from None
        if not ns.sweep or ns.sweep[0] < 1:
            raise UsageError(f"--sweep {ns.sweep}: micro-batch sizes must be positive")
    return ns, rest


class Skip(Exception):
    """A check that cannot run because an earlier one failed (decided alike on every rank)."""


class OnMain(ZerotrainError):
    """Something rank 0 alone computes (from files it wrote) failed; every rank raises this."""


class Preflight:
    """One launch's pre-flight: `run()` runs the stages asked for and returns the exit code.

    Every control decision is taken on values every rank has (agreed verdicts, or what rank 0 read
    and broadcast with `from_main`): a rank that took another branch would leave the others
    waiting in a collective."""

    def __init__(self, cfg, opts: argparse.Namespace):
        self.cfg, self.opts = cfg, opts
        self.dist = self.lock = None
        self.locked = False
        self.hooks = TestHooks.from_env()  # read once; the scratch Trainers read theirs once each

    def run(self) -> int:
        single_process_env()
        self.world, self.rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        self.is_main = self.rank == 0
        if self.hooks.variables:  # said first, as the run says it: the scratch Trainers' own go to the stage log
            self.say(self.hooks.describe())
        ident = identify(self.cfg)  # bad input: UsageError, exit 2; --profile auto: detected here
        # what the run refuses of --sequence-parallel for this world, in its words, before any stage writes
        check_sequence_parallel_plan(ident.cfg, ident.settings, ident.model_args, self.world)
        # --eval-tasks that cannot load (no network, no cache, a bad file): refused as the run refuses them
        load_eval_tasks(ident.cfg, ident.settings, tokens_per_step=1)  # (the cadence is not used here)
        self.cfg, self.run_dir, self.profile_name, self.profile = ident.cfg, ident.run_dir, ident.profile_name, \
            ident.profile  # the v2 sweep resolves its candidates' DeepSpeed dicts from the profile
        # the run's length and warmup when given in tokens (the rehearsal's steps follow the run's)
        self.cfg = size_in_tokens(self.cfg, resolve_ds_config(self.profile, self.cfg, self.world,
                                                              f"profile {self.profile_name}")["train_batch_size"]
                                  * self.cfg.data.seq_len)
        self.settings = ident.settings  # the run's own: the process group gets the run's comm timeout
        self.model_args = ident.model_args  # v1's sequence-parallel check splits its heads
        self.root = self.run_dir / "preflight"
        failed = False
        try:
            for stage in self.opts.stages:  # each stage's objects (engines, data) go when it ends
                failed |= not STAGES[stage](self).run()
        finally:
            if self.lock is not None:
                self.lock.release()
        code = EXIT_PREFLIGHT_FAILED if failed else 0
        if self.dist is not None:
            self.dist.barrier()  # nobody leaves before rank 0 has written: the launcher stops the others at once
        if self.is_main:
            report_exit(code)  # `zerotrain launch`: rank 0's code, not the deepspeed launcher's 1
        return code

    # -- checks, agreement, output ---------------------------------------------------------------
    def start_stage(self, stage: str) -> None:
        self.stage, self.checks, self.t_stage = stage, [], time.time()
        self.log = self.root / f"{stage}.log"
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            self.log.write_text("")
        self.say(f"preflight {stage} ({STAGES[stage].title}): {self.world} rank(s), run directory {self.run_dir}")

    def end_stage(self, extra: dict | None = None) -> bool:
        ok = all(c["status"] != "FAIL" for c in self.checks)
        if self.is_main:
            path = self.root / f"{self.stage}.json"
            durable.write_json(path, {"stage": self.stage, "title": STAGES[self.stage].title, "ok": ok,
                                      "run_dir": str(self.run_dir), "world_size": self.world,
                                      "profile": self.profile_name, "device": device_description(),
                                      "seconds": round(time.time() - self.t_stage, 3),
                                      "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": self.cfg.to_dict(),
                                      "checks": self.checks, **(extra or {})}, default=str)
            failed = sum(c["status"] == "FAIL" for c in self.checks)
            verdict = "PASS" if ok else f"FAIL ({failed} of {len(self.checks)} checks failed)"
            print(f"{self.stage}: {verdict} -> {path} (driver output: {self.log})", flush=True)
        return ok

    @contextlib.contextmanager
    def quiet(self):
        """The driver's own prints (rank 0's) go to the stage's log; pre-flight prints the verdicts."""
        if not self.is_main:
            yield
            return
        with open(self.log, "a") as f, contextlib.redirect_stdout(f):
            yield

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def check(self, name: str, fn, fix: str) -> dict:
        """Run one check on every rank, agree on its verdict, print and record it.

        fn() returns (ok, detail, data) or raises: a ZerotrainError is this check's FAIL; Skip marks
        it skipped; anything else is a FAIL with its traceback in the log. With several ranks an
        unexpected exception may have left the other ranks inside a collective, so that rank says so
        and leaves (the launcher then stops the others) rather than hang the launch.
        `data["seconds"]`, when given, is the check's time (the part of the work it measures)."""
        t0 = time.time()
        data: dict = {}
        try:
            with self.quiet():
                ok, detail, data = fn()
        except Skip as e:
            ok, detail = None, str(e)
        except ZerotrainError as e:
            ok, detail = False, str(e)
        except Exception as e:  # a crash is this check's result: which check and why, in one line
            ok, detail = False, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
            with open(self.log if self.is_main else os.devnull, "a") as f:
                traceback.print_exc(file=f)
            if self.world > 1:
                print(f"zerotrain: preflight {self.stage} {name}: FAIL on rank {self.rank}: {detail}", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_PREFLIGHT_FAILED)
        seconds = data.pop("seconds", None) if data else None
        seconds = time.time() - t0 if seconds is None else seconds
        ok, detail = self.agree(ok, detail)
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        entry = {"name": name, "status": status, "seconds": round(seconds, 3), "detail": detail,
                 **({"fix": fix} if ok is False else {}), **(data or {})}
        self.checks.append(entry)
        self.say(f"  {status}  {name:<22}" + (f"{seconds:6.1f}s" if ok is not None else " " * 7) + f"  {detail}")
        if ok is False:
            self.say(f"        fix: {fix}")
        return entry

    def agree(self, ok, detail):
        """Every rank's verdict: the check fails if any rank failed (the first failing rank's words)."""
        if self.dist is None or self.world == 1:
            return ok, detail
        every = self.gather((ok, detail))
        bad = [(r, d) for r, (o, d) in enumerate(every) if o is False]
        if bad:
            same = len(bad) == self.world and all(d == bad[0][1] for _, d in bad)
            return False, bad[0][1] if same else f"rank {bad[0][0]}: {bad[0][1]}"
        return (None if any(o is None for o, _ in every) else True), detail

    def skip(self, names: list[str], why: str) -> None:
        def skipped():
            raise Skip(why)

        for name in names:
            self.check(name, skipped, "")

    def passed(self, name: str) -> bool:
        return any(c["name"] == name and c["status"] == "PASS" for c in self.checks)

    def gather(self, value) -> list:
        every = [None] * self.world
        self.dist.all_gather_object(every, value)
        return every

    def outcomes(self, name: str, mine: str) -> list[str] | None:
        """Every rank's outcome of scratch run `name` ("ok", "oom"), exchanged through the launch's rendezvous
        store, not the process group: a rank that ran out of memory mid-step left the others inside the step's
        collectives (a ZeRO gather, a reduce-scatter), where no collective of ours would reach them. A rank out of
        memory waits OUTCOME_WAIT_S for the others (a rank still inside such a collective never reports); a rank
        that finished waits as long as a collective would (the comm timeout): its peers report as soon as they
        finish or run out of memory. None: not every rank reported in time."""
        if self.world == 1:
            return [mine]
        store = rendezvous_store(OUTCOME_WAIT_S if mine == "oom" else self.settings.comm_timeout_s)
        keys = [f"zerotrain/preflight/{name}/rank{r}" for r in range(self.world)]
        store.set(keys[self.rank], mine)
        try:
            store.wait(keys)
        except RuntimeError:  # DistStoreError: the wait's timeout
            return None
        return [store.get(k).decode() for k in keys]

    def end_after_oom(self, detail: str) -> None:
        """This rank ran out of memory while another is still inside the step's collectives: no agreement is
        possible there, so pre-flight ends now (its exit ends the launch; the others' collectives fail on the
        closed connection or the launcher stops them) rather than when the comm timeout fails them."""
        print(f"zerotrain: preflight {self.stage} micro-batch sweep: FAIL on rank {self.rank}: {detail}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_PREFLIGHT_FAILED)

    def plan(self, cfg):
        """plan_run on every rank, its refusal agreed: a rank that stopped here while the others went on to
        build an engine would leave them waiting in its collectives."""
        try:
            plan, error = plan_run(cfg, self.world, self.rank), None
        except ZerotrainError as e:  # e.g. a file only some node cannot read
            plan, error = None, e
        first = next((m for m in self.gather(error and str(error)) if m), None) if self.world > 1 else None
        if error is not None or first:
            raise error or UsageError(f"another rank: {first}")
        return plan

    def from_main(self, fn):
        """fn() on rank 0 (files only rank 0 writes: metrics, markers), its value on every rank."""
        box = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # carried to every rank, so that all of them fail this check together
                box[0] = ("error", f"{type(e).__name__}: {e}" if not isinstance(e, ZerotrainError) else str(e))
        if self.world > 1:
            self.dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise OnMain(value)
        return value

    # -- the driver's pieces ---------------------------------------------------------------------
    def ensure_backend(self) -> str:
        """The process group, as the Trainer makes it (the Trainer then reuses it), and the run directory's
        pre-flight lock; the backend's name."""
        self.torch = torch
        self.dist, self.accel = init_process_group(self.settings.dist_backend, self.settings.comm_timeout_s)
        if not self.locked:  # one pre-flight per run directory at a time (it wipes its scratch directories)
            self.lock = take_lock(self.root, self.dist, self.is_main, say=self.say)
            self.locked = True
        return self.dist.get_backend()

    def scratch_cfg(self, name: str, **changes):
        """The run's config for scratch run `name` (its directory wiped): only run-kind fields change,
        so the identity is the run's (a v2 sweep candidate also changes the micro-batch)."""
        scratch = self.root / "scratch"
        if self.is_main:
            shutil.rmtree(scratch / name, ignore_errors=True)
        self.dist.barrier()
        base = dict(out=str(scratch), run_id=name, resume="never", mirror=None, log=None, max_hours=None,
                    total_tokens=None, budget_usd=None, early_stop_patience=None, keep_last=0, golden=None,
                    golden_strict=None)
        return with_values(self.cfg, {**base, **changes})

    def build(self, plan):
        trainer = Trainer(plan)
        trainer.loader = slowed(trainer.loader, self.hooks)
        return trainer

    def release(self, trainer) -> None:
        """Close a scratch trainer and free its engine before the next one is built."""
        if trainer is None or trainer.engine is None:
            return
        trainer.close()
        with contextlib.suppress(Exception):  # best effort: what matters is that the memory goes
            trainer.engine.destroy()
        trainer.engine = None
        gc.collect()
        self.accel.empty_cache()

    def fresh_peaks(self) -> None:
        """Peak memory counted from here on: a candidate's or the rehearsal's own, comparable with what a
        fresh process of the real run logs (GPU max_memory_allocated; on a CPU node peak RSS, which the
        kernel resets through clear_refs, once glibc has returned what earlier stages freed)."""
        gc.collect()
        if self.accel.device_name() != "cpu":
            self.accel.empty_cache()
            self.accel.reset_peak_memory_stats()
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        reset_peak_rss()

    def drop_checkpoints(self, name: str) -> None:
        if self.is_main:
            shutil.rmtree(self.root / "scratch" / name / "checkpoints", ignore_errors=True)
        self.dist.barrier()

    def records(self, name: str) -> tuple[list[dict], list[dict]]:
        """(step records, events) of scratch run `name`, as rank 0 wrote them."""
        run = self.root / "scratch" / name
        return self.from_main(lambda: (read_metrics(run), read_metrics(run, events=True)))


# -- entry: `zerotrain preflight` (launcher/cli.py), `python -m` / `deepspeed --module` (__main__.py) --

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, rest = parse_args(argv)
        code = Preflight(resolve_config(rest), opts).run()
    except UsageError as e:  # bad input before the checks (config, profile, a held lock): exit 2
        fail(str(e), EXIT_USAGE)
    sys.exit(code)
