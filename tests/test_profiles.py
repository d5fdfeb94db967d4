import json
import re
from pathlib import Path

import pytest

from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import list_profiles, load_profile, resolve_batch, resolve_ds_config

REQUIRED = {"cpu", "a100-80g-x8", "h100-80g-x8", "h100-pcie-80g-x8", "rtx6000ada-48g-x2", "h100-80g-2x8-multinode"}


def cfg(**kw):
    base = dict(micro_batch=None, grad_accum=None, global_batch_tokens=None, seq_len=128, lr=1e-3, min_lr=1e-4,
                max_steps=10, warmup_steps=2)
    return RunConfig.from_flat({**base, **kw})


def test_required_profiles_ship():
    assert REQUIRED <= set(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_every_profile_resolves_to_concrete_deepspeed_config(name):
    from deepspeed.runtime.config import DeepSpeedConfig

    _, profile = load_profile(name)
    world = profile["zerotrain"].get("hardware", {}).get("devices_per_node", 1) * \
        profile["zerotrain"].get("hardware", {}).get("nodes", 1)
    ds = resolve_ds_config(profile, cfg(), world, name)
    assert "zerotrain" not in ds
    assert "auto" not in json.dumps(ds)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and "scheduler" not in ds
    assert not (ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"))
    # DeepSpeed's own parser accepts it (batch triple checked against the world size there too).
    parsed = DeepSpeedConfig(ds, world_size=world) if "world_size" in DeepSpeedConfig.__init__.__code__.co_varnames \
        else None
    if parsed is not None:
        assert parsed.train_batch_size == ds["train_batch_size"]


def test_profile_stages_match_hardware_intent():
    stage = {n: load_profile(n)[1]["zero_optimization"]["stage"] for n in REQUIRED}
    assert stage["cpu"] == 3 and stage["a100-80g-x8"] == 2 and stage["h100-80g-x8"] == 3
    assert stage["rtx6000ada-48g-x2"] == 3 and stage["h100-80g-2x8-multinode"] == 3
    assert load_profile("cpu")[1]["bf16"]["enabled"] is False
    assert load_profile("rtx6000ada-48g-x2")[1]["zerotrain"]["activation_checkpointing"] is True


@pytest.mark.parametrize("micro,accum,gtok,world,expect", [
    (None, None, None, 2, (8, 1, 16)),        # the cpu profile's own numbers
    (4, 3, None, 2, (4, 3, 24)),
    (4, None, 4 * 2 * 128 * 5, 2, (4, 5, 40)),  # accum derived from global batch tokens
    (2, None, None, 4, (2, 1, 8)),
])
def test_batch_arithmetic(micro, accum, gtok, world, expect):
    _, profile = load_profile("cpu")
    assert resolve_batch(profile, micro, accum, gtok, 128, world, "cpu") == expect


def test_global_batch_tokens_must_divide():
    _, profile = load_profile("cpu")
    with pytest.raises(UsageError, match="not a multiple"):
        resolve_batch(profile, 4, None, 1000, 128, 2, "cpu")


def test_inconsistent_batch_triple_refused():
    profile = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 64}
    with pytest.raises(UsageError, match="inconsistent batch"):
        resolve_batch(profile, None, None, None, 128, 2, "p")
    # accum derived from a concrete train batch when it is "auto"
    profile = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "train_batch_size": 64}
    assert resolve_batch(profile, None, None, None, 128, 2, "p") == (4, 8, 64)


@pytest.mark.parametrize("body,message", [
    ('{"zero_optimization": {"stage": 5}}', "unknown ZeRO stage 5"),
    ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}', "both enabled"),
    ('{"train_batch_size": -4}', "train_batch_size must be a positive integer"),
    ('{"zero_optimization": {"stage": 2},', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"zerotrain": {"attention": "flash"}}',
     "zerotrain.attention must be one of auto, sdpa, flex, varlen, got 'flash'"),
])
def test_bad_profiles_refused(tmp_path, body, message):
    p = tmp_path / "bad.json"
    p.write_text(body)
    with pytest.raises(UsageError, match=message):
        load_profile(str(p))


def test_unknown_profile_name_lists_known():
    with pytest.raises(UsageError, match="unknown profile.*cpu"):
        load_profile("tpu-v9")


def test_auto_picks_cpu_here():
    from zerotrain.launcher.profiles import detect_profile

    name, why = detect_profile()
    assert name == "cpu" and "no CUDA" in why


def torch_deprecated_env_names() -> dict[str, str]:
    """{deprecated name: current name} as torch itself lists them: ProcessGroupNCCL.hpp, shipped in every torch
    wheel's include/, declares each variable as `static std::vector<std::string> TORCH_X = {"TORCH_X", "OLD_X"}`,
    the current name first and the names it still reads (and warns about, on every rank) after it."""
    import torch

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    decls = re.findall(r"static\s+std::vector<std::string>\s+\w+\s*=\s*\{([^}]*)\}", header.read_text())
    old = {}
    for decl in decls:
        names = re.findall(r'"(\w+)"', decl)
        old.update({name: names[0] for name in names[1:]})
    return old


def test_no_shipped_profile_sets_a_name_torch_has_deprecated():
    deprecated = torch_deprecated_env_names()
    assert deprecated["NCCL_ASYNC_ERROR_HANDLING"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # the header was read
    found = [f"{name}: {var} (use {deprecated[var]})" for name in list_profiles()
             for section in ("set", "pass")
             for var in load_profile(name)[1].get("zerotrain", {}).get("env", {}).get(section, [])
             if var in deprecated]
    assert not found, f"profiles set names torch has deprecated: {found}"


def test_gpu_profiles_environment():
    """No Megatron CUDA_DEVICE_MAX_CONNECTIONS=1 (it serialises ZeRO's overlap of communication and compute);
    expandable segments in every ZeRO-3 GPU profile; the NCCL heartbeat past our watchdog's timeout."""
    for name in list_profiles():
        _, p = load_profile(name)
        zt = p["zerotrain"]
        if zt["hardware"]["accelerator"] != "cuda":
            continue
        env = zt["env"]["set"]
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env, name
        assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1800", name
        assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0, name  # the flight recorder the watchdog dumps
        if p["zero_optimization"]["stage"] == 3:
            assert "expandable_segments:True" in env.get("PYTORCH_CUDA_ALLOC_CONF", ""), name


@pytest.mark.parametrize("gpu, count, mem_gib, picked", [("NVIDIA A100-SXM4-80GB", 8, 80, "a100-80g-x8"),
                                                         ("NVIDIA RTX 6000 Ada Generation", 2, 48, "rtx6000ada-48g-x2")])
def test_auto_never_picks_an_offload_profile(gpu, count, mem_gib, picked, monkeypatch):
    """The offload profiles match the same hardware as their plain ones: --profile auto takes the plain one."""
    from zerotrain.launcher.node import Node
    from zerotrain.launcher.profiles import detect_profile, list_profiles

    assert f"{picked}-offload" in list_profiles()
    node = Node("cuda", count, gpu, float(mem_gib * 2**30), varlen=True, cpu_bf16=False)
    monkeypatch.setattr(Node, "here", staticmethod(lambda: node))  # the machine detect_profile asks
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert detect_profile()[0] == picked
