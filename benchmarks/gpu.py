"""`make bench-gpu`: the GPU path measured on one CUDA GPU, as one markdown table for benchmarks/RESULTS.md.

    python benchmarks/gpu.py [--recipes all|NAME,...] [--profile NAME|auto] [--steps 50] [--nproc N] [--grad-accum K]
    python benchmarks/gpu.py --model PRESET [--seq-len T] [--vocab-size V] [--stages 2,3] [--attention sdpa,flex,varlen]

By default (`make bench-gpu`) each shipped GPU recipe's shape, one row each: the recipe's model, seq len,
vocabulary (its tokenizer's size: the Llama 3 tokenizer's 128,256 entries for the workstation recipes, bytes
for the others), micro-batch, and its profile's ZeRO stage, precision, activation checkpointing and optimizer,
with attention `auto` as the recipe runs it. Only the hardware is this GPU's: the peak FLOP/s and the memory
come from the profile this GPU matches (`--profile`, default auto), so the MFU is against this GPU. Recipes
whose profile offloads to host memory or NVMe are left out of `all` (their speed is the host's; name them to
run them); a recipe that starts from `--init-from` (context extension) is not run: its model is that
directory's, which is not here. Not the recipe's: its data (the demo's offline mix), its length (`--steps`) and its gradient
accumulation (`--grad-accum`, default 1: tokens/s per micro-batch, not the recipe's 2^19-token steps).

With `--model` the older grid instead: that preset (xlarge, 1.4B, for the 2026-11-25 rows) at `--seq-len`
(2048) under ZeRO-2 and ZeRO-3 with each attention kernel, on the profile's settings; `--vocab-size V` gives it
a V-entry head and embedding.

One process per configuration through the real driver (`python -m zerotrain.launcher.train`, a world of 1, or
`--nproc N` ranks on the first N GPUs through the real `deepspeed` launcher). Per configuration: tokens/s and
MFU (median over the steps after the first 10: torch.compile and the allocator warm up there) against the
profile's `peak_flops_per_device`, peak memory (`torch.cuda.max_memory_allocated`, the driver's `peak_mem_gib`)
against the planner's prediction (launcher/planning `memory`: tensors alone, comparable with
max_memory_allocated, and the total with the CUDA context and its fragmentation allowance), and the loss at the
last step. The micro-batch is the recipe's (or the profile's), lowered to the largest the planner fits in 90% of
this GPU; a configuration the planner cannot fit is a row saying so. A vocabulary other than bytes is a
byte-level tokenizer padded to V entries (its merges are not what costs: the (V, D) head and the loss over V
are), so nothing is downloaded. Each run's final checkpoint is deleted once its metrics are read.

Needs our install plus a CUDA build of torch (`make install TORCH_SPEC=...`, docs/gpu.md); nothing compiled
besides what torch.compile makes for `flex` (Triton, shipped with CUDA torch). Without CUDA it prints one
line and exits 0, running nothing (the arguments are checked first).
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
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

MODEL, SEQ_LEN = "xlarge", 2048  # the grid's defaults (--model)
WARMUP_STEPS = 10  # not in the medians: compilation, the allocator's first growth
FIT_FRACTION = 0.9  # the micro-batch the planner fits in this share of the GPU
GRID_ONLY = ("--seq-len", "--vocab-size", "--stages", "--attention")  # a recipe brings its own
# The vocabulary of a recipe's tokenizer that is not shipped (the recipe says which, and where to put it): its size,
# when the directory is not there to read it from. tests/test_benchmarks.py checks every shipped recipe resolves.
TOKENIZER_VOCAB = {"data/llama-3-tokenizer": 128256}
RECIPE_SHAPE_KEYS = ("model", "depth", "aspect_ratio", "head_dim", "scaling_rule", "heads", "qk_norm", "seq_len",
                     "micro_batch", "activation_checkpointing", "optimizer", "optimizer_args", "lr", "min_lr")


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=None,
                   help="shipped recipes to run, comma-separated, or all (default: all, unless --model is given)")
    p.add_argument("--profile", default="auto", help="a GPU profile name or path (default: the one this GPU matches)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--model", default=None, help="a model preset: the grid of stages x kernels instead of recipes")
    p.add_argument("--seq-len", type=int, default=None, help=f"with --model (default {SEQ_LEN})")
    p.add_argument("--stages", default=None, help="with --model (default 2,3)")
    p.add_argument("--attention", default=None, help="with --model: kernels to run, comma-separated (default all)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --model: its vocabulary (a byte tokenizer padded to this many entries; default 320 bytes)")
    p.add_argument("--nproc", type=int, default=1, help="ranks, one per GPU, through the deepspeed launcher")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--out", default=str(REPO / "runs" / "bench-gpu"), help="run directories (checkpoints deleted)")
    a = p.parse_args(argv)
    if a.model is not None and a.recipes is not None:
        p.exit(2, "benchmarks/gpu.py: --recipes and --model: choose one (a recipe names its own model)\n")
    if a.model is None:
        given = [flag for flag in GRID_ONLY if getattr(a, flag[2:].replace("-", "_")) is not None]
        if given:
            p.exit(2, f"benchmarks/gpu.py: {given[0]} is for --model runs; a recipe brings its own shape, stage and"
                      " attention\n")
        try:
            a.recipes = recipe_names(a.recipes or "all")
        except ValueError as e:
            p.exit(2, f"benchmarks/gpu.py: --recipes {a.recipes}: {e}\n")
    else:
        a.seq_len = SEQ_LEN if a.seq_len is None else a.seq_len
        a.vocab_size = a.vocab_size or 0
        a.stages, a.attention = a.stages or "2,3", a.attention or "sdpa,flex,varlen"
    for name, value, least in (("--steps", a.steps, WARMUP_STEPS + 1), ("--seq-len", a.seq_len or 8, 8),
                               ("--nproc", a.nproc, 1), ("--grad-accum", a.grad_accum, 1)):
        if value < least:
            p.exit(2, f"benchmarks/gpu.py: {name} must be at least {least}, got {value}\n")
    if a.vocab_size and a.vocab_size < MIN_VOCAB:
        p.exit(2, f"benchmarks/gpu.py: --vocab-size must be 0 (bytes) or at least {MIN_VOCAB}, got {a.vocab_size}\n")
    for name, value, known in (("--stages", a.stages, ("2", "3")), ("--attention", a.attention, ("sdpa", "flex", "varlen"))):
        unknown = [v for v in (value or "").split(",") if value and v not in known]
        if unknown:
            p.exit(2, f"benchmarks/gpu.py: {name} {value!r}: {unknown[0]!r} is not one of {', '.join(known)}\n")
    return a


def gpu_recipes() -> list[str]:
    """The shipped recipes `all` runs: those on a GPU profile that keeps everything on the GPU."""
    from zerotrain.launcher.config import RECIPE_DIR, load_recipe
    from zerotrain.launcher.profiles import load_profile

    names = []
    for path in sorted(RECIPE_DIR.glob("*.json")):
        recipe = load_recipe(str(path))
        profile = load_profile(recipe["profile"])[1]
        zero = profile.get("zero_optimization", {})
        on_host = any(zero.get(k, {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param"))
        if profile.get("zerotrain", {}).get("hardware", {}).get("accelerator") != "cpu" and not on_host \
                and "init_from" not in recipe:
            names.append(path.stem)
    return names


def recipe_names(spec: str) -> list[str]:
    """`all` or comma-separated shipped recipe names; ValueError naming the first unknown one."""
    from zerotrain.launcher.config import RECIPE_DIR

    if spec == "all":
        return gpu_recipes()
    names = spec.split(",")
    shipped = sorted(p.stem for p in RECIPE_DIR.glob("*.json"))
    unknown = [n for n in names if n not in shipped]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a shipped recipe ({', '.join(shipped)})")
    from zerotrain.launcher.config import load_recipe

    initialised = [n for n in names if "init_from" in load_recipe(n)]
    if initialised:
        raise ValueError(f"{initialised[0]!r} starts from --init-from: its model is that directory's, not run here")
    return names


def recipe_shape(name: str) -> dict:
    """What the benchmark takes from a shipped recipe: its profile, the driver values that shape its step
    (RECIPE_SHAPE_KEYS present in it) and its vocabulary (0: bytes). ValueError for a tokenizer whose size is
    unknown here."""
    from zerotrain.launcher.config import load_recipe

    recipe = load_recipe(name)
    tokenizer = recipe.get("tokenizer", "bytes")
    if tokenizer == "bytes":
        vocab = 0
    elif (REPO / tokenizer / "tokenizer.json").is_file():
        from zerotrain.dataio.sources.tokenizer import load_tokenizer

        vocab = load_tokenizer(str(REPO / tokenizer)).vocab_size
    elif tokenizer in TOKENIZER_VOCAB:
        vocab = TOKENIZER_VOCAB[tokenizer]
    else:
        raise ValueError(f"recipe {name}: the size of tokenizer {tokenizer!r} is not known here")
    return {"recipe": name, "profile": recipe["profile"], "vocab_size": vocab,
            "values": {k: recipe[k] for k in RECIPE_SHAPE_KEYS if k in recipe}}


MIN_VOCAB = 259  # the 256 bytes, <|endoftext|>, <|begin_of_text|>, and one more


def sized_tokenizer(vocab_size: int, out: Path) -> Path:
    """A byte-level tokenizer with `vocab_size` entries: the 256 byte tokens and two specials in use, the rest
    never produced. `tokenizers` builds it (a BPE without merges); the model's head and embedding are
    (vocab_size, dim) as with a trained tokenizer of that size, which is what the benchmark measures."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from zerotrain.dataio.sources.tokenizer import SPECIAL_TOKENS

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

    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.profiles import detect_profile, load_profile

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
    out = Path(a.out).resolve()  # the driver runs with it as its working directory (driver_command)
    out.mkdir(parents=True, exist_ok=True)
    common = {"data": str(demo_mix()), "grad_accum": a.grad_accum, "max_steps": a.steps,
              "warmup_steps": WARMUP_STEPS, "out": str(out), "resume": "never", "log_data_every_steps": 0}
    configs = recipe_configs(a, name, profile, out) if a.model is None else grid_configs(a, name, profile, out)
    print(header(name, device, argv, a), flush=True)  # each row as it is measured: a run cut short keeps the rows done
    for row, prof, values in configs:
        prof_path = out / f"{values['run_id']}.profile.json"
        prof_path.write_text(json.dumps(prof, indent=2))
        row.update(run_one({**common, **values, "profile": str(prof_path)}, props.total_memory, out, a.nproc))
        print(row_line(row), flush=True)
    return 0


