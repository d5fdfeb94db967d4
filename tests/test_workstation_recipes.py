"""The dual RTX 6000 Ada recipes (recipes/rtx6000ada-x2-*.json) in CPU form, on 2 ranks under the real
`deepspeed` launcher: ZeRO-3, bf16, activation checkpointing and Muon, as the workstation runs them.

The CPU form is derived from the shipped recipe and its profile (ds_configs/rtx6000ada-48g-x2.json) by
`cpu_form`, so it follows them when they change; only the device and the shapes change:
- the profile's device settings come from the shipped `cpu` profile (hardware, gloo, peak FLOP/s and MFU, data
  loader) and its CUDA/NCCL environment is dropped; every other key (ZeRO-3 and its buckets, bf16, fp16 off,
  clipping, activation checkpointing, the AdamW fallback) is kept, which `test_the_cpu_form_keeps_...` asserts
  key by key. One ZeRO-3 number follows the shapes: `stage3_param_persistence_threshold` (1e6 elements) scales
  with the model, so that, as on the workstation, every matrix is gathered and every norm vector persists (kept
  verbatim, the tiny model would persist whole and ZeRO-3 would gather nothing);
- the recipe keeps its profile, optimizer, learning rates and checkpoint rotation; the model (`debug`), the
  byte tokenizer, a local mix, seq 64, micro-batch 2, grad-accum 2 (still derived from global_batch_tokens),
  3 steps and a save every step replace the workstation's shapes and the hub mix.
bf16 on an AVX2 host is emulated, slowly: hence the debug model and 3 steps. The precision of the workstation
is kept (bf16 matmuls, gradients accumulated in fp32).

Launches (4, shared by every assertion): the 760m form without checkpointing, uninterrupted (the reference);
the 760m form as shipped, killed with kill -9 after its first save and resumed with `--resume auto` (it must log
the reference's losses bit for bit), then exported; both count ZeRO-3's parameter all-gathers per micro-batch
(tests/helpers/gather_count_harness.py); the 1.3b form for 3 steps.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from conftest import BIN, REPO, free_port, launch, read_metrics
from test_long_runs import ENV, popen, wait_for_step

# DeepSpeed's Muon update is torch.compile'd: on a CPU inductor builds ~30 C++ kernels (~80 CPU-s per fresh install,
# measured 2026-11-28; its cache is keyed by the install's path). Compiling is not what these launches test (the
# workstation compiles with Triton; tests/test_gpu_speed.py compares the compiled Muon update with the eager one):
# here it runs eagerly, the same arithmetic, in every launch, so the killed-and-resumed run still meets its reference.
EAGER = {**ENV, "TORCHDYNAMO_DISABLE": "1"}

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

RECIPES = ("rtx6000ada-x2-760m", "rtx6000ada-x2-1.3b")
PROFILE = "rtx6000ada-48g-x2"
N = 3
MODEL, SEQ, MICRO, ACCUM, WORLD = "debug", 64, 2, 2, 2
# what a CPU form replaces in the recipe: the shapes, the hub data and the gated tokenizer, the schedule's length
SHAPES = {"model": MODEL, "seq_len": SEQ, "micro_batch": MICRO, "global_batch_tokens": SEQ * MICRO * ACCUM * WORLD,
          "tokenizer": "bytes", "max_steps": N, "warmup_steps": 1, "save_every_steps": 1}
DROPPED = ("save_every_hours",)  # replaced by a save every step (the kill -9 test)
# what it takes from the cpu profile: the device
DEVICE_KEYS = ("hardware", "dist_backend", "peak_flops_per_device", "peak_flops_note", "expected_mfu",
               "mfu_threshold", "mfu_note", "dataloader")
CUDA_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_", "NCCL_", "CUDA_")
THRESHOLD = "stage3_param_persistence_threshold"


def params_of(model: str, vocab: int) -> int:
    from zerotrain.modeling.sizes import count_params, preset

    return count_params(preset(model, vocab_size=vocab))["total"]


def cpu_form(recipe: str, tmp: Path, data: Path, **changes) -> tuple[Path, dict, dict]:
    """The recipe and its profile with the CPU's device and the test's shapes, written under `tmp`:
    (the recipe's path, the derived profile, the derived recipe). `changes`: further recipe values."""
    from zerotrain.launcher.config import load_recipe

    shipped = load_recipe(str(REPO / "recipes" / f"{recipe}.json"))
    profile = json.loads((REPO / "ds_configs" / f"{shipped['profile']}.json").read_text())
    cpu = json.loads((REPO / "ds_configs" / "cpu.json").read_text())["zerotrain"]
    form = copy.deepcopy(profile)
    for key in DEVICE_KEYS:
        form["zerotrain"][key] = copy.deepcopy(cpu[key])
    env = form["zerotrain"].get("env", {})
    env["set"] = {k: v for k, v in env.get("set", {}).items() if not k.startswith(CUDA_ENV)}
    # the workstation's ratio of gathered to persistent parameters: the threshold scales with the model
    real = params_of(shipped["model"], 128_256)
    tiny = params_of(MODEL, 258)
    zero = form["zero_optimization"]
    zero[THRESHOLD] = int(zero[THRESHOLD] * tiny / real)
    form["zerotrain"]["description"] = f"{shipped['profile']} in CPU form (tests/test_workstation_recipes.py)"
    profile_path = tmp / f"{recipe}-profile.json"
    profile_path.write_text(json.dumps(form, indent=2))
    values = {k: v for k, v in shipped.items() if k not in DROPPED}
    values.update(SHAPES, data=str(data), profile=str(profile_path), **changes)
    path = tmp / f"{recipe}-cpu.json"
    path.write_text(json.dumps(values, indent=2))
    return path, form, values


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))  # an empty section: no key
        else:
            out[f"{prefix}{k}"] = v
    return out


