"""`make bench-gpu`: the GPU path measured on one CUDA GPU, as one markdown table for benchmarks/RESULTS.md.

    python benchmarks/gpu.py [--profile NAME|auto] [--steps 50] [--stages 2,3] [--attention sdpa,flex,varlen]
                             [--model PRESET] [--seq-len T] [--vocab-size V] [--nproc N] [--grad-accum K] [--out DIR]

The `xlarge` preset (1.4B parameters) at seq 2048 in bf16, on GPU 0 alone, through the real driver (one
process per configuration: `python -m zerotrain.launcher.train`, a world of 1), under ZeRO-2 and ZeRO-3,
with each attention kernel. Per configuration: tokens/s and MFU (median over the steps after the first 10:
torch.compile and the allocator warm up there) against the profile's `peak_flops_per_device`, peak memory
(`torch.cuda.max_memory_allocated`, the driver's `peak_mem_gib`) against the planner's prediction
(launcher/components/planner.py `memory`: tensors alone, comparable with max_memory_allocated, and the total
with the CUDA context and its fragmentation allowance), and the loss at the last step.

The profile gives the peak FLOP/s, precision, ZeRO settings and optimizer: `auto` is the one
`--profile auto` picks for this GPU (its device count is ignored: one GPU here). The micro-batch is the
profile's, lowered to the largest the planner fits in 90% of this GPU; a stage the planner cannot fit is a
row saying so. Data: the demo's offline mix (launcher/commands/demo.py) with the byte tokenizer (vocab 320:
the head is 0.04% of the model), so nothing is downloaded; `--vocab-size V` (e.g. 128256, Llama-3's, what the
recipes train with) gives the model a V-entry head and embedding through a byte-level tokenizer padded to V
entries (its merges are not what costs: the (V, D) head and the loss over V are), `--grad-accum K` accumulates K
micro-batches a step, and `--nproc N` runs N ranks on the first N GPUs through the real `deepspeed` launcher. Each run's final checkpoint (~17 GB for 1.4B) is
deleted once its metrics are read.

Needs our install plus a CUDA build of torch (`make install TORCH_SPEC=...`, docs/gpu.md); nothing compiled
besides what torch.compile makes for `flex` (Triton, shipped with CUDA torch). Without CUDA it prints one
line and exits 0, running nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

MODEL, SEQ_LEN = "xlarge", 2048
WARMUP_STEPS = 10  # not in the medians: compilation, the allocator's first growth
FIT_FRACTION = 0.9  # the micro-batch the planner fits in this share of the GPU


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="auto", help="a GPU profile name or path (default: the one this GPU matches)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--model", default=MODEL, help=f"a model preset (default {MODEL}; a small one for a smoke run)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--attention", default="sdpa,flex,varlen", help="kernels to run, comma-separated")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="the model's vocabulary (a byte tokenizer padded to this many entries; default: 320 bytes)")
    p.add_argument("--nproc", type=int, default=1, help="ranks, one per GPU, through the deepspeed launcher")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--out", default=str(REPO / "runs" / "bench-gpu"), help="run directories (checkpoints deleted)")
    a = p.parse_args(argv)
    for name, value, least in (("--steps", a.steps, WARMUP_STEPS + 1), ("--seq-len", a.seq_len, 8),
                               ("--nproc", a.nproc, 1), ("--grad-accum", a.grad_accum, 1)):
        if value < least:
            p.exit(2, f"benchmarks/gpu.py: {name} must be at least {least}, got {value}\n")
    if a.vocab_size and a.vocab_size < MIN_VOCAB:
        p.exit(2, f"benchmarks/gpu.py: --vocab-size must be 0 (bytes) or at least {MIN_VOCAB}, got {a.vocab_size}\n")
    for name, value, known in (("--stages", a.stages, ("2", "3")), ("--attention", a.attention, ("sdpa", "flex", "varlen"))):
        unknown = [v for v in value.split(",") if v not in known]
        if unknown:
            p.exit(2, f"benchmarks/gpu.py: {name} {value!r}: {unknown[0]!r} is not one of {', '.join(known)}\n")
    return a


MIN_VOCAB = 259  # the 256 bytes, <|endoftext|>, <|begin_of_text|>, and one more


def sized_tokenizer(vocab_size: int, out: Path) -> Path:
    """A byte-level tokenizer with `vocab_size` entries: the 256 byte tokens and two specials in use, the rest
    never produced. `tokenizers` builds it (a BPE without merges); the model's head and embedding are
    (vocab_size, dim) as with a trained tokenizer of that size, which is what the benchmark measures."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from zerotrain.dataio.tokenizer import SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *alphabet])}
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos, bos = SPECIAL_TOKENS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos, "pad_token": eos}))
    return out


