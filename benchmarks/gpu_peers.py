"""`make bench-gpu-peers`: our driver beside a plain torch loop and Hugging Face Llama, one GPU, one table.

    python benchmarks/gpu_peers.py [--model xlarge] [--seq-len 2048] [--docs packed|one|both] [--micro N]
        [--largest] [--grad-accum 1[,8]] [--steps 20] [--discard 8] [--rounds 2] [--budget-s 480]
        [--programs A,B,C,D,Dl,E] [--vocab-size V] [--out DIR] [--smoke]

The programs, each run in a process of its own (memory starts clean), interleaved: A B C D Dl, then the same
reversed, round after round, as the budget allows:
  A   our driver as shipped on 2026-11-26, before its GPU defaults: `zerotrain train` on the h100-80g-x8 profile as
      it was at commit 72584b6 (benchmarks/profiles/h100-80g-x8-2026-11-26.json) at ZeRO-2, --no-compile,
      --attention varlen;
  B   our driver on the shipped profile as it is now (ds_configs/h100-80g-x8.json), nothing overridden but the
      shape (model, seq len, data, steps, micro-batch, grad-accum);
  C   a plain torch loop on our own `Transformer`, no DeepSpeed (benchmarks/peer_loops.py);
  D   Hugging Face `LlamaForCausalLM` of the same shape, sdpa, compiled; Dl: D with liger-kernel's kernels;
  E   litgpt or torchtitan: a row saying they are not installed (nothing is written to run them).
The same documents for all: synthetic text (random letters and spaces, the byte tokenizer: one token a byte)
written once as a jsonl source; the driver reads it through a mix file, C and D pack it with our packer.
`--docs packed`: documents of random lengths (log-uniform, 64 to seq_len tokens) packed best-fit, positions
restarting at each document; `one`: every document seq_len - 1 tokens, so every row is one document.
`--vocab-size V`: the model's vocabulary is V (the recipes' Llama 3 tokenizer: 128256), through a byte-level
tokenizer of V entries (benchmarks/gpu.py `sized_tokenizer`): the same bytes a token, the embedding and the head
(V, dim) as with a trained tokenizer of that size, which is what the loss head's cost depends on.

Time per step: A and B, the wall clock between consecutive step records of the driver's metrics.jsonl
(`elapsed_s`: the whole loop, host work between steps included); C and D, a CUDA event at the start of every step.
Medians over the steps after the first `--discard`. tokens/s counts every row slot (rows x seq_len, padding
too, the same for every program). MFU two ways, against one peak (DEVICE_PEAKS by the GPU's name, else B's
profile's `peak_flops_per_device`): ours (`sizes.flops_per_token`: 6 x the matmul parameters plus the full
causal-free T x T attention term) and the 6N-only figure peers quote (6 x the matmul parameters, the head
included, no attention term). The micro-batch is the same for all: `--micro`, else what the planner fits for B
(benchmarks/gpu.py `plan_micro`), A at most what its own planner fits (then without a B/A ratio). `--largest`
adds rows at each program's largest: A and B the planner's fit in 90% of the GPU, C and D doubled until out of
memory. A and B are stopped once their last step is logged (their
final checkpoint is neither timed nor written out); their `--torch-profile` summary (the driver's flag, where
it has it) and C's in-process one (launcher/components/observe/torch_profile.py) go to profiles.txt.

`--budget-s`: a run whose expected time (this program's last run, else the mean run so far) would end past the
budget is not started: its row says so. Out (`--out`, default $OUT, else runs/gpu_peers; rewritten after every
row): gpu_peers.md (the table), gpu_peers.json (every row), profiles.txt, runs.log (the end of every run's
output). `--smoke`: the debug model at seq 128 on the CPU with the `cpu` profile (A: its copy as of 72584b6), a
few steps, C and D uncompiled: what the suite runs (tests/test_benchmarks.py). Without CUDA and without --smoke:
one line, exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu  # noqa: E402  (benchmarks/gpu.py: plan_micro, staged_profile, driver_command, step_records)

PROGRAMS = ("A", "B", "Bz", "C", "D", "Dl", "E")  # Bz: B with --b-zero / --b-config (runs only when given)
OLD_PROFILES = {"gpu": REPO / "benchmarks/profiles/h100-80g-x8-2026-11-26.json",
                "cpu": REPO / "benchmarks/profiles/cpu-2026-11-26.json"}  # A: `git show 72584b6:ds_configs/...`
SHIPPED = {"gpu": "h100-80g-x8", "cpu": "cpu"}  # B
DEVICE_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s by a part of the GPU's name
SMOKE = {"model": "debug", "seq_len": 128, "steps": 4, "discard": 1, "rounds": 1, "micro": 2}
DEFAULTS = {"model": "xlarge", "seq_len": 2048, "steps": 20, "discard": 8, "rounds": 2, "micro": None}
PROFILE_STEPS = 3
POLL_S = 0.5


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks/gpu_peers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model preset (default xlarge; debug with --smoke)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default 2048; 128 with --smoke)")
    p.add_argument("--docs", default="packed", choices=("packed", "one", "both"), help="document layout")
    p.add_argument("--micro", type=int, help="rows per micro-batch for every program (default: the planner's for B)")
    p.add_argument("--largest", action="store_true", help="also each program's largest micro-batch")
    p.add_argument("--grad-accum", default="1", help="micro-batches per step, comma-separated (e.g. 1,8)")
    p.add_argument("--steps", type=int, help="steps per run (default 20; 4 with --smoke)")
    p.add_argument("--discard", type=int, help="first steps left out of the medians (default 8; 1 with --smoke)")
    p.add_argument("--rounds", type=int, help="interleaved rounds, every other one reversed (default 2; 1 --smoke)")
    p.add_argument("--budget-s", type=float, default=480.0, help="no run is started that would end past this")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="which, comma-separated, in this order")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_peers"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the suite's check)")
    p.add_argument("--b-zero", type=json.loads, default=None,
                   help="program Bz: B with these zero_optimization keys over the shipped profile's (a JSON object)")
    p.add_argument("--b-config", type=json.loads, default=None,
                   help="program Bz: B with these profile keys over the shipped profile's, an object's keys merged"
                        " into the shipped object's (e.g. '{\"data_types\": {\"grad_accum_dtype\": \"fp32\"}}')")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="the model's vocabulary (a byte-level tokenizer of this many entries; default 0: bytes, 320)")
    p.add_argument("--commit", help="the commit measured, for the header (default: git's, where the checkout has .git)")
    a = p.parse_args(argv)
    for key, value in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.smoke and a.largest:
        p.exit(2, "benchmarks/gpu_peers.py: --largest needs a GPU (its memory bounds the micro-batch)\n")
    a.programs = a.programs.split(",")
    unknown = [x for x in a.programs if x not in PROGRAMS]
    if unknown or not a.programs:
        p.exit(2, f"benchmarks/gpu_peers.py: --programs: {unknown[0] if unknown else 'none'!r} is not one of"
                  f" {', '.join(PROGRAMS)}\n")
    try:
        a.grad_accum = [int(x) for x in a.grad_accum.split(",")]
    except ValueError:
        p.exit(2, f"benchmarks/gpu_peers.py: --grad-accum {a.grad_accum!r}: whole numbers, comma-separated\n")
    from zerotrain.modeling.sizes import PRESETS

    if a.model not in PRESETS:
        p.exit(2, f"benchmarks/gpu_peers.py: --model {a.model!r} is not a preset ({', '.join(PRESETS)})\n")
    for name, value, least in (("--seq-len", a.seq_len, 16), ("--steps", a.steps, a.discard + 2),
                               ("--discard", a.discard, 0), ("--rounds", a.rounds, 1), ("--micro", a.micro or 1, 1),
                               ("--grad-accum", min(a.grad_accum), 1), ("--budget-s", a.budget_s, 1)):
        if value < least:
            p.exit(2, f"benchmarks/gpu_peers.py: {name} must be at least {least}, got {value}\n")
    if a.vocab_size and a.vocab_size < gpu.MIN_VOCAB:
        p.exit(2, f"benchmarks/gpu_peers.py: --vocab-size must be 0 (bytes) or at least {gpu.MIN_VOCAB},"
                  f" got {a.vocab_size}\n")
    return a


# -- data ------------------------------------------------------------------------------------------

def write_documents(path: Path, layout: str, seq_len: int, tokens: int, seed: int = 0) -> Path:
    """Synthetic documents (random lowercase letters and spaces: one byte-tokenizer token each) as a jsonl
    source of about `tokens` tokens; `one`: each seq_len - 1 long (with its EOS, exactly a row)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    if layout == "one":
        lengths = np.full(max(8, tokens // seq_len), seq_len - 1)
    else:
        low, high = min(64, seq_len // 2), seq_len
        mean = (high - low) / np.log(high / low)  # of the log-uniform lengths
        lengths = np.exp(rng.uniform(np.log(low), np.log(high), max(64, int(tokens / mean)))).astype(int)
    text = alphabet[rng.integers(0, len(alphabet), int(lengths.sum()))].tobytes().decode()
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    path.write_text("".join(json.dumps({"text": text[s:e]}) + "\n" for s, e in zip(bounds[:-1], bounds[1:])))
    return path


def mix_file(docs: Path) -> Path:
    path = docs.with_suffix(".mix.json")
    path.write_text(json.dumps({"sources": [{"name": "synthetic", "weight": 1.0, "path": str(docs)}]}))
    return path


# -- one run of each kind --------------------------------------------------------------------------

def run_process(command: list[str], log: Path, cwd: Path, env: dict, timeout_s: float, done=lambda: False):
    """Run `command` in a session of its own, its output to `log`; SIGKILL its whole process group (compile
    workers, data loader workers) once `done()` says its work is in, or after `timeout_s`. Returns (exit code,
    how it ended: "exited", "stopped" or "killed")."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                env=env)
        t0, ended = time.time(), "exited"
        while proc.poll() is None:
            time.sleep(POLL_S)
            ended = "stopped" if done() else "killed" if time.time() - t0 > timeout_s else ended
            if ended != "exited":
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended between the poll and the kill
                    pass
                proc.wait()
    return proc.returncode, ended


def driver_run(values: dict, micro: int, work: Path, timeout_s: float, env_extra: dict) -> dict:
    """One driver process (benchmarks/gpu.py `driver_command`, run from the work directory), stopped as soon as
    its last step record is in metrics.jsonl, so the final checkpoint is not written; its step records read."""
    run_dir = work / "runs" / values["run_id"]
    command, env = gpu.driver_command(values, micro)
    log = work / f"{values['run_id']}.log"
    code, ended = run_process(command, log, work, {**env, **env_extra}, timeout_s,
                              done=lambda: last_step(run_dir) >= values["max_steps"])
    records = gpu.step_records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    profile = run_dir / "torch_profile" / "summary.txt"
    result = {"log": log, "profile": profile.read_text() if profile.is_file() else None}
    if ended == "killed":
        return {**result, "status": f"killed after {timeout_s:.0f} s (the budget)"}
    if len(records) < values["max_steps"]:
        return {**result, "status": f"failed (exit {code}): {last_line(log)}"}
    elapsed = [r["elapsed_s"] for r in records]
    return {**result, "status": "ok", "periods_s": [b - a for a, b in zip([0.0] + elapsed, elapsed)],
            "losses": [r["loss"] for r in records],
            "peak_gib": max((r["peak_mem_gib"] for r in records if "peak_mem_gib" in r), default=None)}


def varied_profile(shipped: dict, b_zero: dict | None, b_config: dict | None) -> dict:
    """Program Bz's profile: the shipped one with --b-config's keys (an object merged into the shipped object,
    key by key) and --b-zero's zero_optimization keys over it."""
    prof = json.loads(json.dumps(shipped))
    change = {**(b_config or {})}
    if b_zero:
        change["zero_optimization"] = {**change.get("zero_optimization", {}), **b_zero}
    for key, value in change.items():
        prof[key] = {**prof[key], **value} if isinstance(value, dict) and isinstance(prof.get(key), dict) else value
    return prof


def bz_change(b_zero: dict | None, b_config: dict | None) -> str:
    said = [f"zero_optimization {json.dumps(b_zero)}"] if b_zero else []
    return " and ".join(said + ([json.dumps(b_config)] if b_config else []))


def plan_values(values: dict) -> dict:
    """A driver row's values as the planner takes them: its profile decides compiling (A's, eager), no profiler."""
    return {k: v for k, v in values.items() if k not in ("compile", "torch_profile")}


def planned_gib(values: dict, micro: int, device_bytes: float | None) -> float | None:
    """What the planner predicts a driver row's tensors take at `micro` (GiB, `gpu.plan_micro`'s planned_tensors:
    without the CUDA context and the fragmentation allowance), to hold against the row's max_memory_allocated
    (the aim: within +-10%, never under); None without a GPU or where the planner refuses."""
    if device_bytes is None:
        return None
    return gpu.plan_micro(plan_values(values), device_bytes, micro=micro).get("planned_tensors")


def plan_error(planned: float | None, peak: float | None) -> str:
    """The planned tensors and their error against the measured peak: "46.9 (+12.3%)"; "n/a" without both."""
    if planned is None or not peak:
        return "n/a" if planned is None else f"{planned:.1f}"
    return f"{planned:.1f} ({planned / peak - 1:+.1%})"


def driver_micro(program: str, values: dict, micro: int, sizing: str, device_bytes: float | None) -> int:
    """A driver row's micro-batch: `largest`, the planner's fit; A at the shared micro-batch, at most its own fit:
    A's planner (the old profile, eager) refuses the shared micro-batch on a smaller GPU (xlarge at 8 on an 80 GB
    H100, 2026-11-28), so A runs at the most it fits and ratios() leaves its ratio out. No GPU: `micro`."""
    if device_bytes is None or (sizing != "largest" and program != "A"):
        return micro
    fit = gpu.plan_micro(plan_values(values), device_bytes)
    return fit.get("fit", micro) if sizing == "largest" else min(micro, fit.get("fit", micro))


def loop_run(spec: dict, work: Path, timeout_s: float, env_extra: dict) -> dict:
    """One plain loop (benchmarks/peer_loops.py) in its own process."""
    name = spec["run_id"]
    spec_path, result_path, log = work / f"{name}.spec.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    code, ended = run_process([sys.executable, str(REPO / "benchmarks" / "peer_loops.py"), str(spec_path),
                               str(result_path)], log, work, {**os.environ, **env_extra}, timeout_s)
    if ended == "killed":
        return {"log": log, "status": f"killed after {timeout_s:.0f} s (the budget)"}
    if not result_path.is_file():
        return {"log": log, "status": f"failed (exit {code}): {last_line(log)}"}
    return {"log": log, **json.loads(result_path.read_text())}


def last_step(run_dir: Path) -> int:
    """The highest step in a running driver's metrics.jsonl so far (0: none yet; a line still being written is
    not read)."""
    try:
        return max((r["step"] for r in gpu.step_records(run_dir)), default=0)
    except (OSError, ValueError):
        return 0


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def interleaved(programs: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, program) in the order run: every program once a round, every other round reversed (A B C, C B A,
    A B C, ...), so that a drift of the machine over the call does not favour the programs that run first."""
    return [(r, p) for r in range(1, rounds + 1) for p in (programs if r % 2 else list(reversed(programs)))]


# -- the benchmark ---------------------------------------------------------------------------------

class Bench:
    def __init__(self, a, work: Path, device: str, device_bytes: float | None):
        from zerotrain.launcher.config_resolve import build_parser, config_from
        from zerotrain.launcher.run_plan import plan_run

        self.a, self.work, self.device, self.device_bytes = a, work, device, device_bytes
        kind = "cpu" if a.smoke else "gpu"
        self.env = {"CUDA_VISIBLE_DEVICES": ""} if a.smoke else {}
        self.old_profile = json.loads(OLD_PROFILES[kind].read_text())
        self.shipped = SHIPPED[kind]
        self.has_torch_profile = "--torch-profile" in build_parser().format_help()
        self.data = {layout: write_documents(work / f"docs-{layout}.jsonl", layout, a.seq_len,
                                             max(2**16, 32 * max(a.grad_accum) * a.steps * a.seq_len))
                     for layout in (("packed", "one") if a.docs == "both" else (a.docs,))}
        self.shape = {"model": a.model, "seq_len": a.seq_len, "resume": "never", "log_data_every_steps": 0,
                      "max_steps": a.steps, "warmup_steps": 2, "out": str(work / "runs"),
                      "data": str(mix_file(next(iter(self.data.values()))))}
        if a.vocab_size:
            self.shape["tokenizer"] = gpu.tokenizer_for(a.vocab_size, work)
        plan = plan_run(config_from({**self.shape, "profile": self.shipped, "dry_run": True}), 1)
        self.model_args = plan.model_args
        opt = plan.ds_config["optimizer"]["params"]
        self.optimizer = {k: opt[k] for k in ("lr", "betas", "eps", "weight_decay")}
        self.peak, self.peak_source = plan.settings.peak_flops_per_device, f"profile {self.shipped}"
        self.micro, self.micro_source = a.micro, "--micro"
        if a.micro is None:
            fit = gpu.plan_micro({**self.shape, "profile": self.shipped}, device_bytes)
            if "result" in fit:
                raise SystemExit(f"benchmarks/gpu_peers.py: B's plan: {fit['result']}")
            self.micro, self.micro_source = fit["micro"], f"the planner's for B (fits {fit['fit']})"
        self.t0, self.durations, self.rows, self.profiles, self.logs = time.time(), {}, [], [], []

    def set_peak(self, device_name: str) -> None:
        for part, flops in DEVICE_PEAKS.items():
            if part in device_name:
                self.peak, self.peak_source = flops, f"{part} dense bf16 (DEVICE_PEAKS)"
                return

    def groups(self):
        """(layout, sizing, accum), the main comparison first: packed, the same micro-batch, accum 1."""
        layouts = list(self.data)
        sizings = ["same"] + (["largest"] if self.a.largest else [])
        return [(layout, sizing, accum) for sizing in sizings for accum in self.a.grad_accum for layout in layouts]

    def run_all(self, save=lambda: None) -> None:
        """Every run in order; `save()` after each row (a call cut short keeps the rows done)."""
        for layout, sizing, accum in self.groups():
            for r, program in interleaved(self.a.programs, self.a.rounds):
                row = {"program": program, "round": r, "docs": layout, "sizing": sizing, "accum": accum}
                row.update(self.run_program(program, layout, sizing, accum, r))
                if row.get("status") is not None:  # None: a row said once per group (E, Dl without liger)
                    self.rows.append(row)
                    print(row_line(row), flush=True)
                    save()

    def not_runnable(self, program: str, first_round: bool) -> dict | None:
        reason = None
        if program == "E":
            found = [m for m in ("litgpt", "torchtitan") if find_spec(m)]
            reason = (f"not run: {found[0]} is importable, but no runner is written for it" if found
                      else "not run: not installed (litgpt, torchtitan)")
        elif program == "Bz" and not (self.a.b_zero or self.a.b_config):
            return {"status": None}  # nothing to vary
        elif program == "Dl" and self.device != "cuda":
            reason = "not run: liger-kernel's kernels are Triton (CUDA only)"
        elif program == "Dl" and find_spec("liger_kernel") is None:
            reason = "not run: liger_kernel is not importable (not installed)"
        if reason is None:
            return None
        return {"status": reason if first_round else None}

    def expected_s(self, program: str) -> float:
        if program in self.durations:
            return self.durations[program]
        done = list(self.durations.values())
        return statistics.mean(done) if done else 0.0

    def run_program(self, program: str, layout: str, sizing: str, accum: int, round_: int) -> dict:
        skip = self.not_runnable(program, round_ == 1)
        if skip is not None:
            return skip
        spent = time.time() - self.t0
        left = self.a.budget_s - spent
        if spent + self.expected_s(program) > self.a.budget_s:
            return {"status": f"not run: budget (expected {self.expected_s(program):.0f} s, {max(0, left):.0f} s"
                              f" left of {self.a.budget_s:.0f})"}
        run_id = f"{program}-{layout}-{sizing}-accum{accum}-r{round_}"
        timeout = max(left, 30.0) + 30.0
        t = time.time()
        if program in ("A", "B", "Bz"):
            values, micro = self.driver_values(program, layout, accum, run_id)
            micro = driver_micro(program, values, micro, sizing, self.device_bytes)
            out = {**driver_run(values, micro, self.work, timeout, self.env),
                   "planned_gib": planned_gib(values, micro, self.device_bytes)}
        else:
            micro = self.micro
            spec = {"program": program, "run_id": run_id, "model_args": asdict(self.model_args),
                    "seq_len": self.a.seq_len, "micro": micro, "accum": accum, "steps": self.a.steps,
                    "device": self.device, "compile": not self.a.smoke,
                    "attention": "sdpa" if self.a.smoke else "varlen", "docs_file": str(self.data[layout]),
                    "optimizer": self.optimizer, "largest": sizing == "largest",
                    "profile_at": self.profile_start() if program == "C" else None, "profile_count": PROFILE_STEPS}
            out = loop_run(spec, self.work, timeout, self.env)
            micro = out.get("micro", micro)
        self.durations[program] = time.time() - t
        self.keep_log(run_id, out)
        return self.figures(out, micro, accum, time.time() - t)

    def profile_start(self) -> int:
        """The first profiled step (1-based): the last PROFILE_STEPS + 1 steps of the discarded warm-up, so the
        profiler's own cost (and its teardown) stays out of the medians where the warm-up is long enough."""
        return max(1, self.a.discard - PROFILE_STEPS)

    def driver_values(self, program: str, layout: str, accum: int, run_id: str) -> tuple[dict, int]:
        values = {**self.shape, "data": str(mix_file(self.data[layout])), "grad_accum": accum, "run_id": run_id}
        if program == "A":
            path = self.work / "A.profile.json"
            path.write_text(json.dumps(gpu.staged_profile(self.old_profile, 2)))
            values.update(profile=str(path), attention="sdpa" if self.a.smoke else "varlen", compile=False)
        elif program == "Bz":
            from zerotrain.launcher.profiles import load_profile

            shipped = load_profile(self.shipped)[1]
            path = self.work / "Bz.profile.json"
            path.write_text(json.dumps(varied_profile(shipped, self.a.b_zero, self.a.b_config)))
            values["profile"] = str(path)
        else:
            values["profile"] = self.shipped
        if self.has_torch_profile:
            values["torch_profile"] = f"{self.profile_start()}:{PROFILE_STEPS}"
        return values, self.micro

    def keep_log(self, run_id: str, out: dict) -> None:
        log = out.get("log")
        text = Path(log).read_text(errors="replace").replace("\r", "\n") if log and Path(log).is_file() else ""
        tail = [ln for ln in text.splitlines() if ln.strip()][-40:]
        self.logs.append(f"==== {run_id}: {out.get('status')}\n" + "\n".join(tail))
        program = run_id.split("-")[0]
        if program in ("A", "B", "Bz", "C"):
            self.profiles.append(f"==== {run_id}\n" + (out.get("profile") or "no profile written\n"))

    def figures(self, out: dict, micro: int, accum: int, wall_s: float) -> dict:
        from zerotrain.modeling.sizes import flops_per_token

        row = {"micro": micro, "status": out["status"], "wall_s": round(wall_s, 1)}
        if out["status"] != "ok":
            return row
        timed = out["periods_s"][self.a.discard:]
        step_s = statistics.median(timed)
        tokens_per_s = micro * accum * self.a.seq_len / step_s
        ours = flops_per_token(self.model_args, self.a.seq_len)
        six_n = ours - 12 * self.model_args.n_layers * self.model_args.dim * self.a.seq_len
        row.update(tokens_per_s=tokens_per_s, step_ms=step_s * 1e3, mfu=tokens_per_s * ours / self.peak,
                   mfu_6n=tokens_per_s * six_n / self.peak, peak_gib=out.get("peak_gib"), loss=out["losses"][-1],
                   first_step_s=out.get("first_step_s"), steps_timed=len(timed))
        if "planned_gib" in out:  # the driver's rows: the planner's prediction beside the peak
            row["planned_gib"] = out["planned_gib"]
        if "masks_documents" in out:
            row["masks_documents"] = out["masks_documents"]
        return row


# -- output ----------------------------------------------------------------------------------------

COLUMNS = ("round", "program", "docs", "micro", "accum", "tokens/s", "MFU (ours)", "MFU (6N)", "step ms",
           "peak GiB", "planned GiB (error)", "loss (last step)", "status")


def row_line(r: dict) -> str:
    sizing = " (largest)" if r["sizing"] == "largest" else ""
    cells = [r["round"], r["program"], r["docs"], f"{r.get('micro', '')}{sizing}", r["accum"]]
    if "tokens_per_s" in r:
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
        planned = plan_error(r.get("planned_gib"), r.get("peak_gib")) if "planned_gib" in r else ""
        cells += [f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}", f"{r['mfu_6n']:.1%}", f"{r['step_ms']:.1f}", peak,
                  planned, f"{r['loss']:.4f}"]
    else:
        cells += [""] * 7
    status = r["status"]
    if status == "ok":  # the run's wall time, start-up and compilation included; C/D's first step (compiling)
        first = f", first step {r['first_step_s']:.1f} s" if r.get("first_step_s") is not None else ""
        status = f"ok (run {r['wall_s']:.0f} s{first})"
    return "| " + " | ".join(str(c) for c in cells + [status]) + " |"


