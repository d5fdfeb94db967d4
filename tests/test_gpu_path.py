"""The GPU path as far as one process on a CPU can check it (bf16, the kernels, the device checks), no process group:

- precision: what a DeepSpeed dict trains in, and bf16 at ZeRO-2/3 accumulating gradients in fp32
  (launcher/profiles.py `accumulate_in_fp32`); a bf16 model's losses are fp32 sums, so the token-weighted
  (SFT) loss and the evaluation's token sums keep fp32 precision (a bf16 loss of ~660 would be rounded to 4);
- the optimizer each profile steps with: nothing to compile on a GPU profile (torch.optim.AdamW(fused=True)),
  DeepSpeed's CPU Adam where the optimizer is offloaded (launcher/optimizers.py `implementation`);
- `--dry-run` of the 8-GPU profiles names the attention kernel, the precision and the optimizer class;
- benchmarks/gpu.py on a machine without CUDA: one line, exit 0, nothing run.
The 2-rank bf16 runs under the real launcher are tests/test_bf16.py.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from zerotrain.launcher.components import determinism
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.optimizers import NO_BUILD_ADAMW, implementation
from zerotrain.launcher.profiles import accumulate_in_fp32, list_profiles, load_profile, precision, resolve_ds_config
from zerotrain.modeling.loss import global_token_mean_scale
from zerotrain.modeling.model import ModelArgs, Transformer

CUDA_PROFILES = [n for n in list_profiles() if load_profile(n)[1]["zerotrain"]["hardware"]["accelerator"] == "cuda"]
# the offload profiles keep DeepSpeed's CPU Adam and its own buffers (test_offload_profiles_step_with_cpu_adam)
OFFLOAD_PROFILES = [n for n in CUDA_PROFILES if load_profile(n)[1]["zerotrain"].get("offload") not in (None, "none")]
GPU_PROFILES = [n for n in CUDA_PROFILES if n not in OFFLOAD_PROFILES]


def resolved(name: str, profile: dict | None = None, **values) -> tuple[dict, object]:
    profile = profile or load_profile(name)[1]
    hw = profile["zerotrain"]["hardware"]
    cfg = config_from({"data": "mix.json", "profile": name, **values})
    return resolve_ds_config(profile, cfg, hw.get("devices_per_node", 1) * hw.get("nodes", 1), name), cfg


# -- precision ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,bf16,data_types,expect", [
    (3, True, None, "fp32"), (2, True, None, "fp32"),
    (2, True, {"grad_accum_dtype": "bf16"}, "bf16"),  # the profile says: kept
    (1, True, None, None), (0, True, None, None),  # DeepSpeed refuses (stage 0) or swaps its optimizer (stage 1)
    (3, False, None, None),  # fp32 runs: nothing to say
])
def test_bf16_at_zero2_and_zero3_accumulates_gradients_in_fp32(stage, bf16, data_types, expect):
    ds = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    if data_types:
        ds["data_types"] = data_types
    assert (accumulate_in_fp32(ds).get("data_types") or {}).get("grad_accum_dtype") == expect
    offloaded = {**ds, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    assert accumulate_in_fp32(offloaded) == offloaded  # offload keeps DeepSpeed's own buffers: not run here


def test_every_gpu_profile_is_bf16_with_fp32_accumulation_and_cpu_is_unchanged():
    assert GPU_PROFILES
    for name in GPU_PROFILES:
        ds, _ = resolved(name)
        assert precision(ds) == "bf16" and ds["data_types"] == {"grad_accum_dtype": "fp32"}, name
    for name in ("cpu", "cpu-zero2"):
        ds, _ = resolved(name)
        assert precision(ds) == "fp32" and "data_types" not in ds


def packed_batch(B=4, T=48, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :9] = -100  # prompts
    labels[0] = -100  # a row with nothing to predict
    position_ids = torch.arange(T).expand(B, T).clone()
    position_ids[1, 20:] = torch.arange(T - 20)  # documents sharing rows
    position_ids[2, 31:] = torch.arange(T - 31)
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


def bf16_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300)).to(torch.bfloat16)


def fp64_token_loss_sum(model, batch) -> tuple[float, int]:
    """Sum over labelled tokens of the cross-entropy of the model's bf16 logits, in fp64, and their count."""
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"]).double()
    targets = batch["labels"][:, 1:].flatten()
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets, ignore_index=-100, reduction="sum")
    return loss.item(), int((targets != -100).sum())


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_a_bf16_model_returns_fp32_losses_so_the_token_weighted_loss_keeps_fp32_precision(chunk_tokens):
    """The SFT loss: each micro-batch's loss SUM x global_token_mean_scale, summed as the Trainer does (float64)
    and divided by accum x world, is the mean over every labelled token of the global batch."""
    model = bf16_model()
    model.lm_head.chunk_tokens = chunk_tokens
    micro_batches = [packed_batch(seed=s) for s in range(4)]  # 2 micro-batches x 2 "ranks"
    ref_sum, ref_tokens = map(sum, zip(*(fp64_token_loss_sum(model, b) for b in micro_batches)))
    scale = global_token_mean_scale(2, 2, ref_tokens)
    total = torch.zeros((), dtype=torch.float64)
    for b in micro_batches:
        loss = model(b["input_ids"], b["position_ids"], b["labels"], loss_reduction="sum")
        assert loss.dtype == torch.float32  # bf16 spacing at ~660 is 4: a bf16 sum would be off by ~1e-3
        total += (loss * scale).detach().double()
        mean = model(b["input_ids"], b["position_ids"], b["labels"])
        assert mean.dtype == torch.float32
    assert total.item() / 4 == pytest.approx(ref_sum / ref_tokens, rel=1e-6)


