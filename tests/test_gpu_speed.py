"""The GPU step's defaults (issue: fast on the GPU), what of them the CPU can check.

- regional compilation (engine.compile_blocks: --compile, and zerotrain.compile in every CUDA profile) trains what
  the eager model trains: loss and every gradient within 1e-6, on 2 ranks at ZeRO-2 with activation checkpointing
  and the tiled MLP, at ZeRO-3 and at SP=2, inductor on the CPU in fp32; DeepSpeed's Muon update from the compiled
  gradients within its own rounding; a compiled engine resumes bit for bit (tests/helpers/compile_harness.py, one
  launch);
- the documents' layout is made on the host from the batch's position_ids (Transformer.document_layout), equal to
  what the model derives itself, with a fixed max_seqlen for varlen (no host sync, one graph for every step);
- one device does not pay for ZeRO-3 (profiles.one_device_stage) and a profile's compile skips ZeRO-3
  (run_plan.compile_at_stage);
- the CUDA profiles turn off DeepSpeed's synchronising throughput timer and bf16 overflow check.
What only a GPU shows (no host sync in a compiled step, the speed) is in tests/test_gpu_cuda.py and
benchmarks/gpu_peers.py.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import BIN, REPO, free_port, read_metrics
from zerotrain.launcher.profiles import list_profiles, load_profile, one_device_stage
from zerotrain.launcher.settings import Settings, compile_at_stage
from zerotrain.modeling.model import DocumentLayout, Transformer, document_bounds, preset


@pytest.fixture(scope="module")
def compiled_and_eager(tmp_path_factory):
    """One 2-rank launch (tests/helpers/compile_harness.py): every case eager and compiled, the Muon updates, and
    the compiled engine's save and resume."""
    out = tmp_path_factory.mktemp("compile")
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "helpers" / "compile_harness.py"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.launches
def test_compiled_blocks_train_what_the_eager_blocks_train(compiled_and_eager):
    """Inductor fuses each block's norms, RoPE, SwiGLU and residual adds; fp32 rounding may move by the fused
    reductions' order only: every rank's loss within 1e-6, every gradient element within 1e-6 (measured: at most
    2.2e-8, gradients up to 5.5e-2), on 2 ranks at ZeRO-2 with activation checkpointing and the tiled MLP, at
    ZeRO-3, and at SP=2 with activation checkpointing. And the compiled engine did compile (a no-op compile would
    pass the rest)."""
    assert [(c["stage"], c["checkpointing"], c["tiled"], c["sp"]) for c in compiled_and_eager] == [
        (2, True, True, 1), (3, False, False, 1), (2, True, False, 2)]
    for case in compiled_and_eager:
        where = (case["stage"], case["sp"])
        eager, compiled = case["losses"]
        assert case["graphs"][0] == 0 and case["graphs"][1] > 0, where
        assert len(eager) == 2 and eager[0] != eager[1], where  # each rank its own rows, or (SP) its share of them
        for a, b in zip(eager, compiled, strict=True):
            assert abs(a - b) <= 1e-6, (where, a, b)
        assert len(case["grad_diff"]) > 10 and min(case["grad_max"].values()) > 0, where
        worst = max(case["grad_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (where, worst)


@pytest.mark.launches
def test_muons_update_from_compiled_gradients_is_within_its_own_rounding(compiled_and_eager):
    """Not within 1e-6: DeepSpeed's Muon update of a matrix moves by up to 4.8e-6 (updates up to 0.45) between the
    compiled and the eager gradients, which differ by 2e-8. Newton-Schulz's quintic has slope 3.4 at zero and runs
    five times: it magnifies the part of a perturbation along the small singular directions by up to ~480, and the
    gradients' last-bit differences are such a perturbation. That is the size of DeepSpeed's own rounding of the
    update (its fp32 iteration on this CPU, "gram": fp16 only where mkldnn has fp16, bf16 for "standard", against
    the same iteration in fp64: 3.7-4.0e-6). So: within 1e-5 and within twice that rounding; times Muon's lr 0.02
    the weights move apart by < 1e-7 a step."""
    for case in compiled_and_eager:
        where = (case["stage"], case["sp"])
        assert len(case["muon_diff"]) == 4 * 7 and max(case["muon_max"].values()) > 0.1, where  # q k v o gate up down
        moved = max(case["muon_diff"].items(), key=lambda kv: kv[1])
        rounding = max(case["muon_rounding"].values())
        assert 0 < rounding and moved[1] <= min(1e-5, 2 * rounding), (where, moved, rounding)


@pytest.mark.launches
def test_a_compiled_engine_resumes_bit_for_bit(compiled_and_eager):
    """The compiled engine (ZeRO-2, AdamW, 2 ranks) saved after a step and trained 2 more; a fresh compiled engine
    loading that save trains the same 2 steps to the same losses and weights, bit for bit."""
    resume = compiled_and_eager[0]["resume"]
    assert resume["compiled_again"]
    assert len(resume["continued"]) == 2 and resume["continued"] == resume["resumed"]
    assert resume["continued"][0] != resume["continued"][1]  # it trained on new rows
    assert resume["weights_equal"]


def packed_positions():
    return torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1],
                         [5, 6, 0, 1, 2, 3, 4, 5, 6, 7]])  # row 2 starts mid-document