def ratios(rows: list[dict]) -> list[str]:
    """Per group: each program's median tokens/s over its rounds, and B against each of the others."""
    lines = []
    for key in dict.fromkeys((r["docs"], r["sizing"], r["accum"]) for r in rows):
        med, micro = {}, {}
        for r in rows:
            if (r["docs"], r["sizing"], r["accum"]) == key and "tokens_per_s" in r:
                med.setdefault(r["program"], []).append(r["tokens_per_s"])
                micro[r["program"]] = r["micro"]
        med = {p: statistics.median(v) for p, v in med.items()}
        if "B" in med:
            # at the same micro-batch only (each program's largest is compared as such)
            vs = ", ".join(f"B/{p} {med['B'] / v:.3f}" if key[1] == "largest" or micro[p] == micro["B"]
                           else f"B/{p} n/a ({p} at micro-batch {micro[p]}, B at {micro['B']})"
                           for p, v in med.items() if p != "B")
            lines.append(f"- {key[0]} docs, {key[1]} micro-batch, accum {key[2]}: " + (vs or "B alone"))
    return lines


def header(bench: Bench, device: str, argv: list[str]) -> list[str]:
    import torch

    a = bench.a
    commit = a.commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=REPO).stdout.strip()
        except OSError:  # no git where it runs
            commit = None
    bz = f"; Bz: B with {bz_change(a.b_zero, a.b_config)}" if a.b_zero or a.b_config else ""
    precision = ("fp32 throughout (the CPU)" if a.smoke else
                 "bf16 parameters, fp32 master weights and AdamW states (fused AdamW), clipping 1.0")
    return [
        f"GPU peers, {time.strftime('%Y-%m-%d')}: {device}, torch {torch.__version__}, commit"
        f" {commit or 'n/a'}; model {a.model} ({bench.model_args.n_layers} layers, dim"
        f" {bench.model_args.dim}, vocabulary {bench.model_args.vocab_size}) at seq {a.seq_len}; micro-batch"
        f" {bench.micro} ({bench.micro_source}); {a.steps} steps a run, medians over steps {a.discard + 1}+;"
        f" peak {bench.peak:.3g} FLOP/s ({bench.peak_source}); command: python benchmarks/gpu_peers.py"
        f" {' '.join(argv)}".rstrip(), "",
        "A: our driver as shipped on 2026-11-26 (profile as of 72584b6, ZeRO-2, --no-compile, varlen); B: our driver"
        f" on ds_configs/{bench.shipped}.json now; C: plain torch loop on our Transformer (varlen, layout from the"
        " host, per-block torch.compile)" + bz + "; D: HF LlamaForCausalLM (sdpa, per-layer torch.compile); Dl: D with"
        f" liger-kernel. C and D: {precision}. Step time: A/B the wall clock between consecutive metrics.jsonl step"
        " records (elapsed_s), C/D CUDA events at each step start (host work between steps included in both)."
        " MFU (ours): sizes.flops_per_token (matmuls + full T x T attention); MFU (6N): the matmuls only. Peak GiB:"
        " max_memory_allocated; planned GiB (error): the planner's tensors at the row's micro-batch (no context,"
        " no fragmentation allowance) against it."
        f" Torch-profile summaries: profiles.txt{'' if bench.has_torch_profile else ' (C only: this driver has no --torch-profile)'}.",
        "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]


def footnotes(rows: list[dict]) -> list[str]:
    """What the table's figures do not say: how D treated packed documents (its own run reports it)."""
    masks = {r["masks_documents"] for r in rows if r["docs"] == "packed" and "masks_documents" in r}
    if not masks:
        return []
    return ["D on packed documents: " + (
        "transformers found the documents from the restarting position_ids and masked each one (a dense"
        " block-diagonal mask: sdpa cannot take its flash kernel with it)" if masks == {True} else
        "this transformers does not mask packed documents through sdpa: D attends across them (the same tokens,"
        " other math)")]


def write_out(bench: Bench, out: Path, head: list[str]) -> str:
    rows = [row_line(r) for r in bench.rows]
    extra = ratios(bench.rows) + [f"- {n}" for n in footnotes(bench.rows)]
    table = "\n".join(head + rows + ([""] + extra if extra else [])) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_peers.md").write_text(table)
    (out / "gpu_peers.json").write_text(json.dumps({"header": head[0], "rows": bench.rows}, indent=1, default=str))
    (out / "profiles.txt").write_text("\n".join(bench.profiles) or "no profile written\n")
    (out / "runs.log").write_text("\n\n".join(bench.logs) + "\n")
    return table


def main(argv: list[str]) -> int:
    a = parse(argv)
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu_peers.py: no CUDA device; nothing run", flush=True)
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu_peers-"))
    try:
        if a.smoke:
            device, name, total = "cpu", f"CPU ({os.cpu_count()} cores)", None
        else:
            props = torch.cuda.get_device_properties(0)
            device, name, total = "cuda", f"{props.name}, {props.total_memory / 2**30:.1f} GiB", props.total_memory
        bench = Bench(a, work, device, total)
        if device == "cuda":
            bench.set_peak(name)
        head = header(bench, name, argv)
        print("\n".join(head), flush=True)
        bench.run_all(save=lambda: write_out(bench, Path(a.out), head))
        print("\n" + write_out(bench, Path(a.out), head), flush=True)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
