"""Pre-flight: staged checks before a long run, and the golden-step comparison a real run makes.

    zerotrain preflight --stage v1|v2|v3[,v2,...] [--steps N] [--sweep 4,8,16] [--sweep-steps K]
                        [--loader-seconds S] TRAIN-FLAGS
    deepspeed --num_gpus 8 --module zerotrain.launcher.commands.preflight --stage v1 TRAIN-FLAGS   (the real run's own launch)

Run it with exactly the flags, the launcher and the world size of the intended run: it IS that
run, reduced in steps. Every rank runs every check; each check's verdict is agreed by all ranks
(one all-gather), rank 0 prints it as PASS/FAIL/SKIP with its time and writes
RUN_DIR/preflight/<stage>.json (RUN_DIR: the directory the real run will use). Any FAIL exits
EXIT_FAILED and says what to fix. The training it does runs in scratch run directories,
RUN_DIR/preflight/scratch/<name>/ (wiped before use, checkpoints deleted after), built with the
driver's own pieces (`plan_run`, `Trainer`) from the run's RunConfig with only run-kind fields
changed (steps, out, run id, resume; no mirror, no sinks, no budgets): nothing of the real run's
checkpoints or metrics is touched. The driver's own output goes to RUN_DIR/preflight/<stage>.log.

v1 stability   backend on every rank; all-reduce and all-gather values; the data (prepared shards:
               every checksum, `zerotrain.dataio.shards.verify`; a mix: every local source read, the first
               record of a streamed one); the model and engine build; one training step; one
               checkpoint written and verified against its marker; read back into a fresh engine
               and compared tensor by tensor (sha256 of every parameter and optimizer-state tensor
               this rank holds, the loader state, step and tokens); one evaluation on all ranks
               (the run's eval rows, else rows of the training mix); one resumed step.
v2 throughput  a micro-batch sweep (--sweep, default micro/2, micro, 2x, 4x; grad-accum 1; --sweep-steps
               steps each: tokens/s per rank and peak memory, GPU max_memory_allocated or host peak
               RSS, max over ranks; the planner's fit check first, larger ones skipped after one that
               does not fit or runs out of memory; the fastest that fits marked); the data loader
               alone (--loader-seconds), tokens/s per rank, against what the model consumes per rank
               (its step time minus the data wait; ratio >= DATA_RATIO_MIN); the fraction of step time
               waiting on data (<= DATA_WAIT_MAX); both at the configured micro-batch.
v3 rehearsal   N steps of the full config (--steps, default `rehearsal_steps`), saves and evaluations
               at the run's cadence (at least one of each that the run has); golden steps recorded
               in RUN_DIR/preflight/golden.json; passes only if the median MFU against the profile's
               peak reaches `mfu_threshold(zt)`.

`--golden PATH` on a real run: `GoldenCheck` (below) compares the run at the golden steps and warns,
or with `--golden-strict` stops (EXIT_GOLDEN, checkpoint saved), when tokens/s or peak memory is
more than TOLERANCE off; a golden file of another config or world size is refused naming the keys.

Test hooks (environment): ZEROTRAIN_TEST_PREFLIGHT_READBACK=perturb changes one value of the
read-back state before v1 compares it; ZEROTRAIN_TEST_SLOW_LOADER=S makes pre-flight's data loaders
sleep S seconds per batch.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import shutil
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

from zerotrain.cli_args import Parser
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.golden import make_golden, mfu_threshold
from zerotrain.launcher.errors import EXIT_USAGE, UsageError, ZerotrainError, fail, read_json_object
from zerotrain.launcher.hparams import resolve_hparams

STAGES = {"v1": "stability", "v2": "throughput", "v3": "dress rehearsal"}
EXIT_FAILED = 9  # a pre-flight check failed (2: bad input before any check ran)
EXIT_GOLDEN = 8  # a run with --golden-strict stopped off its golden steps (proposed for launcher/errors.py)
DATA_RATIO_MIN = 2.0  # the loader must produce at least twice what the model consumes (headroom for hiccups)
DATA_WAIT_MAX = 0.10  # at most 10% of a step waiting on data
SIGTERM_GRACE_S = 30  # DeepSpeed's launcher kills the ranks 30 s after forwarding SIGTERM
READBACK_HOOK = "ZEROTRAIN_TEST_PREFLIGHT_READBACK"
SLOW_LOADER_HOOK = "ZEROTRAIN_TEST_SLOW_LOADER"
GiB = 2 ** 30


# ------------------------------------------------------------------------------------------------
# Small pure helpers (unit-tested without a process group)
# ------------------------------------------------------------------------------------------------

def rehearsal_steps(max_steps: int) -> int:
    """v3's default N from the run's scale: 1% of the run, at least 20 and at most 200 steps."""
    return min(max_steps, max(20, min(200, max_steps // 100)))


def device_description() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return f"cpu ({os.cpu_count()} cores)"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(pre-flight's own options, the train flags)."""
    p = Parser(prog="zerotrain preflight", allow_abbrev=False,
                       description="Staged checks before a long run (README \"Pre-flight\").",
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


def run_dir_of(cfg) -> tuple[Path, str, dict]:
    """(the real run's directory, profile name, profile) exactly as plan_run names it, without
    reading data or checkpoints."""
    from zerotrain.dataio.tokenizer import load_tokenizer
    from zerotrain.launcher import model_spec
    from zerotrain.launcher.profiles import detect_profile, load_profile

    spec = cfg.profile if cfg.profile != "auto" else detect_profile()[0]
    name, profile = load_profile(spec)
    cfg = resolve_hparams(cfg, name, profile)  # as plan_run does: the run id hashes the values the run trains with
    _, label, _ = model_spec.resolve(cfg, load_tokenizer(cfg.tokenizer).vocab_size)
    return Path(cfg.out) / (cfg.run_id or f"{label}-{name}-{cfg.identity_hash()}"), name, profile


def _vm_hwm() -> float | None:
    """Peak RSS of this process since the last `_reset_peak_rss` (Linux /proc), bytes."""
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def _reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0): a sweep candidate's peak is its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def master_tensors(engine) -> tuple[object, list]:
    """(the torch optimizer inside DeepSpeed's wrapper, the tensors it updates on this rank: the fp32
    master partitions under ZeRO). ZeRO-3 hands its partitions to the torch optimizer only for the
    length of a step (stage3.py `_optimizer_step`), so they are read from the wrapper there."""
    return ds_compat.zero_master_tensors(engine)  # DeepSpeed's internals are read there


