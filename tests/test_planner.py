"""The planner (launcher/planning): counts from the model itself, DeepSpeed's own memory formulas,
the activation formula against what autograd really keeps, the plan's arithmetic, the fit check,
and bad input. No process group; the one subprocess is the CLI's exit status."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerotrain.launcher import planning as planner
from zerotrain.launcher.commands.plan import plan_main
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.planning import hardware
from zerotrain.launcher.profiles import list_profiles, load_profile
from zerotrain.modeling.model import ModelArgs, SequenceShard, Transformer, count_params, preset

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "debug (GQA)": preset("debug"),
    "tied": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=100, tie_embeddings=True),
    "qk-norm MQA": ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=1, qk_norm=True, ffn_hidden=200),
}


def plan_json(capsys, *argv) -> dict:
    plan_main(["--json", *argv])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", CONFIGS)
def test_counts_are_the_built_models(name):
    """params_total and the largest layer equal DeepSpeed's own count of the built module."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    args = CONFIGS[name]
    model = Transformer(args)
    total, largest = model_to_params(model)  # shared (tied) parameters counted once, as DeepSpeed does
    assert count_params(args)["total"] == total == sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    embeddings = model.embed_tokens.weight.numel() * (1 if args.tie_embeddings else 2)
    assert count_params(args)["non_embedding"] == total - embeddings
    assert planner.largest_layer(args) == largest


@pytest.mark.parametrize("P,L,gpus,nodes", [(10**6, 10**5, 1, 1), (1_416_931_200, 24_576_000, 8, 1),
                                            (12_902_731_776, 44_826_624, 8, 2), (869_504, 81_920, 2, 1)])