def test_evaluation_of_a_bf16_model_sums_tokens_at_fp32_precision():
    model = bf16_model(seed=1)
    b = [packed_batch(seed=s) for s in (5, 6)]
    rows = {"src": {k: torch.cat([x[k] for x in b]) for k in b[0]}}
    got = Evaluator(rows, 0, 1, micro_batch=3).evaluate(model)
    ref_sum, ref_tokens = fp64_token_loss_sum(model, rows["src"])
    assert got["val_tokens"] == ref_tokens
    assert got["val_loss"] == pytest.approx(ref_sum / ref_tokens, rel=1e-6)


# -- the optimizer a run steps with --------------------------------------------------------------------------

@pytest.mark.parametrize("name", GPU_PROFILES)
def test_gpu_profiles_step_with_torch_fused_adamw_and_compile_nothing(name):
    ds, cfg = resolved(name)
    assert ds["optimizer"]["type"] == "AdamW" and NO_BUILD_ADAMW.items() <= ds["optimizer"]["params"].items()
    what, build = implementation(cfg, ds, "cuda")
    assert what == "torch.optim.AdamW(fused=True) through DeepSpeed" and build is None


@pytest.mark.parametrize("name", OFFLOAD_PROFILES)
def test_offload_profiles_step_with_cpu_adam(name):
    ds, cfg = resolved(name)
    assert precision(ds) == "bf16" and "data_types" not in ds  # offload keeps DeepSpeed's own buffers
    what, build = implementation(cfg, ds, "cuda")
    assert what.startswith("deepspeed.ops.adam.DeepSpeedCPUAdam") and "DS_BUILD_CPU_ADAM=1" in build


def test_offloaded_optimizer_keeps_deepspeeds_cpu_adam_and_other_choices_say_what_they_build():
    profile = load_profile("h100-80g-x8")[1]
    offload = {**profile, "zero_optimization": {**profile["zero_optimization"],
                                                "offload_optimizer": {"device": "cpu"}}}
    ds, cfg = resolved("h100-80g-x8", offload)
    assert "torch_adam" not in ds["optimizer"]["params"] and "fused" not in ds["optimizer"]["params"]
    what, build = implementation(cfg, ds, "cuda")
    assert what.startswith("deepspeed.ops.adam.DeepSpeedCPUAdam") and "DS_BUILD_CPU_ADAM=1" in build
    # asked for explicitly: DeepSpeed's FusedAdam, which takes no `fused` argument, and compiles with nvcc
    ds, cfg = resolved("h100-80g-x8", optimizer="adamw", optimizer_args={"torch_adam": False})
    assert ds["optimizer"]["params"]["torch_adam"] is False and "fused" not in ds["optimizer"]["params"]
    what, build = implementation(cfg, ds, "cuda")
    assert what == "deepspeed.ops.adam.FusedAdam" and "nvcc" in build and "DS_BUILD_FUSED_ADAM=1" in build
    ds, cfg = resolved("h100-80g-x8", optimizer="lion")
    assert implementation(cfg, ds, "cuda")[1].startswith("DeepSpeed's fused_lion CUDA op")
    ds, cfg = resolved("h100-80g-x8", optimizer="ademamix")
    assert implementation(cfg, ds, "cuda")[1] is None
    # DeepSpeed torch.compiles its Muon update (the first step waits for it): said, not "nothing to compile"
    ds, cfg = resolved("h100-80g-x8", optimizer="muon")
    assert implementation(cfg, ds, "cuda")[1].startswith("torch.compile of DeepSpeed's Muon update at the first step")