def test_the_host_layout_is_the_models_own_and_varlen_gets_the_row_length():
    model = Transformer(preset("debug", vocab_size=300))
    pos = packed_positions()
    model.attention = "varlen"
    layout = model.document_layout(pos, "cpu")
    assert layout.backend == "varlen" and layout.max_seqlen == pos.shape[1]  # a bound on every document
    assert torch.equal(layout.cu_seqlens, document_bounds(pos))
    assert layout.cu_seqlens.tolist() == [0, 3, 8, 10, 12, 20] and layout.cu_seqlens.dtype == torch.int32
    model.attention = "sdpa"
    shared = model.document_layout(pos, "cpu")
    assert torch.equal(shared.mask, DocumentLayout.from_positions(pos, "sdpa").mask)
    one_doc = torch.arange(10).expand(2, 10)
    assert model.document_layout(one_doc, "cpu").mask is None  # one document a row: is_causal, no mask


def test_a_forward_given_the_host_layout_equals_one_that_derives_it():
    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=300))
    ids, pos = torch.randint(0, 300, (2, 10)), packed_positions()
    for kernel in ("sdpa", "flex"):
        model.attention = kernel
        own = model(ids, pos, labels=ids)
        given = model(ids, pos, labels=ids, documents=model.document_layout(pos, "cpu"))
        assert torch.equal(own, given), kernel
    # a wrong layout would be seen: the same rows read as one document each
    model.attention = "sdpa"
    assert not torch.equal(model(ids, pos, labels=ids),
                           model(ids, pos, labels=ids, documents=DocumentLayout("sdpa", mask=None)))


def test_one_device_runs_the_profiles_zero3_as_zero2_without_overlap_or_buckets():
    _, profile = load_profile("h100-80g-x8")
    ds = {k: v for k, v in profile.items() if k != "zerotrain"}
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["overlap_comm"] is True
    one, why = one_device_stage(ds, 1, "cuda")
    zero = one["zero_optimization"]
    assert (zero["stage"], zero["overlap_comm"], zero["contiguous_gradients"]) == (2, False, False)
    assert "ZeRO-2 without overlap_comm and contiguous_gradients on one device" in why and "ZeRO-3" in why
    assert {k: v for k, v in zero.items() if k not in ("stage", "overlap_comm", "contiguous_gradients")} == \
        {k: v for k, v in ds["zero_optimization"].items() if k not in ("stage", "overlap_comm", "contiguous_gradients")}
    assert one_device_stage(one, 1, "cuda") == (one, "")  # nothing left to change: nothing said
    _, zero2 = load_profile("a100-80g-x8")  # a ZeRO-2 profile gets the same one-device settings
    assert one_device_stage({k: v for k, v in zero2.items() if k != "zerotrain"}, 1, "cuda")[0][
        "zero_optimization"]["overlap_comm"] is False
    assert one_device_stage(ds, 8, "cuda") == (ds, "")  # several devices: the profile's
    assert one_device_stage(ds, 1, "cpu") == (ds, "")  # the CPU profiles' stages are what the suite runs
    started, why = one_device_stage(ds, 8, "cuda", start_stage=2)  # a run started on one device, resumed on 8
    assert started["zero_optimization"]["stage"] == 2 and "cannot move between ZeRO-2 and ZeRO-3" in why
    assert started["zero_optimization"]["overlap_comm"] is True  # on 8 devices the profile's overlap stands
    offloaded = {**ds, "zero_optimization": {**ds["zero_optimization"], "offload_param": {"device": "cpu"}}}
    assert one_device_stage(offloaded, 1, "cuda") == (offloaded, "")  # offloaded parameters need ZeRO-3