def test_model_states_are_deepspeeds_formulas(P, L, gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2

    ours = planner.deepspeed_model_states
    assert ours(2, P, L, gpus, nodes) == pytest.approx(z2(P, gpus, nodes, cpu_offload=False)[::-1], rel=1e-12)
    assert ours(3, P, L, gpus, nodes) == pytest.approx(z3(P, L, gpus, nodes, cpu_offload=False)[1::-1], rel=1e-12)
    assert ours("zero2_offload", P, L, gpus, nodes) == pytest.approx(z2(P, gpus, nodes, cpu_offload=True)[::-1])
    assert ours("zero3_offload", P, L, gpus, nodes) == pytest.approx(z3(P, L, gpus, nodes)[1::-1])
    # ZeRO-0 is ZeRO-2 on one GPU (nothing partitioned): DeepSpeed's 2P + 18P
    assert ours(0, P, L, gpus, nodes)[0] == z2(P, 1, 1, cpu_offload=False)[1]


def saved_activation_bytes(model, ids, position_ids=None) -> int:
    """Bytes of the distinct tensors autograd keeps for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, position_ids, labels=ids)
    return sum(seen.values())


def masks_alive_not_saved(B, T, dtype, checkpointing) -> int:
    """sdpa's document masks that live through forward and backward without being a saved tensor: the boolean
    mask (the caller's layout), and under checkpointing its float form (modeling/model.py `additive_mask`, made
    once per forward: a checkpoint input; without checkpointing every layer's sdpa saves that one tensor)."""
    return B * T * T * (1 + (dtype.itemsize if checkpointing else 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("sp", [1, 2])
def test_activation_formula_is_what_autograd_keeps(dtype, name, checkpointing, attention, sp):
    """The docstring's formula against the tensors our block really saves, on packed rows (documents
    sharing rows, as the driver's loader makes them), with the chunked loss. flex keeps what a fused
    kernel keeps (q, k, v, output, log-sum-exp): the formula varlen also gets, which needs a GPU.
    sp=2: one rank's share under sequence parallelism, its tensors shaped as on 2 ranks (a stand-in
    exchange that keeps each tensor where it is: the same shapes, one process; the MQA model's one kv head is
    repeated to 2)."""
    args = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).train()
    model.activation_checkpointing = checkpointing
    model.attention = attention
    if sp > 1:
        model.sequence_parallel = SequenceShard(sp, 0, lambda t: t)
    B, T = 2, 96
    pos = torch.cat([torch.arange(40), torch.arange(56)]).expand(B, T)
    measured = saved_activation_bytes(model, torch.randint(0, args.vocab_size, (B, T)), pos)
    if attention == "sdpa":
        measured += masks_alive_not_saved(B, T, dtype, checkpointing)
    predicted = planner.activation_bytes(args, B, T, dtype.itemsize, checkpointing, attention,
                                         sequence_parallel=sp).saved
    assert predicted == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp", [1, 2])
def test_the_tiled_mlp_formula_is_what_autograd_keeps(dtype, sp):
    """--tiled-mlp: DeepSpeed's TiledMLP (ds_compat.tiled_mlp, as the engine builder sets it) keeps only the
    MLP's input, so the planner drops the SwiGLU's 4·a·ffn_hidden per position and layer from what is saved;
    against the tensors our block really saves, and the drop is the whole SwiGLU term."""
    from zerotrain.launcher.components import ds_compat

    args = CONFIGS["debug (GQA)"]
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).train()
    model.attention = "flex"
    for layer in model.layers:
        layer.mlp.tiled = ds_compat.tiled_mlp
    if sp > 1:
        model.sequence_parallel = SequenceShard(sp, 0, lambda t: t)
    B, T = 2, 96
    pos = torch.cat([torch.arange(40), torch.arange(56)]).expand(B, T)
    measured = saved_activation_bytes(model, torch.randint(0, args.vocab_size, (B, T)), pos)
    tiled, untiled = (planner.activation_bytes(args, B, T, dtype.itemsize, False, "flex", sequence_parallel=sp,
                                               tiled_mlp=t) for t in (True, False))
    assert tiled.saved == pytest.approx(measured, rel=0.02)
    tokens = B * T // sp
    assert untiled.saved - tiled.saved == args.n_layers * tokens * 4 * dtype.itemsize * args.ffn_hidden
    assert tiled.transient > 0 and tiled.peak < untiled.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["debug (GQA)", "qk-norm MQA"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_math_kernel_formula_is_what_autograd_keeps(dtype, name, checkpointing):
    """sdpa with packed documents and GQA on CUDA is PyTorch's math kernel (sizes.math_kernel), which the planner
    counts as q, k, v in fp32 with the kv heads repeated and each layer's (B, H, T, T) fp32 softmax. The same
    aten function runs on a CPU when it is the only backend allowed: what our block saves under it, against the
    formula for "cuda" (the device only selects the formula; without GQA sdpa is a fused kernel there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).train()
    model.activation_checkpointing = checkpointing
    model.attention = "sdpa"
    B, T = 2, 96
    pos = torch.cat([torch.arange(40), torch.arange(56)]).expand(B, T)
    with sdpa_kernel(SDPBackend.MATH):
        measured = saved_activation_bytes(model, torch.randint(0, args.vocab_size, (B, T)), pos)
    measured += masks_alive_not_saved(B, T, dtype, checkpointing)
    math = planner.activation_bytes(args, B, T, dtype.itemsize, checkpointing, "sdpa", "cuda")
    fused = planner.activation_bytes(args, B, T, dtype.itemsize, checkpointing, "sdpa", "cpu")
    assert math.saved == pytest.approx(measured, rel=0.002)
    if not checkpointing:  # every layer's softmax is kept until its backward
        assert math.saved - fused.saved >= args.n_layers * B * args.n_heads * T * T * 4
    assert math.transient > fused.transient  # its backward's extra (B, H, T, T)


def test_flex_block_mask_bytes_are_the_block_masks_tensors():
    """The BlockMask the model builds for flex (one per micro-batch, alive through forward and backward)."""
    from zerotrain.modeling.model import document_block_mask

    for B, T in ((2, 300), (3, 1024)):
        pos = (torch.arange(T) % 100).expand(B, T)
        mask = document_block_mask(pos)
        held = [t for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                            mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
                if t is not None]
        assert planner.flex_block_mask_bytes(B, T) == sum(t.numel() * t.element_size() for t in held)
    args = CONFIGS["debug (GQA)"]
    flex = planner.activation_bytes(args, 2, 1024, 2, False, "flex", "cuda")
    varlen = planner.activation_bytes(args, 2, 1024, 2, False, "varlen", "cuda")
    assert flex.saved - varlen.saved == planner.flex_block_mask_bytes(2, 1024)
    assert flex.transient - varlen.transient == 2 * 1024 * 4 * args.n_heads  # the backward's fp32 delta


def test_optimizer_state_bytes_are_the_registrys_and_an_unknown_one_is_refused(tmp_path, monkeypatch):
    """The planner's optimizer state per parameter is the registry's (launcher/optimizers.py state_per_param):
    AdamW 8, Lion 4, AdEMAMix 12, Muon 4 on the blocks' matrices and 8 elsewhere; a user class that does not declare
    `state_bytes_per_param` is refused in one line, not planned as Adam's 8."""
    args = preset("small", vocab_size=258)
    counts = count_params(args)
    matrices = counts["non_embedding"] - (args.n_layers * 2 * args.dim + args.dim)
    expected = {None: 8, "adamw": 8, "adamw-decaying-wd": 8, "lion": 4, "ademamix": 12,
                "muon": (4 * matrices + 8 * (counts["total"] - matrices)) / counts["total"]}
    for name, state in expected.items():
        assert planner.optimizer_state_bytes(name, args) == state, name
    (tmp_path / "lab_opt.py").write_text(
        "import torch\n\nclass Plain(torch.optim.SGD):\n    pass\n\n"
        "class Declared(torch.optim.SGD):\n    state_bytes_per_param = 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert planner.optimizer_state_bytes("lab_opt:Declared", args) == 4
    with pytest.raises(UsageError, match=r"^--optimizer lab_opt:Plain: the planner needs its optimizer state per"
                                         r" parameter; give the class a `state_bytes_per_param` attribute"):
        planner.optimizer_state_bytes("lab_opt:Plain", args)
    with pytest.raises(UsageError, match="lab_opt:Plain: the planner needs"):  # the fit check refuses it too
        planner.fit_check(*fit_check_args(cfg(seq_len=256, optimizer="lab_opt:Plain", lr=0.1)))


def test_max_micro_batch_is_the_largest_that_fits():
    args = preset("ws-1.3b", vocab_size=128256)
    _, prof = load_profile("rtx6000ada-48g-x2")
    setup = planner.setup_from(prof, prof["zerotrain"])
    for stage in (2, 3):
        mb = planner.max_micro_batch(args, setup, stage, 2048, True)
        assert mb >= 1
        assert planner.memory(args, setup, stage, mb, 2048, True).total <= setup.device_bytes
        assert planner.memory(args, setup, stage, mb + 1, 2048, True).total > setup.device_bytes


def test_plan_json_arithmetic(capsys):
    p = plan_json(capsys, "--profile", "a100-80g-x8", "--model", "xlarge", "--seq-len", "2048", "--micro-batch", "16",
                  "--grad-accum", "2", "--budget-usd", "5000", "--gpu-hour-usd", "2", "--total-tokens", "10000000000")
    for key in ("params_total", "params_non_embedding", "flops_per_token", "memory", "fits", "max_micro_batch",
                "grad_accum", "tokens_per_step", "steps", "hours", "tokens", "tokens_per_param", "usd",
                "compute_optimal", "verdict", "would_fit"):
        assert key in p, key
    assert set(p["memory"]) == {"zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"}
    args = preset("xlarge")
    assert p["params_total"] == count_params(args)["total"]
    assert p["tokens_per_step"] == 16 * 2 * 8 * 2048 and p["grad_accum"] == 2
    assert p["tokens"] == p["steps"] * p["tokens_per_step"]
    # $5000 at $2 x 8 GPUs = 312.5 h: far more than 10B tokens need, so --total-tokens binds; without --max-steps
    # it sets the run's length, its last step whole (rounded up, as the run does)
    assert p["binding"] == "total_tokens" and p["tokens"] - p["tokens_per_step"] < 10**10 <= p["tokens"]
    assert p["tokens_per_s"] == pytest.approx(0.45 * 312e12 * 8 / p["flops_per_token"], rel=1e-6)
    assert p["hours"] == pytest.approx(p["tokens"] / p["tokens_per_s"] / 3600, abs=0.01)
    assert p["usd"] == pytest.approx(p["hours"] * 8 * 2, abs=0.2)
    assert p["tokens_per_param"] == pytest.approx(p["tokens"] / p["params_total"], abs=1e-3)
    co = p["compute_optimal"]
    assert co["flops"] == 6 * p["params_total"] * p["tokens"]
    assert co["tokens"] == pytest.approx(20 * co["params"], rel=1e-6)
    assert 6 * co["params"] * co["tokens"] == pytest.approx(co["flops"], rel=1e-6)
    assert p["memory"]["zero2"]["model_states_gib"] == pytest.approx(
        (2 * p["params_total"] + 18 * p["params_total"] / 8) / 2**30, abs=0.01)


def test_depth64_on_eight_h100_pcie(capsys):
    """The user's depth-64 / aspect-64, vocab-32 model: 12.9B parameters (not 4.3B); plain data
    parallelism cannot hold it; ZeRO-3 with activation checkpointing can; the budget binds."""
    p = plan_json(capsys, "--profile", "h100-pcie-80g-x8", "--depth", "64", "--vocab-size", "32", "--seq-len", "2048",
                  "--micro-batch", "4", "--grad-accum", "1", "--zero", "0", "--max-hours", "31",
                  "--budget-usd", "1000", "--gpu-hour-usd", "4.03")
    assert p["model"]["dim"] == 4096 and p["model"]["vocab_size"] == 64
    assert 12.8e9 < p["params_total"] < 13.0e9
    assert not p["fits"] and p["memory"]["zero0"]["model_states_gib"] > 200
    assert any(a["change"] == "ZeRO-3 + activation checkpointing" for a in p["would_fit"])
    assert p["verdict"].startswith("does not fit") and "short by" in p["verdict"]
    assert p["tokens_per_param"] < 1 and p["compute_optimal"]["params"] < 2e9
    assert p["usd"] <= 1000 and p["hours"] <= 31


@pytest.mark.launches
def test_bad_input_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "zerotrain", "plan", "--gpus", "0"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == "zerotrain: error: --gpus: must be a positive integer, got 0"
    assert "Traceback" not in r.stderr


@pytest.mark.launches
def test_a_recipe_plans_offline_before_its_hub_data_is_downloaded(tmp_path):
    """`zerotrain plan --config RECIPE` where the recipe's hub datasets are in no cache and the hub is
    offline (an empty HF_HOME, as on a machine that has not downloaded them yet): the plan is printed, exit
    0, and what needs the data is said to be unknown in one line naming the source that is missing."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_DATASETS_OFFLINE", "HF_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_DATASETS_CACHE=str(tmp_path / "ds"),
               OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "zerotrain", "plan", "--config", "recipes/a100x8-1.46b-edu-mix.json"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "\nfits: " in r.stdout and "time: " in r.stdout and "| 2 + AC (chosen) |" in r.stdout
    unknown = [ln for ln in r.stdout.splitlines() if "unknown without the data" in ln]
    assert len(unknown) == 1 and unknown[0].startswith("epochs and repetition: unknown without the data (source"
                                                       " 'fineweb-edu': hub dataset 'HuggingFaceFW/fineweb-edu'")
    assert "warning:" not in r.stdout and not list(tmp_path.rglob("datasets--*"))  # nothing downloaded
    r = subprocess.run([*argv, "--json"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    plan = json.loads(r.stdout)
    assert r.returncode == 0 and plan["fits"] and plan["warnings"] == []
    assert "nothing cached and offline mode is on" in plan["data_unknown"]


def test_a_mix_whose_files_are_not_written_yet_plans_the_rest(tmp_path, capsys):
    """A local mix naming a file not written yet: the same plan as without --data, plus the one line."""
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "web", "weight": 1, "path": "web.jsonl"}]}))
    argv = ["--profile", "a100-80g-x8", "--model", "small", "--json"]
    without = plan_main(argv)
    capsys.readouterr()
    planned = plan_main([*argv, "--data", str(mix)])
    assert planned["data_unknown"] == f"mix {mix}: source 'web': data file {tmp_path / 'web.jsonl'} does not exist"
    assert without["data_unknown"] == "no --data given"
    assert {k: v for k, v in planned.items() if k != "data_unknown"} == \
        {k: v for k, v in without.items() if k != "data_unknown"}
    plan_main([*argv[:-1], "--data", str(mix)])
    assert capsys.readouterr().out.count("epochs and repetition: unknown without the data (mix ") == 1


@pytest.mark.parametrize("argv,message", [
    (["--mfu", "1.5"], "--mfu: must be a fraction in"),
    (["--zero", "4"], "--zero: must be 0, 1, 2 or 3"),
    (["--gpu-mem", "-1"], "--gpu-mem: must be a positive number"),
    (["--gpus", "2"], "--gpu-mem GiB"),  # no profile: nothing says how much memory a GPU has
    (["--budget-usd", "100"], "--budget-usd 100.0: needs --gpu-hour-usd"),
    (["--seq-len", "0"], "--seq-len: must be a positive integer"),
])
def test_bad_plan_flags(argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        plan_main(argv)


def test_unfittable_plan_says_by_how_much_and_what_would(capsys):
    """The user's 1.4B `xlarge` at micro-batch 32 x 2048 on 8 A100 80GB without activation checkpointing (compiled
    blocks, as the profile says: micro-batch 16 fits since the planner counts what compiling frees)."""
    p = plan_json(capsys, "--profile", "a100-80g-x8", "--model", "xlarge", "--seq-len", "2048", "--micro-batch", "32")
    assert not p["fits"] and p["zero_stage"] == 2
    short = round(p["memory_per_gpu_gib"] - p["hardware"]["device_memory_gib"], 2)
    assert f"short by {short} GiB" in p["verdict"]
    changes = {a["change"]: a["memory_per_gpu_gib"] for a in p["would_fit"]}
    assert "activation checkpointing" in changes and f"micro-batch {p['max_micro_batch']}" in changes
    assert all(v <= p["hardware"]["device_memory_gib"] for v in changes.values())
    assert 1 <= p["max_micro_batch"] < 32


def test_gpus_without_a_profile_is_plain_data_parallelism(capsys):
    p = plan_json(capsys, "--gpus", "2", "--gpu-mem", "48", "--model", "ws-1.3b", "--vocab-size", "128256",
                  "--seq-len", "2048", "--micro-batch", "16", "--peak-tflops", "364.2")
    assert p["profile"] == "generic GPU" and p["zero_stage"] == 0 and p["hardware"]["world"] == 2
    assert p["params_total"] == 1_300_071_936 and not p["fits"]
    # the 128k-vocabulary loss in chunks, where its full logits, fp32 copy and log-softmax (10 bytes x V per token)
    # took 42 GB: the peak's transient is one block's gradients in backward, no longer the loss, and what is kept
    # beyond the blocks (the head's weight gradient, the final norm, rotary tables) is under 1 GiB
    act = planner.activation_bytes(preset("ws-1.3b", vocab_size=128256), 16, 2048, 2, False, "varlen")
    assert p["memory"]["zero3"]["activations_gib"] == pytest.approx(act.peak / 2**30, abs=0.01)
    blocks = 16 * 2048 * 32 * act.block_per_token
    assert act.transient == 16 * 2048 * act.block_per_token and act.saved - blocks < 2**30
    assert p["attention"] == "varlen"  # a GPU in bf16
    assert p["hours"] is not None and p["mfu"] == 0.4


def cfg(**kw) -> RunConfig:
    return RunConfig.from_flat({"data": "unused", **kw})


def fit_check_args(cfg_: RunConfig, world: int = 2):
    from zerotrain.launcher import model_spec
    from zerotrain.launcher.profiles import resolve_ds_config

    _, prof = load_profile(cfg_.parallel.profile)
    ds = resolve_ds_config(prof, cfg_, world, "cpu")
    args, _, _ = model_spec.resolve(cfg_, 258)
    return cfg_, args, ds, prof["zerotrain"], world


def test_fit_check_refuses_what_cannot_fit_fast(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    t0 = time.time()
    refused = r"^does not fit: needs [\d.]+ [GTPE]iB per rank .*short by .*seq-len \d+ .*--no-fit-check"
    with pytest.raises(UsageError, match=refused):
        planner.fit_check(*fit_check_args(cfg(seq_len=99999999)))
    # arithmetic on the sizes, milliseconds; building or running the model at that length would take minutes (or
    # run out of memory): 20 s tells the two apart on any host, loaded or not
    assert time.time() - t0 < 20
    m = planner.fit_check(*fit_check_args(cfg(seq_len=256)))  # the demo's config fits, with room to spare
    assert m.total < 2 * 2**30


def test_fit_check_uses_ram_divided_among_local_ranks(monkeypatch):
    monkeypatch.setattr(hardware, "available_ram", lambda: 8 * 2**30)
    config = fit_check_args(cfg(model="small", seq_len=512, micro_batch=2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    need = planner.fit_check(*config).total
    assert 4 * 2**30 < need < 8 * 2**30  # fits in 8 GiB for one rank ...
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"8.0 GiB RAM available / 2 local rank"):  # ... not in 4 GiB each
        planner.fit_check(*config)


@pytest.mark.launches
def test_driver_refuses_before_writing_anything(tmp_path):
    """`--seq-len 99999999` on the cpu profile used to train 94 s then die: now one line, exit 2, fast."""
    mix = tmp_path / "mix.json"
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n')
    mix.write_text(json.dumps({"sources": [{"name": "a", "path": "a.jsonl", "weight": 1.0}]}))
    r = subprocess.run([sys.executable, "launcher/train.py", "--data", str(mix), "--seq-len", "99999999",
                        "--out", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("zerotrain: error: does not fit:")
    assert not (tmp_path / "runs").exists()  # refused before training: a run that trained would have written it


PEAKS = {"a100-80g-x8": 312e12, "h100-80g-x8": 989e12, "h100-80g-2x8-multinode": 989e12,
         "h100-pcie-80g-x8": 756e12, "rtx6000ada-48g-x2": 364.2e12}


@pytest.mark.parametrize("name", list_profiles())
def test_profiles_carry_peak_mfu_and_memory(name):
    zt = load_profile(name)[1]["zerotrain"]
    assert zt["peak_flops_per_device"] > 0
    if name in PEAKS:  # the cards' dense bf16 peaks (vendor datasheets, sparsity not counted)
        assert zt["peak_flops_per_device"] == PEAKS[name]
        assert zt["hardware"]["device_memory_gib"] > zt["hardware"]["min_memory_gib"]
    assert 0 < zt["mfu_threshold"] < zt["expected_mfu"] <= 1
    assert math.isclose(zt["mfu_threshold"], 0.75 * zt["expected_mfu"], rel_tol=1e-3)


def test_bad_mfu_in_a_profile_is_refused(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"zerotrain": {"expected_mfu": 1.5}}))
    with pytest.raises(UsageError, match="expected_mfu must be a number in"):
        load_profile(str(p))


def test_the_cuda_context_is_the_profiles_and_hpz_keeps_a_secondary_weight_partition():
    """NVSwitch H100 profiles add NCCL's NVLS buffers to the context (hardware.context_gib); ZeRO++ hpZ's
    secondary 16-bit partition (P / hpz elements per rank, DeepSpeed's _partition_param_sec) is counted."""
    args = preset("xlarge", vocab_size=32000, max_seq_len=2048)
    P = count_params(args)["total"]
    contexts = {}
    for name in ("h100-80g-x8", "h100-pcie-80g-x8", "h100-80g-2x8-multinode"):
        prof = load_profile(name)[1]
        setup = planner.setup_from(prof, prof["zerotrain"])
        contexts[name] = planner.memory(args, setup, 3, 1, 2048, False).context / planner.GiB
    assert contexts == {"h100-80g-x8": 1.3, "h100-pcie-80g-x8": 1.0, "h100-80g-2x8-multinode": 1.3}
    prof = load_profile("h100-80g-2x8-multinode")[1]
    assert prof["zero_optimization"]["zero_hpz_partition_size"] == 8
    with_hpz = planner.setup_from(prof, prof["zerotrain"])
    without = planner.setup_from({**prof, "zero_optimization": {**prof["zero_optimization"],
                                                                 "zero_hpz_partition_size": 1}}, prof["zerotrain"])
    extra = planner.memory(args, with_hpz, 3, 1, 2048, False).buffers - \
        planner.memory(args, without, 3, 1, 2048, False).buffers
    assert extra == pytest.approx(2 * P / 8)


@pytest.mark.parametrize("value", [0, -1, "1", True, 100])
def test_a_bad_context_size_in_a_profile_is_refused(value, tmp_path):
    prof = load_profile("h100-80g-x8")[1]
    prof["zerotrain"]["hardware"]["context_gib"] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(UsageError, match=r"zerotrain.hardware.context_gib \(the CUDA context, cuBLAS and NCCL"
                                         r" buffers per GPU process\) must be in \(0, 64\) GiB"):
        load_profile(str(path))


def test_the_loss_chunk_on_a_gpu_uses_the_memory_backward_needs_anyway():
    """A GPU's chunked loss takes as many tokens as fit in the memory one block's backward already needs (no
    higher peak); a CPU keeps ~261 tokens at the Llama-3 vocabulary; the run's plan hands
    the chunk to the engine's model on a GPU, None (the model's own) on a CPU."""
    args = preset("ws-1.3b", vocab_size=128256)
    cpu = planner.activation_bytes(args, 16, 2048, 2, False, "varlen", "cpu")
    gpu = planner.activation_bytes(args, 16, 2048, 2, False, "varlen", "cuda")
    assert cpu.loss_chunk == 261 and gpu.loss_chunk > 3 * cpu.loss_chunk  # 1,693 tokens: 6x fewer chunks
    assert gpu.peak == cpu.peak and gpu.transient == 16 * 2048 * gpu.block_per_token
    small = planner.activation_bytes(args, 1, 256, 2, False, "varlen", "cuda")  # no room: the CPU's size
    assert small.loss_chunk == 256  # capped by the micro-batch's tokens
    profile = load_profile("rtx6000ada-48g-x2")[1]
    ds = {**profile, "train_micro_batch_size_per_gpu": 16}
    assert planner.run_loss_chunk(args, ds, 2048, False, "varlen", "cuda") == gpu.loss_chunk
    assert planner.run_loss_chunk(args, ds, 2048, False, "varlen", "cpu") is None


def test_sequence_parallelism_divides_the_activations_the_fit_check_counts():
    """The run's resolved --sequence-parallel reaches the planner's setup: at 32k tokens with flex (no T x T mask)
    each of 8 ranks holds about an eighth of the activations; model states are unchanged (ZeRO partitions over
    every rank either way)."""
    args = preset("xlarge")
    _, prof = load_profile("h100-80g-x8")
    knobs = {**prof["zerotrain"], "attention": "flex"}
    one, eight = (planner.setup_from(prof, {**knobs, "sequence_parallel": n}) for n in (1, 8))
    assert (one.sequence_parallel, eight.sequence_parallel) == (1, 8)
    m1, m8 = (planner.memory(args, s, 3, 1, 32768, True) for s in (one, eight))
    assert m8.model_states == m1.model_states
    assert m1.activations / 9 < m8.activations < m1.activations / 6


# -- sequence parallelism: the all-to-all, the longest row, `zerotrain plan --sequence-parallel` --------------

class RecordingExchange(torch.autograd.Function):
    """A stand-in for the all-to-all that keeps each tensor where it is (one process, the shapes of N ranks)
    and records the bytes handed to it, in forward and in backward (the gradient's exchange)."""
    sizes: list = []

    @staticmethod
    def forward(ctx, x):
        RecordingExchange.sizes.append(x.numel() * x.element_size())
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        RecordingExchange.sizes.append(grad.numel() * grad.element_size())
        return grad


@pytest.mark.parametrize("name,sp,checkpointing,dtype", [
    ("debug (GQA)", 2, False, torch.float32), ("debug (GQA)", 2, True, torch.bfloat16),
    ("debug (GQA)", 4, True, torch.float32), ("qk-norm MQA", 3, False, torch.bfloat16),
    ("qk-norm MQA", 3, True, torch.float32)])
def test_all_to_all_volume_is_what_our_exchange_moves(name, sp, checkpointing, dtype, monkeypatch):
    """The planner's bytes per rank per layer against the tensors our SequenceShard hands its exchange in one
    forward and backward of one rank's share (kv heads 2 at N = 2, repeated to 4 at N = 4, 1 to 3 at N = 3;
    the recomputation under activation checkpointing exchanges again); a rank sends (N-1)/N of each."""
    args = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).train()
    model.activation_checkpointing = checkpointing
    model.attention = "sdpa"
    monkeypatch.setattr(RecordingExchange, "sizes", [])
    model.sequence_parallel = SequenceShard(sp, 0, RecordingExchange.apply)
    B, T = 2, 96
    pos = torch.cat([torch.arange(40), torch.arange(56)]).expand(B, T)
    ids = torch.randint(0, args.vocab_size, (B, T))
    model(ids, pos, labels=ids).backward()
    handed = sum(RecordingExchange.sizes)
    assert len(RecordingExchange.sizes) == args.n_layers * (12 if checkpointing else 8)
    predicted = planner.all_to_all_bytes(args, B, T, dtype.itemsize, sp, checkpointing)
    assert predicted.per_layer * args.n_layers == pytest.approx(handed * (sp - 1) / sp, rel=1e-12)
    assert planner.all_to_all_bytes(args, B, T, dtype.itemsize, 1, checkpointing).per_layer == 0


def test_plan_131072_on_eight_h100_with_sequence_parallel_8(capsys):
    """`zerotrain plan --seq-len 131072 --sequence-parallel 8` (medium: 16 heads; sdpa): activations of the
    whole T x T mask (boolean, and its bf16 form, once per micro-batch) do not fit by a little; the plan says what
    would (activation checkpointing, or flex with no mask at all, with far more room), the all-to-all
    per layer and per step over NVLink (the profile's 450 GB/s) is in the time, and the longest row that fits."""
    argv = ["--profile", "h100-80g-x8", "--model", "medium", "--vocab-size", "128256", "--seq-len", "131072",
            "--sequence-parallel", "8", "--attention", "sdpa", "--micro-batch", "1", "--grad-accum", "4"]
    p = plan_json(capsys, *argv)
    sp, a = p["sequence_parallel"], p["sequence_parallel"]["all_to_all"]
    args = preset("medium", vocab_size=128256)
    assert sp["size"] == 8 and sp["valid_sizes"] == [1, 2, 4, 8]
    assert p["tokens_per_step"] == 1 * 4 * 1 * 131072  # 8 ranks share each row: one row group
    sent = 131072 // 8 * (2 * 16 + 2 * 16) * 64 * 2 * 7 / 8  # q, k, v, output at 16 heads, bf16, 7/8 sent
    assert a["gb_per_layer_forward"] == round(sent / 1e9, 4) and a["gb_per_layer"] == round(2 * sent / 1e9, 4)
    assert a["link_gb_s"] == 450 and "within a node" in a["link"]
    assert a["seconds_per_step"] == pytest.approx(2 * sent * 24 * 4 / 450e9)
    compute = p["tokens_per_step"] / (0.4 * 989e12 * 8 / p["flops_per_token"])
    assert p["tokens_per_s"] == pytest.approx(p["tokens_per_step"] / (compute + a["seconds_per_step"]), rel=1e-3)
    assert not p["fits"] and p["verdict"].startswith("does not fit")
    would = {w["change"]: w["memory_per_gpu_gib"] for w in p["would_fit"]}
    assert set(would) == {"activation checkpointing", "--attention flex"}
    assert would["--attention flex"] < would["activation checkpointing"] / 2  # no T x T mask: far more room
    assert 0 < sp["max_seq_len"] < 131072 < sp["max_seq_len_with_ac"]  # sdpa's masks fit once the blocks recompute
    plan_main(argv)
    out = capsys.readouterr().out
    assert "sequence parallel: 8 ranks per row (N may be 1, 2, 4, 8); all-to-all per GPU per layer:" in out
    assert "at 450 GB/s within a node (zerotrain.hardware.interconnect_gb_s)" in out
    assert f"longest row that fits at micro-batch 1 (ZeRO-3, sdpa, N = 8): {sp['max_seq_len']:,} positions" in out
    assert "would fit: activation checkpointing (" in out and "; --attention flex (" in out
    flex = plan_json(capsys, *argv[:-6], "--attention", "flex", "--micro-batch", "1", "--grad-accum", "4")
    assert flex["fits"] and flex["sequence_parallel"]["max_seq_len"] >= 131072
    eight = plan_json(capsys, *argv[:-6], "--attention", "flex", "--micro-batch", "8", "--grad-accum", "4")
    assert not eight["fits"] and eight["would_fit"][0]["change"] == "activation checkpointing"
    ac = plan_json(capsys, *argv[:-6], "--attention", "flex", "--activation-checkpointing", "--micro-batch", "8",
                   "--grad-accum", "4")
    assert ac["fits"] and ac["sequence_parallel"]["all_to_all"]["gb_per_layer"] == round(3 * 8 * sent / 1e9, 4)
    auto = plan_json(capsys, *argv[:-6], "--micro-batch", "1", "--grad-accum", "4")  # varlen on an H100 in bf16
    assert auto["attention"] == "varlen" and auto["fits"] and auto["sequence_parallel"]["max_seq_len"] >= 131072


@pytest.mark.parametrize("argv,message", [
    (["--model", "xlarge", "--sequence-parallel", "8"],
     "--sequence-parallel 8 (flag): sequence parallelism over 8 ranks needs attention heads divisible by 8;"
     " the model has 15"),
    (["--model", "medium", "--sequence-parallel", "3"], "--sequence-parallel 3 (flag): must divide the world size 8"),
    (["--model", "medium", "--sequence-parallel", "16", "--gpus", "16"],
     "--sequence-parallel 16 (flag): must divide --seq-len 131000"),
    (["--model", "medium", "--sequence-parallel", "2", "--gpus", "1"],
     "--sequence-parallel 2 (flag): sequence parallelism needs more than one rank; profile h100-80g-x8 plans 1"
     " (give --gpus N, or a GPU --profile)"),
])
def test_plan_refuses_a_sequence_parallel_size_the_run_refuses(argv, message):
    seq = "131000" if "16" in argv else "131072"
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_main(["--profile", "h100-80g-x8", "--vocab-size", "128256", "--seq-len", seq, "--attention", "flex",
                   *argv])


@pytest.mark.launches
def test_plan_refuses_a_bad_sequence_parallel_size_in_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "zerotrain", "plan", "--profile", "h100-80g-x8", "--model", "xlarge",
                        "--seq-len", "131072", "--sequence-parallel", "8", "--vocab-size", "128256"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "zerotrain: error: --sequence-parallel 8 (flag): sequence parallelism over 8 ranks needs attention heads"
        " divisible by 8; the model has 15"]


def test_longest_row_search_is_monotone_and_the_fit_checks_answer(monkeypatch):
    """max_seq_len is the fit check's own boundary (the row fits, N positions more do not), grows with the
    device's memory and, with flex, with N; and the driver's fit check agrees at that boundary."""
    args = preset("medium", vocab_size=128256)
    _, prof = load_profile("h100-80g-x8")
    knobs = {**prof["zerotrain"], "attention": "flex"}
    rows = {}
    for n in (1, 2, 4, 8):
        setup = planner.setup_from(prof, {**knobs, "sequence_parallel": n})
        for ac in (False, True):
            longest = planner.max_seq_len(args, setup, 3, ac)
            assert longest % n == 0 and longest > 0
            assert planner.memory(args, setup, 3, 1, longest, ac).total <= setup.device_bytes
            assert planner.memory(args, setup, 3, 1, longest + n, ac).total > setup.device_bytes
            rows[n, ac] = longest
        smaller = planner.setup_from(prof, {**knobs, "sequence_parallel": n}, device_bytes=40 * 2**30)
        assert planner.max_seq_len(args, smaller, 3, False) < rows[n, False]
    for ac in (False, True):
        assert rows[1, ac] < rows[2, ac] < rows[4, ac] < rows[8, ac]
        assert all(rows[n, False] < rows[n, True] for n in (1, 2, 4, 8))

    # the driver's fit check on this CPU, 2 ranks at N = 2: the longest row passes, N positions more are refused
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(hardware, "available_ram", lambda: 8 * 2**30)
    run, model_args, ds, zt, world = fit_check_args(cfg(model="tiny", seq_len=256, micro_batch=1))
    zt = {**zt, "sequence_parallel": 2}
    setup = planner.setup_from(ds, zt, world=2, nodes=1, device_bytes=4 * 2**30, args=model_args)
    longest = planner.max_seq_len(model_args, setup, planner.stage_key(ds), False)
    planner.fit_check(cfg(model="tiny", seq_len=longest, micro_batch=1), model_args, ds, zt, world)
    with pytest.raises(UsageError, match="does not fit"):
        planner.fit_check(cfg(model="tiny", seq_len=longest + 2, micro_batch=1), model_args, ds, zt, world)


@pytest.mark.parametrize("name", list_profiles())
def test_gpu_profiles_name_their_links_and_where_the_figure_comes_from(name):
    hw = load_profile(name)[1]["zerotrain"]["hardware"]
    if hw.get("accelerator") == "cpu":  # no link to plan: pre-flight v1 measures the all-to-all
        assert "interconnect_gb_s" not in hw
        return
    keys = ["interconnect"] + (["internode"] if hw.get("nodes", 1) > 1 else [])
    for key in keys:
        assert hw[f"{key}_gb_s"] > 0 and "not measured" in hw[f"{key}_note"], key


@pytest.mark.parametrize("key,value", [("interconnect_gb_s", 0), ("internode_gb_s", "50"), ("interconnect_gb_s", True)])
def test_a_bad_link_bandwidth_in_a_profile_is_refused(key, value, tmp_path):
    prof = load_profile("h100-80g-2x8-multinode")[1]
    prof["zerotrain"]["hardware"][key] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(UsageError, match=rf"zerotrain.hardware.{key} \(.*GB/s per direction\) must be a positive"
                                         " number"):
        load_profile(str(path))