@pytest.mark.parametrize("name", ["a100-80g-x8", "h100-80g-x8"])
def test_dry_run_names_the_kernel_precision_and_optimizer_a_gpu_node_would_use(name, mix_path, tmp_path, capsys):
    from zerotrain.launcher.trainer import dry_run

    result = dry_run(config_from({"profile": name, "data": str(mix_path), "out": str(tmp_path / "runs"),
                                  "model": "xlarge", "seq_len": 2048}))
    out = capsys.readouterr().out
    assert result.exit_code == 0 and not (tmp_path / "runs").exists()
    assert "attention: varlen (auto on cuda, bf16)" in out  # PyTorch's own flash kernel: nothing to build
    assert "precision: bf16 (" in out and "gradients accumulated over micro-batches in fp32" in out
    assert "optimizer implementation on cuda: torch.optim.AdamW(fused=True) through DeepSpeed; nothing to compile" \
        in out
    assert "JIT-compiled" not in out
    assert "resume: same data, same states, losses equal to within nondeterministic reductions on cuda" in out


def test_sdpa_with_gqa_on_cuda_is_refused_at_planning_naming_varlen_and_flex(mix_path, tmp_path, capsys):
    """On CUDA, sdpa over packed documents (a mask) with fewer kv heads than heads has no fused kernel (flash takes
    no mask, memory-efficient no GQA): PyTorch runs the math kernel, (B, H, T, T) fp32 per layer. Refused in one
    line before anything is written; the same model on a CPU, without GQA, or with flex plans as before."""
    from zerotrain.launcher.trainer import dry_run

    base = {"data": str(mix_path), "out": str(tmp_path / "runs"), "seq_len": 256, "attention": "sdpa"}
    with pytest.raises(UsageError, match=r"^--attention sdpa: on CUDA, sdpa with packed documents and fewer kv heads"
                                         r" than heads \(GQA\) falls to PyTorch's math kernel.*: use varlen \(bf16/fp16\)"
                                         r" or flex$"):
        dry_run(config_from({**base, "profile": "h100-80g-x8", "model": "debug"}))  # debug: 4 heads, 2 kv heads
    assert not (tmp_path / "runs").exists()
    for extra, kernel in (({"profile": "h100-80g-x8", "model": "xlarge"}, "sdpa"),  # as many kv heads as heads
                          ({"profile": "h100-80g-x8", "model": "debug", "attention": "flex"}, "flex"),
                          ({"profile": "cpu", "model": "debug"}, "sdpa")):
        assert dry_run(config_from({**base, **extra})).exit_code == 0, extra
        assert f"attention: {kernel} (" in capsys.readouterr().out, extra