def test_a_profiles_compile_skips_zero3_but_a_given_one_does_not():
    def settings(source):
        return Settings({"compile": True}, {"compile": source})

    zero3, zero2 = {"zero_optimization": {"stage": 3}}, {"zero_optimization": {"stage": 2}}
    off = compile_at_stage(settings("profile h100-80g-x8: zerotrain.compile"), zero3)
    assert off.compile is False and off.sources["compile"].startswith("rule: not at ZeRO-3")
    assert compile_at_stage(settings("profile h100-80g-x8: zerotrain.compile"), zero2).compile is True
    assert compile_at_stage(settings("flag"), zero3).compile is True


@pytest.mark.parametrize("name", [n for n in list_profiles() if load_profile(n)[1]["zerotrain"].get("hardware", {})
                                  .get("accelerator") == "cuda"])
def test_cuda_profiles_compile_and_leave_deepspeeds_syncing_checks_off(name):
    """DeepSpeed's throughput timer synchronises the device at every forward and step when enabled (its default),
    and bf16's check_grad_overflow reads every gradient's amax/amin back each step; our own guards read the loss and
    the gradient norm from the step's one collective instead (participants/finite.py)."""
    _, profile = load_profile(name)
    assert profile["zerotrain"]["compile"] is True
    assert profile["timers"] == {"throughput": {"enabled": False}}
    assert profile["bf16"] == {"enabled": True, "check_grad_overflow": False}