def counting(counts: Path, recipe: Path, out: Path, run_id: str, *extra: str) -> list[str]:
    """The command of a 2-rank launch of the run with ZeRO-3's all-gathers counted into `counts`
    (tests/helpers/gather_count_harness.py), and its master port."""
    counts.mkdir(exist_ok=True)
    return [str(BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()),
            str(REPO / "tests" / "helpers" / "gather_count_harness.py"), str(counts), "--config", str(recipe),
            "--out", str(out), "--run-id", run_id, *extra]


def gathers(counts: Path) -> list[list[dict]]:
    return [json.loads((counts / f"gathers-rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mix_path):
    """Four launches: the 760m form without checkpointing (the reference, counted); the 760m form as shipped
    (checkpointing, counted) killed with kill -9 once step 2 is logged, then resumed with `--resume auto`;
    the 1.3b form."""
    tmp = tmp_path_factory.mktemp("workstation")
    out = tmp / "runs"
    forms = {name: cpu_form(name, tmp, mix_path) for name in RECIPES}
    r760, r13 = (forms[name][0] for name in RECIPES)
    plain = subprocess.run(counting(tmp / "plain", r760, out, "plain", "--no-activation-checkpointing"),
                           capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, **EAGER})
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    # kill -9 of the whole process group once step 2 is logged: the save of step 1 is complete, the one of
    # step 2 under way (each save slowed by 1 s after each rank's first file)
    cmd = counting(tmp / "ac", r760, out, "ac")
    proc = popen(cmd, {**EAGER, "ZEROTRAIN_TEST_SLOW_SAVE": "1"})
    try:
        wait_for_step(out / "ac", 2, proc)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        for leaked in allreduce_buffer_files(int(cmd[4])):
            leaked.unlink(missing_ok=True)
    resumed = launch("deepspeed", ["--config", str(r760), "--out", str(out), "--run-id", "ac", "--resume", "auto"],
                     env_extra=EAGER)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    big = launch("deepspeed", ["--config", str(r13), "--out", str(out), "--run-id", "1.3b"], env_extra=EAGER)
    assert big.returncode == 0, big.stdout[-3000:] + big.stderr[-3000:]
    return {"forms": forms, "out": out, "stdout": {"ac": resumed.stdout, "1.3b": big.stdout},
            "gathers": {"ac": gathers(tmp / "ac"), "plain": gathers(tmp / "plain")}}


def test_the_cpu_form_keeps_every_workstation_setting_but_the_device(runs):
    for name in RECIPES:
        _, form, values = runs["forms"][name]
        shipped = json.loads((REPO / "recipes" / f"{name}.json").read_text())
        profile = json.loads((REPO / "ds_configs" / f"{PROFILE}.json").read_text())
        assert shipped["profile"] == PROFILE
        before, after = flat(profile), flat(form)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        device = {k for k in changed if k.split(".")[1] in DEVICE_KEYS + ("description",)} if changed else set()
        cuda_env = {k for k in changed if k.startswith("zerotrain.env.set.") and k.split(".")[-1].startswith(CUDA_ENV)}
        assert changed - device - cuda_env == {f"zero_optimization.{THRESHOLD}"}, changed
        assert not any(k.startswith("zerotrain.env.pass") for k in changed)  # the passed names are kept
        # kept: what the workstation trains with
        assert form["zero_optimization"]["stage"] == 3
        assert form["bf16"] == {"enabled": True, "check_grad_overflow": False}
        assert form["zerotrain"]["activation_checkpointing"] is True and form["zerotrain"]["dist_backend"] == "gloo"
        replaced = {k for k in shipped.keys() | values.keys() if values.get(k) != shipped.get(k)}
        assert replaced == {"profile", "data", *SHAPES, *DROPPED}, replaced
        assert values["optimizer"] == shipped["optimizer"] == "muon" and values["activation_checkpointing"] is True
        # as DeepSpeed received it, and as the run recorded it
        run = runs["out"] / ("ac" if name == RECIPES[0] else "1.3b")
        ds = json.loads((run / "ds_config.json").read_text())
        assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False}
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
        # (reduce_scatter off: Muon's, launcher/optimizers.py, on a GPU too)
        assert {k: v for k, v in ds["zero_optimization"].items() if k != THRESHOLD} == \
            {**{k: v for k, v in profile["zero_optimization"].items() if k != THRESHOLD}, "reduce_scatter": False}
        config = json.loads((run / "config.json").read_text())["run"]
        assert config["activation_checkpointing"] is True and config["optimizer"] == "muon"


def test_both_recipes_train_3_steps_in_cpu_form(runs):
    for run_id in ("ac", "1.3b"):
        history = read_metrics(runs["out"] / run_id)
        assert [m["step"] for m in history] == list(range(1, N + 1))
        assert history[-1]["loss"] < history[0]["loss"] - 0.5, history
        assert "precision: bf16" in runs["stdout"][run_id]
        assert "optimizer muon (DeepSpeed (MuonWithAuxAdam)" in runs["stdout"][run_id]
        assert (runs["out"] / run_id / "checkpoints" / f"global_step{N}" / "zerotrain.json").is_file()


def test_killed_and_resumed_with_checkpointing_equals_the_run_without_bit_for_bit(runs):
    # On a CPU the recomputed forward is the same computation in the same order, and a resume restores
    # every state: the checkpointed run, killed with kill -9 and resumed, logs the reference's losses exactly.
    ref, killed = read_metrics(runs["out"] / "plain"), read_metrics(runs["out"] / "ac")
    assert "resumed from" in runs["stdout"]["ac"] and "ac/checkpoints/global_step" in runs["stdout"]["ac"]
    raw = [json.loads(line) for line in (runs["out"] / "ac" / "metrics.jsonl").read_text().splitlines()]
    assert [m["event"] for m in raw if "event" in m][0] == "resume"  # killed, then resumed
    assert [m["step"] for m in killed] == [m["step"] for m in ref] == list(range(1, N + 1))
    assert [m["tokens_sha"] for m in killed] == [m["tokens_sha"] for m in ref]
    assert [m["loss"] for m in killed] == [m["loss"] for m in ref]  # full-precision floats, exactly


def test_export_loads_in_transformers_and_matches_the_checkpoint(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from zerotrain.launcher.cli import main as cli
    from zerotrain.launcher.commands.export import consolidated_state_dict
    from zerotrain.modeling.model import Transformer
    from zerotrain.modeling.sizes import ModelArgs

    run = runs["out"] / "ac"  # the resumed run's end
    cli(["export", str(run), "--to", str(tmp_path / "hf")])
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForCausalLM" and not info["missing_keys"]
    config = json.loads((run / "config.json").read_text())
    ours = Transformer(ModelArgs(**config["model"]))
    ours.load_state_dict(consolidated_state_dict(run / "checkpoints" / f"global_step{N}"))
    x = torch.randint(0, 258, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(x).float()
        logits = theirs.eval()(x).logits.float()
    assert (logits - expected).abs().max().item() < 1e-4


def gathered_elements() -> tuple[int, int, int]:
    """(elements of the parameters ZeRO-3 gathers, of those in the checkpointed blocks, of the persistent ones)
    for the CPU form's model, each partition padded to the world size as DeepSpeed pads it."""
    from zerotrain.modeling.model import Transformer
    from zerotrain.modeling.sizes import preset

    threshold = cpu_form_threshold()
    model = Transformer(preset(MODEL, vocab_size=258))
    padded = {n: -(-p.numel() // WORLD) * WORLD for n, p in model.named_parameters()}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    gathered = {n for n in sizes if sizes[n] > threshold}
    return (sum(padded[n] for n in gathered), sum(padded[n] for n in gathered if n.startswith("layers.")),
            sum(padded[n] for n in sizes if n not in gathered))


def cpu_form_threshold() -> int:
    profile = json.loads((REPO / "ds_configs" / f"{PROFILE}.json").read_text())
    real = params_of(json.loads((REPO / "recipes" / f"{RECIPES[0]}.json").read_text())["model"], 128_256)
    return int(profile["zero_optimization"][THRESHOLD] * params_of(MODEL, 258) / real)


def test_zero3_gathers_per_micro_batch_with_and_without_the_recompute(runs):
    """ZeRO-3's parameter all-gathers per forward + backward, counted on each rank (DeepSpeed 0.19.8,
    runtime/zero/partitioned_param_coordinator.py), with the recipe's numbers: prefetch bucket 2e8 elements,
    max live 1e9, max reuse distance 1e9, the persistence threshold scaled as the module docstring says.

    Expected, and why:
    - the first forward + backward records the trace (`reset_step` turns INVALID into RECORD); without a
      complete trace `release_sub_module` releases every parameter of a submodule after its forward and after
      its backward, so each is gathered for its forward and again for its backward (2 x G). With
      checkpointing the recompute is a third forward of each block inside backward: it gathers block
      parameters again, at most once per block (extra <= the blocks' elements), and never less than nothing;
    - from the second pass on the trace is complete: the first fetch prefetches along the trace up to the
      bucket (2e8 elements: the whole tiny model, ONE all-gather), and `__params_to_release` keeps every
      parameter whose next use in the trace lies within the reuse distance (1e9 traversed elements, far beyond
      this model's whole trace), so the recompute finds every parameter available: with and without
      checkpointing each micro-batch gathers every gathered parameter exactly once (G), in one call.
    At the workstation's shapes the same reading predicts extra gathers in the steady state too: one
    micro-batch's trace with checkpointing traverses ~3 x 760M elements > 1e9, so early blocks are released
    after their forward and gathered again (prefetched) for their recompute; not measured here (it needs the
    recipe's shapes).
    """
    total, blocks, persistent = gathered_elements()
    g = runs["gathers"]
    # the checkpointed run was killed after step 2; its file, written as each pass starts, holds the passes
    # before the last of step 2
    passes_of = {"plain": N * ACCUM, "ac": 2 * ACCUM - 1}
    for name, n in passes_of.items():
        assert len(g[name]) == WORLD and g[name][0][:n + 1] == g[name][1][:n + 1], name  # every rank the same
        before, *passes = g[name][0][:n + 1]
        assert before["elements"] == 0  # nothing gathered by the coordinator before the first forward
        assert len(passes) == n and all(p["grad"] for p in passes), passes  # training passes only
        assert [p["trace"] for p in passes] == ["record"] + ["complete"] * (n - 1)
        assert total <= passes[1]["elements"] <= total + persistent  # (persistent vectors gathered once more)
        assert [(p["calls"], p["elements"]) for p in passes[2:]] == [(1, total)] * (n - 2), name
    record_ac, record_plain = g["ac"][0][1], g["plain"][0][1]
    assert record_plain["elements"] == 2 * total + 2 * persistent
    extra = record_ac["elements"] - record_plain["elements"]
    assert 0 < extra <= blocks + persistent, (extra, blocks)