def tokenizer_for(vocab_size: int, out: Path) -> str:
    return str(sized_tokenizer(vocab_size, out / f"tokenizer-{vocab_size}")) if vocab_size else "bytes"


def grid_configs(a, name: str, profile: dict, out: Path):
    """--model: (row, profile, driver values) for each ZeRO stage x attention kernel, on the profile's settings."""
    from zerotrain.launcher.config import SETTINGS

    has_attention = "attention" in SETTINGS  # a driver older than --attention has none
    backends = a.attention.split(",") if has_attention else ["(the driver's default)"]
    tokenizer = tokenizer_for(a.vocab_size, out)
    for stage in (int(s) for s in a.stages.split(",")):
        prof = staged_profile(profile, stage)
        for backend in backends:
            values = {"model": a.model, "seq_len": a.seq_len, "tokenizer": tokenizer, "run_id": f"zero{stage}-{backend}"}
            if has_attention:
                values["attention"] = backend
            yield {"stage": stage, "attention": backend}, prof, values


def staged_profile(profile: dict, stage: int) -> dict:
    """A copy of a profile at another ZeRO stage (its other keys as they are)."""
    prof = json.loads(json.dumps(profile))
    prof["zero_optimization"]["stage"] = stage
    return prof


def recipe_configs(a, name: str, profile: dict, out: Path):
    """(row, profile, driver values) for each recipe: its profile, with this GPU's profile's peak FLOP/s and
    hardware (so MFU and the fit are this GPU's), its shape and vocabulary, attention auto."""
    from zerotrain.launcher.profiles import load_profile

    for recipe in a.recipes:
        shape = recipe_shape(recipe)
        prof = json.loads(json.dumps(load_profile(shape["profile"])[1]))
        for key in ("peak_flops_per_device", "hardware"):
            if key in profile.get("zerotrain", {}):
                prof.setdefault("zerotrain", {})[key] = profile["zerotrain"][key]
        values = {**shape["values"], "tokenizer": tokenizer_for(shape["vocab_size"], out), "run_id": recipe}
        yield ({"recipe": recipe, "stage": prof["zero_optimization"]["stage"], "attention": "auto",
                "vocab": f"{shape['vocab_size']:,}" if shape["vocab_size"] else "bytes (320)"}, prof, values)