@pytest.mark.launches
def test_a_run_with_a_profiles_compile_says_its_compile_time_and_writes_its_torch_profile(tmp_path, mix_path):
    """The cpu profile at ZeRO-2 with zerotrain.compile set, with inductor (the backend every CUDA profile uses; its
    C++ code generation costs this test ~30-55 s on 2 cores over aot_eager, and it is the suite's one launched run
    that generates code): the run compiles because the profile says so (its source recorded), says how long its
    first step took, trains, and --torch-profile 2:2 writes rank 0's summary and trace."""
    profile = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    profile["zero_optimization"]["stage"] = 2
    profile["zerotrain"].update(compile=True, compile_backend="inductor")
    path = tmp_path / "cpu-compiled.json"
    path.write_text(json.dumps(profile))
    from conftest import launch

    run = launch("python", ["--profile", str(path), "--data", str(mix_path), "--out", str(tmp_path), "--run-id", "r",
                            "--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "1",
                            "--max-steps", "4", "--warmup-steps", "1", "--torch-profile", "2:2"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "compiled with torch.compile" in run.stdout
    assert "torch.compile: the first step took" in run.stdout
    losses = [m["loss"] for m in read_metrics(tmp_path / "r")]
    assert len(losses) == 4 and all(x == x for x in losses) and losses[-1] < losses[0]  # the compiled blocks train
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["run_sources"]["compile"].endswith("zerotrain.compile"), config["run_sources"]["compile"]
    summary = (tmp_path / "r" / "torch_profile" / "summary.txt").read_text()
    assert summary.startswith("steps 2-3\n") and "by self CPU time over 2 step(s)" in summary
    assert "host syncs over 2 step(s):" in summary
    assert "aten::" in summary  # the step's operators were seen
    assert json.loads((tmp_path / "r" / "torch_profile" / "trace.json").read_text())["traceEvents"]


def test_the_planner_counts_what_compiled_blocks_keep_and_covers_the_measured_gpu_peak():
    """Compiled blocks keep each norm's input and rsqrt instead of its fp32 copies, three of the SwiGLU's four
    ffn-wide tensors, and the QK-norm's input instead of its fp32 copies (planner.activation_bytes). Against the one
    GPU measurement (benchmarks/RESULTS.md, 2026-11-27, one H200: xlarge, 320-entry vocabulary, micro-batch 8 x 2048,
    ZeRO-2, compiled: 49.3 GiB allocated with the one-device settings, 51.2 GiB with the profile's overlap and
    buckets), the plan's tensors must never be under the measured peak, and within 10% of it; the eager terms
    planned 74.4 GiB for the same run."""
    from zerotrain.launcher.planning import GiB, activation_bytes, memory, setup_from
    from zerotrain.modeling.sizes import preset

    args = preset("xlarge", vocab_size=320)
    a, d, f, h = 2, args.dim, args.ffn_hidden, args.head_dim
    eager = activation_bytes(args, 8, 2048, a, False, "varlen", "cuda")
    compiled = activation_bytes(args, 8, 2048, a, False, "varlen", "cuda", compiled=True)
    assert eager.block_per_token - compiled.block_per_token == (2 * 8 * d - 8) + a * f
    qk = preset("xlarge", vocab_size=320, qk_norm=True)
    saved_qk = (activation_bytes(qk, 8, 2048, a, False, "varlen", "cuda").block_per_token
                - activation_bytes(qk, 8, 2048, a, False, "varlen", "cuda", compiled=True).block_per_token)
    assert saved_qk == (2 * 8 * d - 8) + a * f + (8 - a) * h * (qk.n_heads + qk.n_kv_heads)
    _, profile = load_profile("h100-80g-x8")
    ds, _ = one_device_stage({k: v for k, v in profile.items() if k != "zerotrain"}, 1, "cuda")
    knobs = {**profile["zerotrain"], "compile": True}
    tensors = {}
    for compile_ in (True, False):
        setup = setup_from(ds, {**knobs, "compile": compile_}, 1, 1, None, None, args)
        m = memory(args, setup, 2, 8, 2048, False)
        tensors[compile_] = (m.model_states + m.buffers + m.activations) / GiB
    measured = (49.3, 51.2)
    assert max(measured) <= tensors[True] <= 1.1 * min(measured), tensors
    assert tensors[False] > 1.4 * min(measured)  # the eager terms would leave a third of the GPU unused


def test_the_blocks_share_one_additive_mask_that_sdpa_reads_as_the_boolean_one(monkeypatch):
    """sdpa turns a boolean mask into 0/-inf in every call, forward and backward, and keeps a copy per layer; the
    model makes that additive mask once per forward (model.additive_mask) and every block gets the same tensor.
    The attention, the loss and every gradient are bit for bit what the boolean mask gives."""
    import zerotrain.modeling.model as model_module
    from zerotrain.modeling.model import additive_mask, document_mask, sdpa_kernel

    torch.manual_seed(0)
    pos = packed_positions()
    mask = document_mask(pos)
    q, k, v = (torch.randn(2, 10, heads, 8, requires_grad=True) for heads in (4, 2, 2))
    docs = DocumentLayout("sdpa", mask=mask)
    by_bool = sdpa_kernel(q, k, v, docs)
    grads_bool = torch.autograd.grad(by_bool.square().sum(), (q, k, v))
    by_additive = sdpa_kernel(q, k, v, docs._replace(mask=additive_mask(mask, q.dtype)))
    assert torch.equal(by_bool, by_additive)
    for a, b in zip(grads_bool, torch.autograd.grad(by_additive.square().sum(), (q, k, v))):
        assert torch.equal(a, b)
    seen = []
    kernel = model_module.ATTENTION_KERNELS["sdpa"]
    monkeypatch.setitem(model_module.ATTENTION_KERNELS, "sdpa", lambda q, k, v, d: seen.append(d.mask) or kernel(q, k, v, d))
    model = Transformer(preset("debug", vocab_size=300))
    model.attention = "sdpa"
    model(torch.randint(0, 300, (2, 10)), pos, labels=torch.randint(0, 300, (2, 10)))
    assert len(seen) == model.args.n_layers and all(m is seen[0] for m in seen)
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0] == 0, mask)