def main(argv: list[str]) -> int:
    a = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}, CUDA build"
              f" {torch.version.cuda or 'none'}); nothing run", flush=True)
        return 0
    from harness import demo_mix

    from zerotrain.launcher.components import planner
    from zerotrain.launcher.config import RunConfig, config_from
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.profiles import detect_profile, load_profile
    from zerotrain.launcher.run_plan import plan_run

    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    try:
        name = detect_profile()[0] if a.profile == "auto" else a.profile
        name, profile = load_profile(name)
    except UsageError as e:
        print(f"benchmarks/gpu.py: {e} (give --profile NAME)", file=sys.stderr)
        return 2
    if a.nproc > torch.cuda.device_count():
        print(f"benchmarks/gpu.py: --nproc {a.nproc}: {torch.cuda.device_count()} GPU(s) visible", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mix = demo_mix()
    tokenizer = str(sized_tokenizer(a.vocab_size, out / f"tokenizer-{a.vocab_size}")) if a.vocab_size else "bytes"
    has_attention = "attention" in {f.name for f in fields(RunConfig)}  # a driver older than --attention has none
    backends = a.attention.split(",") if has_attention else ["(the driver's default)"]
    rows = []
    print(header(name, device, argv, a), flush=True)  # each row as it is measured: a run cut short keeps the rows done
    for stage in (int(s) for s in a.stages.split(",")):
        prof = json.loads(json.dumps(profile))
        prof["zero_optimization"]["stage"] = stage
        prof_path = out / f"{name}-zero{stage}.json"
        prof_path.write_text(json.dumps(prof, indent=2))
        for backend in backends:
            values = {"profile": str(prof_path), "data": str(mix), "model": a.model, "seq_len": a.seq_len,
                      "tokenizer": tokenizer, "grad_accum": a.grad_accum, "max_steps": a.steps, "warmup_steps": WARMUP_STEPS, "out": str(out),
                      "run_id": f"zero{stage}-{backend}", "resume": "never", "log_data_every_steps": 0}
            if has_attention:
                values["attention"] = backend
            row = {"stage": stage, "attention": backend}
            rows.append(row)
            try:
                plan = plan_run(config_from({**values, "dry_run": True}), a.nproc)
            except UsageError as e:  # e.g. varlen with a torch that lacks it
                row["result"] = f"refused: {e}"
                print(row_line(row), flush=True)
                continue
            setup = planner.setup_from(plan.ds_config, plan.settings.values, world=a.nproc, nodes=1, device_bytes=props.total_memory,
                                       args=plan.model_args, attention=plan.attention)
            ac = bool(plan.settings.activation_checkpointing)
            fit = planner.max_micro_batch(plan.model_args, replace(setup, device_bytes=FIT_FRACTION * props.total_memory),
                                          stage, a.seq_len, ac)
            micro = min(plan.ds_config["train_micro_batch_size_per_gpu"], fit)
            if micro == 0:
                row["result"] = f"not run: the planner fits no row in {FIT_FRACTION:.0%} of this GPU"
                print(row_line(row), flush=True)
                continue
            mem = planner.memory(plan.model_args, setup, stage, micro, a.seq_len, ac)
            row.update(micro=micro, kernel=plan.attention, planned_tensors=(mem["total"] - mem["context"]
                                                                            - mem["fragmentation"]) / 2**30,
                       planned_total=mem["total"] / 2**30, peak_flops=plan.settings.peak_flops_per_device)
            row.update(measure(values, micro, out, a.nproc))
            print(row_line(row), flush=True)
    return 0


def measure(values: dict, micro: int, out: Path, nproc: int = 1) -> dict:
    """One driver run (N ranks through the deepspeed launcher); its metrics summarised. A failed run is a row
    saying how (its last stderr line)."""
    flags = []
    for key, value in {**values, "micro_batch": micro}.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    run_dir = out / values["run_id"]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(nproc))))
    launcher = [sys.executable, "-m", "zerotrain.launcher.train"] if nproc == 1 else [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--module", "zerotrain.launcher.train"]
    proc = subprocess.run([*launcher, *flags], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices.split(",")[:nproc])})
    (out / f"{values['run_id']}.log").write_text(proc.stdout + proc.stderr)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode:
        last = next((ln for ln in reversed((proc.stderr or proc.stdout).splitlines()) if ln.strip()), "")
        return {"result": f"FAILED (exit {proc.returncode}): {last[:160]}"}
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "loss" in r and "event" not in r]
    timed = [r for r in steps if r["step"] > WARMUP_STEPS] or steps
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
            "peak_gib": max(r.get("peak_mem_gib", 0.0) for r in steps), "loss": steps[-1]["loss"],
            "last_step": steps[-1]["step"], "wall_s": time.time() - t0}


def header(profile: str, device: str, argv: list[str], a) -> str:
    import torch

    return "\n".join([
        f"GPU benchmark, {time.strftime('%Y-%m-%d')}: {device}, torch {torch.__version__} (CUDA"
        f" {torch.version.cuda}), profile {profile}; {a.model} at seq {a.seq_len}, vocabulary"
        f" {a.vocab_size or 'bytes (320)'}, gradient accumulation {a.grad_accum}, bf16, {a.nproc} GPU(s); medians"
        f" over steps {WARMUP_STEPS + 1}+; command: python benchmarks/gpu.py {' '.join(argv)}".rstrip(), "",
        "| ZeRO | attention | micro | tokens/s | MFU | peak allocated | planner: tensors / total | loss (step) |",
        "|---|---|---|---|---|---|---|---|"])


def row_line(r: dict) -> str:
    if "tokens_per_s" not in r:
        return f"| {r['stage']} | {r['attention']} | {r.get('micro', '')} | {r.get('result', '')} | | | | |"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (no peak in the profile)"
    return (f"| {r['stage']} | {r['kernel']} | {r['micro']} | {r['tokens_per_s']:,.0f} | {mfu} |"
            f" {r['peak_gib']:.1f} GiB | {r['planned_tensors']:.1f} / {r['planned_total']:.1f} GiB |"
            f" {r['loss']:.3f} ({r['last_step']}) |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