def run_one(values: dict, device_bytes: float, out: Path, nproc: int) -> dict:
    """Plan one configuration as the driver would, lower its micro-batch to what the planner fits in
    FIT_FRACTION of this GPU, and measure it; a refusal or a configuration that cannot fit is a result."""
    row = plan_micro(values, device_bytes, nproc)
    if "result" in row:
        return row
    return {**row, **measure(values, row["micro"], out, nproc)}


def plan_micro(values: dict, device_bytes: float, nproc: int = 1, micro: int | None = None) -> dict:
    """The configuration planned as the driver would (`plan_run`, dry run): its micro-batch (`micro`, else the
    profile's or the recipe's lowered to `fit`, the most the planner fits in FIT_FRACTION of the device), its
    attention kernel and the planner's memory for that micro-batch; or {"result": why not} for a refusal or no
    fit."""
    from zerotrain.launcher import planning as planner
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.run_plan import plan_run

    try:
        plan = plan_run(config_from({**values, "dry_run": True}), nproc)
    except UsageError as e:  # e.g. varlen with a torch that lacks it
        return {"result": f"refused: {e}"}
    stage = plan.ds_config["zero_optimization"]["stage"]
    setup = planner.setup_from(plan.ds_config, plan.settings.values, world=nproc, nodes=1, device_bytes=device_bytes,
                               args=plan.model_args, attention=plan.attention)
    ac = bool(plan.settings.activation_checkpointing)
    seq_len = plan.cfg.data.seq_len
    fit = planner.max_micro_batch(plan.model_args, replace(setup, device_bytes=FIT_FRACTION * device_bytes),
                                  stage, seq_len, ac)
    micro = min(plan.ds_config["train_micro_batch_size_per_gpu"], fit) if micro is None else micro
    if micro == 0:
        return {"result": f"not run: the planner fits no row in {FIT_FRACTION:.0%} of this GPU"}
    mem = planner.memory(plan.model_args, setup, stage, micro, seq_len, ac)
    return {"micro": micro, "fit": fit, "kernel": plan.attention, "model_args": plan.model_args,
            "planned_tensors": (mem.total - mem.context - mem.fragmentation) / 2**30,
            "planned_total": mem.total / 2**30, "peak_flops": plan.settings.peak_flops_per_device}


