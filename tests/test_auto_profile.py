"""`--profile auto` on a GPU no shipped profile matches (an RTX 4090, an L4, a T4, a laptop GPU): a profile built from
what the node is (launcher/profiles.py build_profile), said in one line, recorded under its `auto:DEVICE` name, and
planned for its memory. The device is faked by replacing our own probe (`Node.here`, launcher/node.py) with a
description; nothing of DeepSpeed or torch is mocked, and no process starts."""
from __future__ import annotations

import json

import pytest

from zerotrain.launcher.commands.plan import plan_main
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.node import Node
from zerotrain.launcher.profiles import (AUTO_BASE, PROFILE_DIR, build_profile, detect_profile, load_profile,
                                         peak_flops_of, precision)
from zerotrain.launcher.settings import profile_value
from zerotrain.launcher.trainer import dry_run

GiB = 2**30
RTX4090 = Node("cuda", 1, "NVIDIA GeForce RTX 4090", 23.6 * GiB, varlen=True, cpu_bf16=False, cuda_bf16=True)
T4 = Node("cuda", 1, "Tesla T4", 14.6 * GiB, varlen=True, cpu_bf16=False, cuda_bf16=False)
LAPTOP = Node("cuda", 1, "NVIDIA GeForce RTX 4060 Laptop GPU", 7.6 * GiB, varlen=True, cpu_bf16=False, cuda_bf16=True)