def state_digests(engine) -> dict[str, tuple[str, float]]:
    """Per tensor of this rank's training state: (sha256 of its bytes, its sum).

    The module's parameters as this rank holds them (its ZeRO-3 partition `ds_tensor`, else the
    tensor), the fp32 master partitions and their optimizer state (exp_avg, ...). Hashes, not
    copies: the comparison needs no second copy of the model in memory."""
    import torch

    out = {}

    def add(name, t):
        t = t.detach().reshape(-1).contiguous().cpu()
        out[name] = (hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:20], float(t.double().sum()))

    for name, p in engine.module.named_parameters():
        add(f"parameter {name}", p.ds_tensor if hasattr(p, "ds_tensor") else p)
    inner, masters = master_tensors(engine)
    for i, p in enumerate(masters):
        add(f"fp32 master partition {i}", p)
        for key, value in inner.state.get(p, {}).items():
            if torch.is_tensor(value):
                add(f"{key} of fp32 master partition {i}", value)
    return out


class _SlowLoader:
    """Test hook (SLOW_LOADER_HOOK): the loader, S seconds slower per batch."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def next(self):
        time.sleep(self.seconds)
        return self.inner.next()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _slowed(loader):
    s = os.environ.get(SLOW_LOADER_HOOK)
    return _SlowLoader(loader, float(s)) if s else loader


class _Skip(Exception):
    """A check that cannot run because an earlier one failed (decided alike on every rank)."""


class _OnMain(ZerotrainError):
    """Something rank 0 alone computes (from files it wrote) failed; every rank raises this."""


# ------------------------------------------------------------------------------------------------
# The stages
# ------------------------------------------------------------------------------------------------

class Preflight:
    """One launch's pre-flight: `run()` runs the stages asked for and returns the exit code.

    Every control decision is taken on values every rank has (agreed verdicts, or what rank 0 read
    and broadcast with `from_main`): a rank that took another branch would leave the others
    waiting in a collective."""

    def __init__(self, cfg, opts: argparse.Namespace):
        self.cfg, self.opts = cfg, opts
        self.dist = self.lock = self.plan_a = self.base = None
        self.locked = False

    def run(self) -> int:
        from zerotrain.launcher.run_plan import single_process_env
        from zerotrain.launcher.trainer import report_exit

        single_process_env()
        self.world, self.rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        self.is_main = self.rank == 0
        self.run_dir, self.profile_name, self.profile = run_dir_of(self.cfg)  # bad input: UsageError, exit 2
        self.cfg = resolve_hparams(self.cfg, self.profile_name, self.profile)  # --profile auto: now detected
        self.zt = self.profile.get("zerotrain", {})
        self.root = self.run_dir / "preflight"
        failed = False
        try:
            for stage in self.opts.stages:
                failed |= not getattr(self, stage)()
        finally:
            if self.lock is not None:
                self.lock.release()
        code = EXIT_FAILED if failed else 0
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
        self.say(f"preflight {stage} ({STAGES[stage]}): {self.world} rank(s), run directory {self.run_dir}")

    def end_stage(self, extra: dict | None = None) -> bool:
        ok = all(c["status"] != "FAIL" for c in self.checks)
        if self.is_main:
            path = self.root / f"{self.stage}.json"
            _write_json(path, {"stage": self.stage, "title": STAGES[self.stage], "ok": ok, "run_dir": str(self.run_dir),
                               "world_size": self.world, "profile": self.profile_name, "device": device_description(),
                               "seconds": round(time.time() - self.t_stage, 3),
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": self.cfg.to_dict(),
                               "checks": self.checks, **(extra or {})})
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

        fn() returns (ok, detail, data) or raises: a ZerotrainError is this check's FAIL; _Skip marks
        it skipped; anything else is a FAIL with its traceback in the log. With several ranks an
        unexpected exception may have left the other ranks inside a collective, so that rank says so
        and leaves (the launcher then stops the others) rather than hang the launch.
        `data["seconds"]`, when given, is the check's time (the part of the work it measures)."""
        t0 = time.time()
        data: dict = {}
        try:
            with self.quiet():
                ok, detail, data = fn()
        except _Skip as e:
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
                os._exit(EXIT_FAILED)
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
            raise _Skip(why)

        for name in names:
            self.check(name, skipped, "")

    def passed(self, name: str) -> bool:
        return any(c["name"] == name and c["status"] == "PASS" for c in self.checks)

    def gather(self, value) -> list:
        every = [None] * self.world
        self.dist.all_gather_object(every, value)
        return every

    def plan(self, cfg):
        """plan_run on every rank, its refusal agreed: a rank that stopped here while the others went on to
        build an engine would leave them waiting in its collectives."""
        from zerotrain.launcher.run_plan import plan_run

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
            raise _OnMain(value)
        return value

    # -- the driver's pieces ---------------------------------------------------------------------
    def ensure_backend(self) -> str:
        """The process group, as the Trainer makes it (the Trainer then reuses it); the backend's name."""
        import deepspeed
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend=self.zt.get("dist_backend") or accel.communication_backend_name())
        if accel.device_name() != "cpu":
            accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        elif "OMP_NUM_THREADS" not in os.environ:  # as the Trainer: the node's cores shared by its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))
        self.dist, self.torch, self.accel = dist, torch, accel
        if not self.locked:
            self.take_lock()
        return dist.get_backend()

    def take_lock(self) -> None:
        """One pre-flight per run directory at a time (it wipes its scratch directories)."""
        from zerotrain.launcher.components import checkpoint
        verdict = [None]
        if self.is_main:
            try:
                self.lock = checkpoint.RunLock(self.root, say=self.say).acquire()
            except UsageError as e:
                verdict[0] = str(e)
        if self.world > 1:
            self.dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise UsageError(verdict[0])
        self.locked = True

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
        return dataclasses.replace(self.cfg, **{**base, **changes})

    def build(self, plan):
        from zerotrain.launcher.trainer import Trainer

        trainer = Trainer(plan)
        trainer.loader = _slowed(trainer.loader)
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
        _reset_peak_rss()

    def drop_checkpoints(self, name: str) -> None:
        if self.is_main:
            shutil.rmtree(self.root / "scratch" / name / "checkpoints", ignore_errors=True)
        self.dist.barrier()

    def records(self, name: str) -> tuple[list[dict], list[dict]]:
        """(step records, events) of scratch run `name`, as rank 0 wrote them."""
        from zerotrain.launcher.components.metrics import read_metrics

        run = self.root / "scratch" / name
        return self.from_main(lambda: (read_metrics(run), read_metrics(run, events=True)))

    # -- v1: stability ---------------------------------------------------------------------------
    def v1(self) -> bool:
        self.start_stage("v1")
        checks = [  # name, what it needs (None: the read-back engine), the check, what to fix
            ("backend", "", self.c_backend, "the process group did not start on every rank: check MASTER_ADDR/PORT,"
                                            " the hostfile, the network interface (NCCL_SOCKET_IFNAME), the driver"),
            ("collectives", "backend", self.c_collectives, "collectives give wrong values: check the NCCL/gloo"
                                                           " settings, the interconnect and the devices"),
            ("data", "backend", self.c_data, "fix or re-prepare the data named above (`zerotrain verify DIR` for"
                                             " shards)"),
            ("build", "data", self.c_build, "the model or engine did not build: see the log; `zerotrain plan` for"
                                            " memory"),
            ("step", "build", self.c_step, "one training step failed: see the log"),
            ("checkpoint write", "step", self.c_write, "the checkpoint is incomplete or does not verify: check the"
                                                       " disk (space, quota, the shared filesystem)"),
            ("checkpoint read-back", "checkpoint write", self.c_readback,
             "the checkpoint does not read back as written: check the filesystem (caching, consistency) and the"
             " DeepSpeed version"),
            ("evaluation", None, self.c_eval, "the evaluation failed or disagreed between ranks: see the log"),
            ("resume", None, self.c_resume, "the resumed run did not train on: see the log")]
        self.a = self.b = None
        try:
            for name, need, fn, fix in checks:
                if need and not self.passed(need):
                    self.skip([name], f"needs a passing {need} check")
                elif need is None and self.b is None:
                    self.skip([name], "needs the engine resumed from the checkpoint")
                else:
                    self.check(name, fn, fix)
            return self.end_stage()
        finally:
            self.release(self.a)
            self.release(self.b)
            if self.locked:
                self.drop_checkpoints("v1")

    def c_backend(self):
        t0 = time.time()
        backend = self.ensure_backend()
        ranks, hosts = zip(*self.gather((self.rank, socket.gethostname())))
        ok = list(ranks) == list(range(self.world))
        return ok, (f"{self.world} rank(s) on {len(set(hosts))} host(s), {backend}" if ok else
                    f"ranks reported {list(ranks)}, expected 0..{self.world - 1}"), \
            {"hosts": sorted(set(hosts)), "backend": backend, "seconds": time.time() - t0}

    def c_collectives(self):
        torch, dist = self.torch, self.dist
        device = self.accel.current_device_name()
        x = torch.tensor([float(self.rank + 1)], dtype=torch.float64, device=device)
        dist.all_reduce(x)
        got = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world)]
        dist.all_gather(got, torch.tensor([self.rank * 7 + 3], dtype=torch.int64, device=device))
        big = torch.ones(1 << 22, dtype=torch.float32, device=device)  # 16 MiB: a gradient bucket's size
        dist.barrier()
        t0 = time.time()
        dist.all_reduce(big)
        self.accel.synchronize()
        dt = time.time() - t0
        problems = []
        if float(x.item()) != self.world * (self.world + 1) / 2:
            problems.append(f"all-reduce of rank+1 gave {x.item()}, not {self.world * (self.world + 1) / 2}")
        if [int(t.item()) for t in got] != [r * 7 + 3 for r in range(self.world)]:
            problems.append(f"all-gather gave {[int(t.item()) for t in got]}")
        if not bool((big == self.world).all()):
            problems.append("the 16 MiB all-reduce gave wrong values")
        bus = 2 * (self.world - 1) / self.world * big.numel() * 4 / dt if self.world > 1 else None
        return not problems, "; ".join(problems) or (
            f"all-reduce and all-gather correct; 16 MiB all-reduce {dt * 1e3:.0f} ms"
            + (f" ({bus / 1e9:.2f} GB/s bus bandwidth)" if bus else "")), \
            {"allreduce_16mib_s": round(dt, 4), "bus_gb_s": bus and round(bus / 1e9, 3)}

    def c_data(self):
        """The data read the way training reads it, on every rank (nodes may have their own disks)."""
        from zerotrain.dataio import shards
        from zerotrain.dataio.loader import open_data
        from zerotrain.dataio.sources import load_text_source, open_streamed, record_text
        from zerotrain.dataio.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.cfg.tokenizer)
        parts = []
        for path in [self.cfg.data] + ([self.cfg.eval_data] if self.cfg.eval_data else []):
            data = open_data(path, tokenizer)
            if data.kind == "shards":
                results = shards.verify(Path(data.path), data.manifest, tokenizer)
                parts.append(f"{path}: {len(results)} shard(s), {sum(r['bytes'] for r in results) / 1e6:,.1f} MB,"
                             " sha256 and counts verified")
                continue
            for spec in data.specs:
                if spec.streamed:
                    record = next(iter(open_streamed(spec, self.rank, self.world)), None)
                    if record is None or record_text(spec, record, lambda why: None) is None:
                        raise UsageError(f"{spec.where()}: the first streamed record has no text")
                else:
                    load_text_source(spec)
            parts.append(f"{path}: {len(data.specs)} source(s) read")
        return True, "; ".join(parts), {}

    def c_build(self):
        plan = self.plan_a = self.plan(self.scratch_cfg("v1", max_steps=1))
        self.a = self.build(plan)
        ds = plan.ds_config
        return True, (f"{plan.model_label}, ZeRO-{ds['zero_optimization'].get('stage', 0)}, micro"
                      f" {ds['train_micro_batch_size_per_gpu']} x accum {ds['gradient_accumulation_steps']} x"
                      f" {self.world} rank(s)"), {}

    def c_step(self):
        result = self.a.train()
        records, _ = self.records("v1")
        if result.exit_code != 0 or not records:
            return False, f"the step ended {result.stop}: {result.message}", {}
        r = records[-1]
        return True, f"loss {r['loss']:.4f}, grad norm {r.get('grad_norm') or 0:.3g}, {r['step_s']:.2f} s", \
            {"loss": r["loss"], "seconds": r["step_s"]}

    def c_write(self):
        from zerotrain.launcher.components import checkpoint
        t0, tag = time.time(), self.a.last_saved
        if tag is None:
            return False, "no checkpoint was written after the step", {}
        problem, files = self.from_main(lambda: (checkpoint.verify(tag) if (tag / checkpoint.MARKER).is_file() else
                                                 f"{tag}: no completion marker ({checkpoint.MARKER})",
                                                 checkpoint.read_meta(tag).get("files", {})
                                                 if (tag / checkpoint.MARKER).is_file() else {}))
        if problem:
            return False, problem, {}
        stop = [e for e in self.records("v1")[1] if e.get("event") == "stop"]
        save_s = stop[-1].get("save_blocked_s", 0.0) if stop else 0.0
        size = sum(f.get("size", 0) for f in files.values())
        return True, (f"{tag.name}: {len(files)} file(s), {size / 1e6:,.1f} MB, sizes and sha256 verified; the save"
                      f" blocked training {save_s:.2f} s"), {"save_s": save_s, "bytes": size,
                                                              "seconds": save_s + time.time() - t0}

    def c_readback(self):
        """A fresh engine resumed from the checkpoint holds what the first one wrote, tensor by tensor."""
        from zerotrain.launcher.components import checkpoint
        a = self.a
        written, loader_state, counters, tag = state_digests(a.engine), a.loader.state_dict(), \
            (a.step, a.tokens_seen), a.last_saved
        self.release(a)  # never two engines at once: the real model may fill the device
        self.a = None
        found = checkpoint.find_resume(tag.parent, None, say=lambda *_: None)  # the resume path: files verified
        if found != tag:
            return False, f"resume would start from {found}, not {tag}", {}
        cfg = dataclasses.replace(self.plan_a.cfg, resume="auto", max_steps=2)
        b = self.b = self.build(dataclasses.replace(self.plan_a, cfg=cfg, resume_from=found,
                                                    resume_meta=checkpoint.read_meta(found)))
        if os.environ.get(READBACK_HOOK) == "perturb":  # test hook: a read-back that differs from what was written
            master_tensors(b.engine)[1][0].data.view(-1)[0] += 1.0
        read = state_digests(b.engine)
        problems = [f"tensors written and read differ: {sorted(set(read) ^ set(written))[:3]}"] \
            if set(read) != set(written) else []
        differ = [k for k in written if k in read and read[k][0] != written[k][0]]
        problems += [f"{k} differs (sum {written[k][1]:.9g} written, {read[k][1]:.9g} read)" for k in differ[:3]]
        if len(differ) > 3:
            problems.append(f"and {len(differ) - 3} more tensor(s)")
        if (b.step, b.tokens_seen) != counters:
            problems.append(f"step/tokens {b.step}/{b.tokens_seen} read, {counters[0]}/{counters[1]} written")
        if json.dumps(b.loader.state_dict(), sort_keys=True) != json.dumps(loader_state, sort_keys=True):
            problems.append("the data loader's state differs")
        optimizer = sum("fp32 master" in k for k in written)
        same = (f"{len(written)} tensors identical (sha256, on every rank: {len(written) - optimizer} parameters,"
                f" {optimizer} fp32 master and optimizer state); loader state, step and tokens identical")
        return not problems, "; ".join(problems) or same, {"tensors": len(written), "optimizer_tensors": optimizer}

    def c_eval(self):
        from zerotrain.dataio.holdout import mix_rows
        from zerotrain.launcher.components.evaluate import Evaluator

        b = self.b
        evaluator, what = b.evaluator, "the run's eval rows"
        if evaluator is None:  # the run evaluates nothing: rows of the training mix
            micro = b.plan.ds_config["train_micro_batch_size_per_gpu"]
            rows = mix_rows(b.plan.data, self.cfg.seq_len, self.cfg.seq_len * micro * self.world)
            evaluator, what = Evaluator(rows, self.rank, self.world, micro), "rows of the training mix"
        val = evaluator.evaluate(b.engine, device=b.engine.device)
        losses = self.gather(val["val_loss"])
        ok = all(math.isfinite(v) for v in losses) and len(set(losses)) == 1
        return ok, (f"val_loss {val['val_loss']:.4f} on {val['val_tokens']:,} tokens ({what}), the same on every"
                    " rank" if ok else f"val_loss per rank {losses}"), {"val_loss": val["val_loss"]}

    def c_resume(self):
        start = self.b.step
        result = self.b.train()
        records, events = self.records("v1")
        last = records[-1] if records else {}
        resumed = any(e.get("event") == "resume" and e.get("step") == start for e in events)
        ok = result.exit_code == 0 and resumed and last.get("step") == start + 1 \
            and math.isfinite(last.get("loss", math.nan))
        return ok, (f"resumed at step {start}; step {start + 1} loss {last['loss']:.4f}" if ok else
                    f"the resumed run ended {result.stop} at step {result.step}: {result.message}"), {}

    # -- v2: throughput --------------------------------------------------------------------------
    def v2(self) -> bool:
        self.start_stage("v2")
        self.ensure_backend()
        self.check("plan", self.c_plan, "the run does not plan: see the message")
        if not self.passed("plan"):
            self.skip(["micro-batch sweep", "data loader", "data wait"], "needs the plan")
            return self.end_stage()
        sweep = self.check("micro-batch sweep", self.c_sweep, "the configured --micro-batch does not fit: use the"
                                                              " largest that fits (above), or see `zerotrain plan`")
        mine = next((c for c in sweep.get("candidates", []) if c["configured"] and "tokens_per_s_per_rank" in c), None)
        if mine is None:
            self.skip(["data loader", "data wait"], "needs a run at the configured micro-batch")
            return self.end_stage()
        self.check("data loader", lambda: self.c_loader(mine),
                   "the loader cannot keep the model fed: `zerotrain prepare` the data (no tokenizing while"
                   " training), raise zerotrain.dataloader.workers in the profile, or use faster storage")
        wait = mine["data_wait_fraction"]
        self.check("data wait", lambda: (wait <= DATA_WAIT_MAX, f"{wait:.1%} of step time waiting on data at"
                                         f" micro-batch {mine['micro_batch']} (at most {DATA_WAIT_MAX:.0%})",
                                         {"data_wait_fraction": wait, "seconds": 0.0}),
                   "steps wait on data: raise zerotrain.dataloader.workers / prefetch_factor, prepare the data, or"
                   " move it to local disk")
        return self.end_stage()

    def c_plan(self):
        self.base = self.plan(self.scratch_cfg("v2", eval_every_steps=0))  # data read once; candidates share it
        ds = self.base.ds_config
        return True, (f"{self.base.model_label}, micro {ds['train_micro_batch_size_per_gpu']} x accum"
                      f" {ds['gradient_accumulation_steps']} x {self.world} rank(s)"), {}

    def planner_says(self, cfg, ds_config) -> tuple[float | None, str | None]:
        """(the planner's bytes per rank, or its refusal) for a candidate; (None, None) without a planner
        or with --no-fit-check (then every candidate runs)."""
        try:
            from zerotrain.launcher.components.planner import fit_check
        except ImportError:
            return None, None
        if getattr(self.cfg, "fit_check", None) is False:
            return None, None
        try:
            m = fit_check(cfg, self.base.model_args, ds_config, self.base.zt, self.world)
        except UsageError as e:
            return None, str(e)
        return (m.get("total") if isinstance(m, dict) else None), None

    def device_bytes(self) -> float | None:
        """Memory one rank may use: the planner's view of this device (GPU memory, or RAM / local ranks)."""
        try:
            from zerotrain.launcher.components.planner import device_memory_here

            return device_memory_here(self.zt.get("hardware", {}).get("accelerator", "cuda"),
                                      int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))[0]
        except (ImportError, UsageError, TypeError, ValueError):
            return None

    def c_sweep(self):
        from zerotrain.launcher.profiles import resolve_ds_config

        micro = self.base.ds_config["train_micro_batch_size_per_gpu"]
        limit = self.from_main(self.device_bytes)  # RAM available differs between ranks' moments: rank 0's
        rows, ran_out = [], None
        for m in sorted(set(self.opts.sweep or [max(1, micro // 2), micro * 2, micro * 4]) | {micro}):
            row = {"micro_batch": m, "configured": m == micro}
            rows.append(row)
            if ran_out is not None:
                row["skipped"] = ran_out
                continue
            name = f"v2-mb{m}"
            cfg = self.scratch_cfg(name, micro_batch=m, grad_accum=1, global_batch_tokens=None,
                                   max_steps=self.opts.sweep_steps, save_every_steps=0, eval_every_steps=0)
            ds = resolve_ds_config(self.profile, cfg, self.world, f"profile {self.profile_name}")
            predicted, refusal = self.from_main(lambda: self.planner_says(cfg, ds))
            if predicted:
                row["planner_gib"] = round(predicted / GiB, 3)
            if refusal:
                row["skipped"] = ran_out = f"the planner says it does not fit ({refusal[:200]})"
                continue
            row.update(self.measure(dataclasses.replace(self.base, cfg=cfg, ds_config=ds, run_dir=Path(cfg.out) / name,
                                                        eval_rows=None, resume_from=None, resume_meta=None), name))
            if row.get("oom"):
                ran_out = f"micro-batch {m} ran out of memory"
            row["fits"] = not row.get("oom") and (limit is None or row["peak_gib"] * GiB <= limit)
        fitting = [r for r in rows if r.get("fits")]
        best = max(fitting, key=lambda r: r["tokens_per_s_per_rank"]) if fitting else None
        mine = next(r for r in rows if r["configured"])
        for r in rows:
            r["best"] = r is best
        parts = [f"{r['micro_batch']}: " + (f"skipped, {r['skipped']}" if "skipped" in r else "out of memory"
                                             if r.get("oom") else
                                             f"{_rate(r['tokens_per_s_per_rank'])} tok/s/rank, {r['peak_gib']:.2f} GiB"
                                             + (" (best)" if r["best"] else "")
                                             + ("" if r["fits"] else " (more than the device has)")) for r in rows]
        detail = "micro-batch " + "; ".join(parts)
        if best is not None and best is not mine and mine.get("fits"):
            gain = best["tokens_per_s_per_rank"] / mine["tokens_per_s_per_rank"] - 1
            detail += f"; --micro-batch {best['micro_batch']} gives {gain:+.0%} tokens/s over the configured {micro}"
        return bool(mine.get("fits")), detail, {"candidates": rows, "device_gib": limit and round(limit / GiB, 2)}

    def measure(self, plan, name: str) -> dict:
        """A few steps at one micro-batch: tokens/s per rank, data wait, peak memory (max over ranks)."""
        gpu = self.accel.device_name() != "cpu"
        trainer, oom = None, False
        self.fresh_peaks()
        try:
            trainer = self.build(plan)
            trainer.train()
        except RuntimeError as e:  # torch.OutOfMemoryError is one; the CPU allocator words it differently
            if "out of memory" not in str(e).lower() and "can't allocate memory" not in str(e):
                raise
            oom = True
        finally:
            self.release(trainer)
        every = self.gather((oom, self.accel.max_memory_allocated() if gpu else (_vm_hwm() or 0)))
        self.drop_checkpoints(name)
        if any(o for o, _ in every):
            return {"oom": True}
        records, _ = self.records(name)
        timed = records[1:] or records  # step 1 is start-up
        # what the model alone consumes: the step's tokens over its time minus the wait for data
        model = [r["tokens_per_s"] * r["step_s"] / max(r["step_s"] - r["data_wait_s"], 1e-9) for r in timed]
        return {"tokens_per_s_per_rank": round(statistics.median(r["tokens_per_s"] for r in timed) / self.world, 1),
                "model_tokens_per_s_per_rank": round(statistics.median(model) / self.world, 1),
                "data_wait_fraction": round(statistics.median(r["data_wait_s"] / r["step_s"] for r in timed), 4),
                "peak_gib": round(max(p for _, p in every) / GiB, 3), "steps": len(records),
                "memory": "max_memory_allocated" if gpu else "peak RSS"}

    def c_loader(self, mine):
        from zerotrain.dataio.loader import Batches

        base, cfg = self.base, self.base.cfg
        loader = _slowed(Batches(base.data, self.rank, self.world, cfg.seed, cfg.seq_len,
                                 base.ds_config["train_micro_batch_size_per_gpu"], base.loader_settings,
                                 base.loader_settings["packing"]))
        loader.next()  # start-up (worker processes) is not the steady rate
        n, t0 = 0, time.time()
        while time.time() - t0 < self.opts.loader_seconds:
            batch = loader.next()
            if batch is None:
                break
            n += batch["input_ids"].numel()
        rates = self.gather(n / (time.time() - t0))
        loader.close()
        need = mine["model_tokens_per_s_per_rank"]
        ratio = min(rates) / need if need else math.inf
        return ratio >= DATA_RATIO_MIN, (f"loader {_rate(min(rates))} tokens/s per rank (slowest rank) vs the model's"
                                         f" {_rate(need)} (its step time minus the wait for data): {ratio:,.1f}x (at"
                                         f" least {DATA_RATIO_MIN:g}x)"), \
            {"loader_tokens_per_s_per_rank": [round(r, 1) for r in rates], "model_tokens_per_s_per_rank": need,
             "ratio": round(ratio, 3)}

    # -- v3: dress rehearsal -----------------------------------------------------------------------
    def v3(self) -> bool:
        self.start_stage("v3")
        self.ensure_backend()
        cfg, n = self.cfg, self.opts.steps or rehearsal_steps(self.cfg.max_steps)
        changes = dict(max_steps=n, save_every_hours=None,
                       save_every_steps=cfg.save_every_steps if 0 < cfg.save_every_steps <= n else 0)
        if cfg.eval_every_steps:  # the run evaluates: so does its rehearsal, at least once
            changes["eval_every_steps"] = min(cfg.eval_every_steps, n)
        self.records3 = []
        self.check("rehearsal", lambda: self.c_rehearsal(self.scratch_cfg("v3", **changes), n),
                   "the rehearsal did not finish: see the log")
        if not self.passed("rehearsal"):
            self.skip(["utilisation"], "needs the rehearsal")
            return self.end_stage()
        self.check("utilisation", self.c_mfu, "below the profile's MFU threshold: run v2 (micro-batch, data), check"
                                              " activation checkpointing, --compile, the interconnect, and that"
                                              " nothing else runs on the devices")
        return self.end_stage({"golden": str(self.root / "golden.json")})

    def c_rehearsal(self, cfg, n):
        trainer = None
        self.base = self.plan_a = None  # earlier stages' data and plans: not part of the run's memory
        self.fresh_peaks()
        try:
            trainer = self.build(self.plan(cfg))
            result = trainer.train()
        finally:
            self.release(trainer)
            self.drop_checkpoints("v3")
        records, events = self.records("v3")
        self.records3 = records
        if result.exit_code != 0 or result.step != n:
            return False, f"it ended {result.stop} at step {result.step}: {result.message}", {}
        path = self.root / "golden.json"

        def write_golden():
            golden = make_golden(records, self.cfg, self.world, self.profile_name, device_description(), n)
            _write_json(path, golden)
            return golden["steps"]

        points = self.from_main(write_golden)
        saves = sum(e.get("save_blocked_s", 0.0) for e in events if e.get("event") == "stop")
        figures = ", ".join(f"{p['step']}: {_rate(p['tokens_per_s'])} tok/s"
                            + (f" {p[p['memory_key']]:.2f} GiB" if p.get("memory_key") else "") for p in points)
        late = f" (more than the launcher's {SIGTERM_GRACE_S} s SIGTERM grace)" if saves > SIGTERM_GRACE_S else ""
        return True, (f"{n} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}; golden steps {figures}"
                      f" -> {path}; saves blocked training {saves:.1f} s{late}"), \
            {"steps": n, "golden_steps": points, "save_blocked_s": saves}

    def c_mfu(self):
        peak = self.zt.get("peak_flops_per_device")
        if not peak:
            return False, (f"profile {self.profile_name} has no zerotrain.peak_flops_per_device: MFU cannot be"
                           " judged"), {}
        mfus = [r["mfu"] for r in (self.records3[1:] or self.records3) if r.get("mfu") is not None]
        if not mfus:
            return False, "the rehearsal's records have no MFU", {}
        mfu, (threshold, source) = statistics.median(mfus), mfu_threshold(self.zt)
        return mfu >= threshold, (f"median MFU {mfu:.3f} of {peak / 1e12:.4g} TFLOP/s per device; threshold"
                                  f" {threshold:.3f} ({source})"), \
            {"mfu": mfu, "threshold": threshold, "threshold_source": source, "peak_flops_per_device": peak,
             "seconds": 0.0}


def _rate(x: float) -> str:
    return f"{x / 1e6:,.2f}M" if x >= 1e6 else f"{x / 1e3:,.1f}k" if x >= 1e3 else f"{x:,.0f}"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# Entry: `zerotrain preflight ...` (launcher/cli.py) and `python -m|deepspeed --module zerotrain.launcher.commands.preflight ...`
# ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    from zerotrain.launcher.config import resolve_config

    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, rest = parse_args(argv)
        code = Preflight(resolve_config(rest), opts).run()
    except UsageError as e:  # bad input before the checks (config, profile, a held lock): exit 2
        fail(str(e), EXIT_USAGE)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