def test_auto_resolving_to_sdpa_with_gqa_on_cuda_is_counted_as_the_math_kernel(mix_path, tmp_path, capsys):
    """auto on CUDA in fp32 (or with a torch without varlen) is sdpa; with GQA and packed documents PyTorch runs its
    math kernel. Not refused (auto is not a choice the user made), but said on the attention line and counted by the
    fit check: each layer's (B, H, T, T) fp32 softmax, so a micro-batch that fits with a fused kernel does not fit
    with the math kernel's scores (its formula against what autograd keeps: tests/test_planner.py)."""
    from zerotrain.launcher.trainer import dry_run

    profile = json.loads((REPO / "ds_configs" / "h100-80g-x8.json").read_text())
    profile["bf16"] = {"enabled": False}
    (tmp_path / "fp32.json").write_text(json.dumps(profile))
    base = {"data": str(mix_path), "out": str(tmp_path / "runs"), "profile": str(tmp_path / "fp32.json")}
    assert dry_run(config_from({**base, "model": "debug", "seq_len": 256})).exit_code == 0  # 4 heads, 2 kv heads
    out = capsys.readouterr().out
    assert ("attention: sdpa (auto on cuda, fp32; with packed documents and GQA PyTorch runs its math kernel here:"
            " (B, H, T, T) fp32 scores per layer, counted by the fit check") in out
    assert dry_run(config_from({**base, "model": "tiny", "seq_len": 256})).exit_code == 0  # no GQA: a fused kernel
    assert "attention: sdpa (auto on cuda, fp32)\n" in capsys.readouterr().out
    # 64 heads, 8 kv heads at seq 8192: one layer's softmax alone is 16 GiB at micro-batch 1; 16 layers do not fit
    # 80 GB, though the same model with a fused kernel does (flex)
    (tmp_path / "rules.yaml").write_text("gqa:\n  head_dim: 16\n  layers_per_head: [1, 4]\n  mlp_ratio: 2\n"
                                         "  kv_heads_ratio: 8\n")
    big = {**base, "scaling_rule": "gqa", "heads": 64, "rules_file": str(tmp_path / "rules.yaml"), "seq_len": 8192,
           "micro_batch": 1}
    dry_run(config_from(big))  # a dry run says the verdict; a real run's fit check refuses with it
    assert "plan: does not fit: needs 332.36 GiB per GPU (ZeRO-3, micro-batch 1 x 8192" in capsys.readouterr().out
    dry_run(config_from({**big, "attention": "flex"}))
    assert "plan: fits: 14.50 GiB per GPU" in capsys.readouterr().out


def test_deterministic_says_whether_a_resume_is_bit_identical_here(mix_path, tmp_path, capsys):
    """--deterministic (or the profile's zerotrain.deterministic): the dry run for a GPU node says a resume will
    be bit-identical and attention auto takes sdpa, not varlen's flash backward; a CPU run is exact anyway."""
    from zerotrain.launcher.trainer import dry_run

    base = {"data": str(mix_path), "out": str(tmp_path / "runs"), "model": "debug", "seq_len": 256}
    profile = json.loads((REPO / "ds_configs" / "h100-80g-x8.json").read_text())
    profile["zerotrain"]["deterministic"] = True
    (tmp_path / "det.json").write_text(json.dumps(profile))
    for extra in ({"profile": "h100-80g-x8", "deterministic": True}, {"profile": str(tmp_path / "det.json")}):
        dry_run(config_from({**base, **extra}))
        out = capsys.readouterr().out
        assert "resume: bit-identical on cuda (--deterministic: deterministic kernels, slower)" in out
        assert "attention: varlen (auto on cuda, bf16)" in out  # its flash backward is deterministic then
    dry_run(config_from({**base, "profile": "cpu"}))
    assert "resume: bit-identical (CPU kernels accumulate in a fixed order)" in capsys.readouterr().out
    profile["zerotrain"]["deterministic"] = "yes"
    (tmp_path / "det.json").write_text(json.dumps(profile))
    with pytest.raises(UsageError, match="zerotrain.deterministic must be true or false, got 'yes'"):
        dry_run(config_from({**base, "profile": str(tmp_path / "det.json")}))
    with pytest.raises(UsageError, match="--deterministic: must be true or false"):
        config_from({**base, "deterministic": "yes"})


def test_deterministic_asks_torch_for_deterministic_kernels_and_a_fixed_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    determinism.apply(torch, False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.are_deterministic_algorithms_enabled()
    try:
        determinism.apply(torch, True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
        # not warn-only: torch's flash/varlen and memory-efficient backward are deterministic only then
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


# -- benchmarks/gpu.py -------------------------------------------------------------------------------------

@pytest.mark.launches
def test_gpu_benchmark_without_cuda_says_so_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, lines
    assert lines[0].startswith("benchmarks/gpu.py: no CUDA device") and "nothing run" in lines[0]
    assert not out.exists()
    assert "bench-gpu:" in (REPO / "Makefile").read_text()
