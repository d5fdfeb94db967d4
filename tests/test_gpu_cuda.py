"""The GPU tier (`make test-gpu`, pytest marker `gpu`): what torch and DeepSpeed do on CUDA, not our predictions.

Skipped with its reason where no CUDA device is visible (`make test` hides the GPUs from every other test:
tests/conftest.py). On one GPU, in one command: varlen and compiled flex against sdpa numerics (forward and every
gradient, bf16), the driver in bf16 under ZeRO-2 with `--deterministic` stopped and resumed to the same losses
bit for bit, CUDA fused AdamW named and run, the planner's peak memory against the measured one, the GPU
benchmark's smoke run, and the torch-profile summary's device idle time. With two GPUs or more: a 2-rank NCCL run under the deepspeed launcher, killed and resumed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import REPO, launch, read_metrics
from test_attention import SHAPES, packed_batch
from test_resume_exact import stopped_and_resumed

from zerotrain.modeling.model import ModelArgs, Transformer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device (none visible)")]

N, K = 8, 4
COMMON = ["--model", "debug", "--seq-len", "256", "--micro-batch", "4", "--grad-accum", "2", "--lr", "3e-3",
          "--warmup-steps", "2", "--log-data-every-steps", "0"]


def gpu_profile(tmp_path, stage: int, devices: int = 1) -> str:
    """The shipped H100 profile (bf16, fused AdamW, nccl) for this many GPUs at this ZeRO stage."""
    p = json.loads((REPO / "ds_configs" / "h100-80g-x8.json").read_text())
    p["zero_optimization"]["stage"] = stage
    p["zerotrain"]["hardware"]["devices_per_node"] = devices
    path = tmp_path / f"h100-zero{stage}-x{devices}.json"
    path.write_text(json.dumps(p))
    return str(path)


def cuda_forward_backward(model, backend, x, pos):
    model.attention = backend
    model.zero_grad(set_to_none=True)
    logits = model(x, pos)
    (logits.float().square().mean() + model(x, pos, labels=x)).backward()
    return logits.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_varlen_and_compiled_flex_match_sdpa_on_cuda(shape):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=100, **SHAPES[shape])).cuda().to(torch.bfloat16)
    x, pos = (t.cuda() for t in packed_batch())
    ref_out, ref_grads = cuda_forward_backward(model, "sdpa", x, pos)
    for backend in ("varlen", "flex"):
        out, grads = cuda_forward_backward(model, backend, x, pos)
        scale = ref_out.abs().max()
        assert (out - ref_out).abs().max() <= 2e-2 * scale, (backend, (out - ref_out).abs().max(), scale)
        for name, g in ref_grads.items():
            err, size = (grads[name] - g).abs().max(), g.abs().max()
            assert err <= 3e-2 * size + 1e-6, (backend, name, err, size)


@pytest.mark.launches
def test_the_driver_on_cuda_resumes_bit_for_bit_with_deterministic(tmp_path, mix_path):
    args = ["--profile", gpu_profile(tmp_path, stage=2), "--data", str(mix_path), *COMMON, "--deterministic",
            "--attention", "varlen"]
    full, _ = stopped_and_resumed("python", args, tmp_path, N, K, nproc=1)
    assert "torch.optim.AdamW(fused=True)" in full.stdout  # CUDA fused AdamW through DeepSpeed, nothing compiled
    assert "resume: bit-identical" in full.stdout, full.stdout[-3000:]
    a, b = read_metrics(tmp_path / "a" / "r"), read_metrics(tmp_path / "b" / "r")
    assert [m["tokens_sha"] for m in a] == [m["tokens_sha"] for m in b]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # exact: --deterministic says bit-identical here
    assert a[-1]["loss"] < a[0]["loss"]


@pytest.mark.launches
def test_the_planners_peak_memory_covers_the_measured_one(tmp_path, mix_path):
    from zerotrain.launcher import planning as planner
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.run_plan import plan_run

    values = {"profile": gpu_profile(tmp_path, stage=3), "data": str(mix_path), "model": "small", "seq_len": 1024,
              "micro_batch": 8, "grad_accum": 1, "max_steps": 4, "warmup_steps": 1, "out": str(tmp_path),
              "run_id": "mem", "attention": "varlen"}
    flags = [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    run = launch("python", flags, nproc=1)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    measured = max(m["peak_mem_gib"] for m in read_metrics(tmp_path / "mem"))
    plan = plan_run(config_from({**values, "dry_run": True}), 1)
    setup = planner.setup_from(plan.ds_config, plan.settings.values, world=1, nodes=1,
                               device_bytes=torch.cuda.get_device_properties(0).total_memory, args=plan.model_args,
                               attention=plan.attention)
    mem = planner.memory(plan.model_args, replace(setup), 3, 8, 1024, bool(plan.settings.activation_checkpointing))
    tensors = (mem.total - mem.context - mem.fragmentation) / 2**30
    assert measured <= tensors, (measured, tensors)  # never under-predicted: a micro-batch it fits fits
    assert measured >= 0.5 * tensors, (measured, tensors)  # and not wildly over (H100, 2026-11-25: 6-16% over)


@pytest.mark.launches
def test_the_gpu_benchmark_smoke_run(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--profile", "h100-80g-x8",
                           "--model", "debug", "--seq-len", "256", "--steps", "12", "--stages", "2",
                           "--attention", "varlen", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 |")]
    assert len(rows) == 1 and "FAILED" not in rows[0] and "not run" not in rows[0], proc.stdout
    assert float(rows[0].split("|")[4].replace(",", "")) > 0


@pytest.mark.launches
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-rank NCCL run needs two GPUs")
def test_two_ranks_over_nccl_resume_bit_for_bit(tmp_path, mix_path):
    args = ["--profile", gpu_profile(tmp_path, stage=3, devices=2), "--data", str(mix_path), *COMMON,
            "--deterministic"]
    stopped_and_resumed("deepspeed", args, tmp_path, N, K)
    a, b = read_metrics(tmp_path / "a" / "r"), read_metrics(tmp_path / "b" / "r")
    assert [m["loss"] for m in a] == [m["loss"] for m in b]


@pytest.mark.parametrize("kernel", ["varlen", "sdpa"])
def test_a_compiled_step_of_ours_never_waits_for_the_device(kernel):
    """The trainer's path for one micro-batch (the layout made on the host from the batch's position_ids, the pinned
    batch copied without waiting, the forward through compiled blocks and the chunked loss, the backward) under
    torch.cuda.set_sync_debug_mode("error"): any host sync of ours raises. DeepSpeed's optimizer step is not ours
    and is left out. A first step compiles outside the check (inductor's autotuning may wait)."""
    from zerotrain.launcher.components.engine import compile_blocks
    from zerotrain.modeling.model import preset

    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=512)).cuda().to(torch.bfloat16)
    model.attention = kernel
    compile_blocks(model, "inductor")
    B, T = 4, 256
    ids = torch.randint(0, 512, (B, T))
    rows = [torch.cat([torch.arange(100), torch.arange(T - 100)]), torch.arange(T)] * 2
    batch = {"input_ids": ids, "position_ids": torch.stack(rows), "labels": ids.clone()}
    batch = {k: v.pin_memory() for k, v in batch.items()}  # as the loader hands it over on a GPU

    def step():
        documents = model.document_layout(batch["position_ids"], "cuda")
        on_device = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
        model(**on_device, documents=documents).backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_profile_summary_counts_the_device_waiting_for_the_host():
    """torch_profile.summarize's idle line on real CUDA events: a 50 ms host sleep between two steps' kernels is
    device idle time (at least 25 ms a step over 2 steps), the kernels themselves are not; and its gap lines put
    that time where it began (the host in the device synchronize before the sleep) and say which operator ended
    it (the next step's matmul)."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    from zerotrain.launcher.components.observe.torch_profile import summarize

    a = torch.randn(2048, 2048, device="cuda")
    (a @ a).sum().item()  # cuBLAS initialised before the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            with record_function("step"):
                (a @ a).sum()
                torch.cuda.synchronize()
                time.sleep(0.05)
    lines = summarize(prof, steps=2).splitlines()
    idle = next(line for line in lines if line.startswith("device idle over 2 step(s): "))
    assert 25 <= float(idle.split(": ")[1].split(" ms")[0]) < 60, lines
    at = next(i for i, line in enumerate(lines) if line.startswith("device idle in gaps of 50 us or more"))
    top = lines[at + 2]  # the largest group: the sleep's gap, once (between the steps)
    assert float(top.split()[0]) >= 20 and "Synchronize" in top.split("->")[0] and "-> aten::mm" in top, lines