def measure(values: dict, micro: int, out: Path, nproc: int = 1) -> dict:
    """One driver run (N ranks through the deepspeed launcher); its metrics summarised. A failed run is a row
    saying how (its last stderr line)."""
    run_dir = out / values["run_id"]
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    command, env = driver_command(values, micro, nproc)
    proc = subprocess.run(command, capture_output=True, text=True, cwd=out, env=env)
    (out / f"{values['run_id']}.log").write_text(proc.stdout + proc.stderr)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if proc.returncode:
        last = next((ln for ln in reversed((proc.stderr or proc.stdout).splitlines()) if ln.strip()), "")
        return {"result": f"FAILED (exit {proc.returncode}): {last[:160]}"}
    steps = step_records(run_dir)
    timed = [r for r in steps if r["step"] > WARMUP_STEPS] or steps
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
            "peak_gib": max(r.get("peak_mem_gib", 0.0) for r in steps), "loss": steps[-1]["loss"],
            "last_step": steps[-1]["step"], "wall_s": time.time() - t0}


def driver_command(values: dict, micro: int, nproc: int = 1) -> tuple[list[str], dict]:
    """(argv, environment) of one driver run: `python -m zerotrain.launcher.train` at a world of 1, the deepspeed
    launcher for more. `values` become flags (run_id -> --run-id V; True -> --flag, False -> --no-flag). Run it
    from outside the checkout: under `python -m` the current directory comes first on sys.path, and the checkout's
    zerotrain/ folder (no launcher/ in it) would shadow a zerotrain installed from a wheel or with --target (an
    editable install finds both)."""
    flags = []
    for key, value in {**values, "micro_batch": micro}.items():
        flag = f"--{key.replace('_', '-')}"
        flags += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(nproc))))
    launcher = [sys.executable, "-m", "zerotrain.launcher.train"] if nproc == 1 else [
        str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--module", "zerotrain.launcher.train"]
    return [*launcher, *flags], {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices.split(",")[:nproc])}


def step_records(run_dir: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl, in order (events left out)."""
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in records if "step" in r and "loss" in r and "event" not in r]


def header(profile: str, device: str, argv: list[str], a) -> str:
    import torch

    what = (f"the recipes' shapes ({', '.join(a.recipes)}), each on its own profile's settings, MFU against {profile}'s"
            f" peak" if a.model is None else
            f"profile {profile}; {a.model} at seq {a.seq_len}, vocabulary {a.vocab_size or 'bytes (320)'}")
    columns = "| recipe | vocabulary | ZeRO |" if a.model is None else "| ZeRO |"
    return "\n".join([
        f"GPU benchmark, {time.strftime('%Y-%m-%d')}: {device}, torch {torch.__version__} (CUDA"
        f" {torch.version.cuda}); {what}; gradient accumulation {a.grad_accum}, {a.nproc} GPU(s); medians"
        f" over steps {WARMUP_STEPS + 1}+; command: python benchmarks/gpu.py {' '.join(argv)}".rstrip(), "",
        f"{columns} attention | micro | tokens/s | MFU | peak allocated | planner: tensors / total | loss (step) |",
        "|" + "---|" * (columns.count("|") - 1 + 7)])


def row_line(r: dict) -> str:
    first = f"| {r['recipe']} | {r['vocab']} | {r['stage']} |" if "recipe" in r else f"| {r['stage']} |"
    if "tokens_per_s" not in r:
        return f"{first} {r['attention']} | {r.get('micro', '')} | {r.get('result', '')} | | | | |"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (no peak in the profile)"
    return (f"{first} {r['kernel']} | {r['micro']} | {r['tokens_per_s']:,.0f} | {mfu} |"
            f" {r['peak_gib']:.1f} GiB | {r['planned_tensors']:.1f} / {r['planned_total']:.1f} GiB |"
            f" {r['loss']:.3f} ({r['last_step']}) |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