@pytest.fixture
def on(monkeypatch):
    """Make this process's machine the one given (our probe, replaced for the test)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def use(node: Node) -> Node:
        monkeypatch.setattr(Node, "here", staticmethod(lambda: node))
        return node
    return use


def test_a_gpu_without_a_shipped_profile_gets_one_built_and_said_in_one_line(on):
    on(RTX4090)
    name, why = detect_profile()
    assert name == "auto:NVIDIA GeForce RTX 4090"
    assert why.startswith("no shipped profile for NVIDIA GeForce RTX 4090 (24 GiB, bf16): built one for 1 GPU(s),"
                          " auto:NVIDIA GeForce RTX 4090: ZeRO-2, bf16, fused AdamW")
    assert "8 rows per step in the largest micro-batch that fits its memory, peak 165.2 TFLOP/s" in why
    assert "\n" not in why
    built_name, profile = load_profile(name)  # what the ranks, the notebook's launch and a resume load
    assert built_name == name and profile == build_profile(RTX4090)
    assert profile["zero_optimization"]["stage"] == 2 and precision(profile) == "bf16"
    assert not any(k.startswith("stage3_") for k in profile["zero_optimization"])
    assert profile["optimizer"]["params"]["fused"] is True
    assert profile_value(profile, "compile") is True and profile_value(profile, "dist_backend") == "nccl"
    assert profile_value(profile, "hardware") == {"accelerator": "cuda", "name_contains": ["NVIDIA GeForce RTX 4090"],
                                                  "devices_per_node": 1, "nodes": 1, "device_memory_gib": 23.6}
    assert profile_value(profile, "peak_flops_per_device") == 165.2e12
    base = json.loads((PROFILE_DIR / f"{AUTO_BASE}.json").read_text())  # the family it comes from
    assert profile_value(profile, "env") == profile_value(base, "env")
    assert profile_value(profile, "activation_checkpointing") is True


def test_no_bf16_trains_in_fp16_with_dynamic_loss_scaling(on):
    on(T4)
    name, why = detect_profile()
    profile = load_profile(name)[1]
    assert precision(profile) == "fp16" and profile["fp16"]["loss_scale"] == 0  # 0: DeepSpeed's dynamic scaling
    assert "(15 GiB, fp16 (no bf16 on this GPU))" in why and profile_value(profile, "peak_flops_per_device") == 65e12


def test_an_unknown_or_laptop_gpu_has_no_peak_and_so_no_mfu(on):
    on(LAPTOP)
    name, why = detect_profile()
    assert name == "auto:NVIDIA GeForce RTX 4060 Laptop GPU" and "peak FLOP/s unknown: no MFU" in why
    profile = load_profile(name)[1]
    for key in ("peak_flops_per_device", "expected_mfu", "mfu_threshold"):
        assert profile_value(profile, key) is None
    # the table matches whole names: an A10 is not an A100 or an A10G, an L4 is not an L40S
    assert peak_flops_of("NVIDIA A10")[0] == 125e12 and peak_flops_of("NVIDIA A10G")[0] is None
    assert peak_flops_of("NVIDIA A100-SXM4-40GB")[0] == 312e12
    assert peak_flops_of("NVIDIA L4")[0] == 121e12 and peak_flops_of("NVIDIA L40S")[0] == 362.05e12
    assert peak_flops_of("NVIDIA GeForce RTX 4090 Laptop GPU")[0] is None


def test_a_shipped_profile_still_wins_and_an_auto_name_is_refused_on_another_gpu(on):
    on(Node("cuda", 8, "NVIDIA A100-SXM4-80GB", 80 * GiB, varlen=True, cpu_bf16=False, cuda_bf16=True))
    assert detect_profile()[0] == "a100-80g-x8"
    with pytest.raises(UsageError, match=r"--profile auto:NVIDIA GeForce RTX 4090: built by --profile auto for that"
                                         r" GPU; this node has NVIDIA A100-SXM4-80GB \(use --profile auto\)"):
        load_profile("auto:NVIDIA GeForce RTX 4090")


def test_dry_run_on_a_4090_plans_for_its_memory_and_names_the_run_by_it(on, mix_path, tmp_path, capsys):
    on(RTX4090)
    out = tmp_path / "runs"
    result = dry_run(resolve_config(["--profile", "auto", "--model", "small", "--seq-len", "1024", "--data",
                                     str(mix_path), "--out", str(out)]))
    text = capsys.readouterr().out
    assert result.exit_code == 0 and not out.exists()
    assert result.extra["world"] == 1 and result.extra["ds_config"]["zero_optimization"]["stage"] == 2
    assert result.extra["ds_config"]["bf16"]["enabled"] is True
    assert "\nprofile auto: no shipped profile for NVIDIA GeForce RTX 4090 (24 GiB, bf16): built one" in text
    assert "profile auto:NVIDIA GeForce RTX 4090, world 1, ZeRO-2, batch 8 x 1 x 1 x 1024" in text
    assert result.run_dir.name.startswith("small-auto-nvidia-geforce-rtx-4090-")  # no colon or space in a path
    plan_line = next(line for line in text.splitlines() if line.startswith("plan: "))
    assert "23.6" in plan_line or "23.60" in plan_line, plan_line  # the verdict against its 23.6 GiB


def plan_json(*flags: str) -> dict:
    return plan_main(["--profile", "auto", "--model", "small", "--vocab-size", "32000", "--json", *flags])


def test_zerotrain_plan_sizes_the_micro_batch_for_the_gpus_memory(on, capsys):
    """8 rows per device per step on every GPU, in the largest power-of-two micro-batch its memory holds (the planner's
    max_micro_batch), grad accum making up the rest; --micro-batch given: that, as on any profile."""
    on(RTX4090)
    plan = plan_json("--seq-len", "8192")
    assert plan["profile"] == "auto:NVIDIA GeForce RTX 4090" and plan["profile_auto"].startswith("no shipped profile")
    assert plan["hardware"]["device_memory_gib"] == 23.6 and plan["zero_stage"] == 2 and plan["fits"]
    assert plan["max_micro_batch"] >= 8 and (plan["micro_batch"], plan["grad_accum"]) == (8, 1)
    on(LAPTOP)  # 7.6 GiB: the same model and rows, split into smaller micro-batches
    laptop = plan_json("--seq-len", "8192")
    # sized as the run sizes it (launcher/resolution.py): on the built profile's ZeRO-2 with its gradient bucket,
    # before one device turns the bucket off (profiles.one_device_stage), so 2 rows, where the table's row (no
    # bucket) holds 5
    assert laptop["max_micro_batch"] == 5 and (laptop["micro_batch"], laptop["grad_accum"]) == (2, 4)
    assert laptop["tokens_per_step"] == plan["tokens_per_step"] == 8 * 8192
    assert (plan_json("--seq-len", "16384")["micro_batch"], plan_json("--seq-len", "16384")["grad_accum"]) == (1, 8)
    given = plan_json("--seq-len", "8192", "--micro-batch", "1")
    assert (given["micro_batch"], given["grad_accum"]) == (1, 1)  # a flag wins; accum as any profile resolves it
    capsys.readouterr()


def test_the_run_and_its_dry_run_size_it_the_same(on, mix_path, tmp_path, capsys):
    on(LAPTOP)
    result = dry_run(resolve_config(["--profile", "auto", "--model", "small", "--seq-len", "8192", "--data",
                                     str(mix_path), "--out", str(tmp_path / "runs")]))
    ds = result.extra["ds_config"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 2, 8)  # compiled blocks (the built profile compiles) keep less: 4 rows fit, not 2
    assert "batch 4 x 2 x 1 x 8192" in capsys.readouterr().out
