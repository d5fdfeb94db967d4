"""Per-hardware DeepSpeed profiles (`ds_configs/*.json`): loading, validation, auto-detection,
and resolution into the exact dict handed to `deepspeed.initialize`.

A profile is real DeepSpeed JSON plus one `zerotrain` section of our own (description, the
hardware it is for, the distributed backend, the peak FLOP/s used for MFU, activation
checkpointing, ...: each key a setting of launcher/settings.py, which reads and checks it); that
section is removed before DeepSpeed sees the dict.
"""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.launcher.errors import UsageError
from zerotrain.reading import read_json_object
from zerotrain.launcher.node import Node
from zerotrain.launcher.optimizers import resolve_ds_optimizer
from zerotrain.launcher.offload.keys import apply_offload, check_offload, offload_settings, offloads_any
from zerotrain.launcher.settings import check_section, profile_value

PROFILE_DIR = resource_dir("zerotrain.ds_configs")  # the shipped profiles (package data)
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(spec: str) -> tuple[str, dict]:
    """(name, profile dict) for a profile name, a path to a JSON file, or `auto:DEVICE` (the profile --profile auto
    built for this node's GPU, built again: the ranks, the notebook's launch and a resume name it so); validated."""
    if spec.startswith(AUTO_PREFIX):
        node = Node.here()
        if node.device != "cuda" or node.name != spec.removeprefix(AUTO_PREFIX):
            raise UsageError(f"--profile {spec}: built by --profile auto for that GPU; this node has"
                             f" {node.name if node.device == 'cuda' else 'no CUDA device'} (use --profile auto)")
        return spec, build_profile(node)
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        name = path.stem
    else:
        name, path = spec, PROFILE_DIR / f"{spec}.json"
        if not path.is_file():
            raise UsageError(f"--profile {spec}: unknown profile; known: {', '.join(list_profiles())}, auto, or a path")
    if not path.is_file():
        raise UsageError(f"--profile {spec}: no such file")
    profile = read_json_object(path, f"profile {path}")
    validate_profile(profile, f"profile {path}")
    return name, profile


def validate_profile(profile, where: str) -> None:
    if not isinstance(profile, dict):
        raise UsageError(f"{where}: expected a JSON object")
    zero = profile.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        kind = " (text: write the number without quotes)" if isinstance(stage, str) else ""
        raise UsageError(f"{where}: unknown ZeRO stage {stage!r}{kind} (zero_optimization.stage must be 0, 1, 2 or"
                         " 3)")
    enabled = [k for k in ("bf16", "fp16") if isinstance(profile.get(k), dict) and profile[k].get("enabled") is True]
    if len(enabled) == 2:
        raise UsageError(f"{where}: bf16 and fp16 are both enabled; enable at most one")
    for key in BATCH_KEYS:
        v = profile.get(key, "auto")
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise UsageError(f"{where}: {key} must be a positive integer or \"auto\", got {v!r}")
    check_section(profile.get("zerotrain", {}), where)  # its keys, checked by launcher/settings.py
    if isinstance(zero, dict):
        check_offload(zero, where)  # DeepSpeed's offload sections (zerotrain.offload: the settings table)


def detect_profile(node: Node | None = None) -> tuple[str, str]:
    """(profile name, what was seen and decided, for the line "profile auto: ...") for the accelerators on this
    node (launcher/node.py; `node`: another machine's description, for tests). A single-node GPU no shipped
    profile matches gets one built from what it is (`build_profile`), named `auto:DEVICE`."""
    node = node or Node.here()
    if node.device != "cuda":
        return "cpu", "cpu (no CUDA device found)"
    count, mem_gib = node.count, node.memory / 2**30
    nodes = max(1, int(os.environ.get("WORLD_SIZE", count)) // count)
    seen = f"{count} x {node.name} ({mem_gib:.0f} GiB), {nodes} node(s)"
    best = None
    for name in list_profiles():
        candidate = json.loads((PROFILE_DIR / f"{name}.json").read_text())
        if profile_value(candidate, "offload") not in (None, "none"):
            continue  # an offload profile trades speed for memory: asked for by name, never picked silently
        hw = profile_value(candidate, "hardware", {})
        if hw.get("accelerator") != "cuda" or not any(s in node.name for s in hw.get("name_contains", [])):
            continue
        if mem_gib < hw.get("min_memory_gib", 0) or hw.get("nodes", 1) != nodes:
            continue
        if hw.get("devices_per_node") == count:
            return name, f"{name} for {seen}"
        best = best or name
    if best:
        return best, f"{best} for {seen} (device count differs from the profile's; batch is re-resolved)"
    if nodes > 1:
        raise UsageError(f"--profile auto: no profile matches {seen}; pass --profile NAME or a JSON path")
    built = build_profile(node)
    peak = profile_value(built, "peak_flops_per_device")
    kind = "bf16" if node.cuda_bf16 else "fp16 (no bf16 on this GPU)"
    return AUTO_PREFIX + node.name, (
        f"no shipped profile for {node.name} ({mem_gib:.0f} GiB, {kind}): built one for {count} GPU(s),"
        f" {AUTO_PREFIX}{node.name}: ZeRO-2, {precision(built)}, fused AdamW, activation checkpointing, regional"
        f" compile, {AUTO_ROWS} rows per step in the largest micro-batch that fits its memory, " + (f"peak {peak / 1e12:g} TFLOP/s ({profile_value(built, 'peak_flops_note')})"
                                    if peak else "peak FLOP/s unknown: no MFU"))


# The profile family a GPU without a shipped profile starts from: the single-node workstation one (nccl, fused
# AdamW, activation checkpointing, regional compile, the NCCL and allocator environment), at ZeRO-2 (one node:
# ZeRO-3 would gather every parameter around every module for little memory saved on 1-2 GPUs).
AUTO_PREFIX = "auto:"
AUTO_BASE = "rtx6000ada-48g-x2"
AUTO_ROWS = 8  # rows per device per step of a built profile: micro-batch x grad accum (planner.size_auto_micro_batch)
# Dense (no sparsity) 16-bit tensor-core peak per GPU, FP32 accumulate, from the vendor's datasheets:
# NVIDIA Ada Lovelace architecture whitepaper v1.03 appendix (RTX 4090: 165.2 TFLOP/s FP16/BF16, FP32 accumulate);
# L4 datasheet (BF16 242 TFLOP/s with sparsity: 121 dense); A10 datasheet (BF16 125 dense / 250 sparse);
# L40S datasheet (BF16 362.05 dense / 733 sparse); L40 datasheet (BF16 181.05 dense / 362.1 sparse); NVIDIA
# Ampere GA102 whitepaper v2 appendix (RTX 3090: 35.6 FP16 FP32-accumulate dense; RTX A6000: 154.8 dense,
# 309.7 sparse); T4 datasheet (65 TFLOP/s FP16 mixed precision, no bf16); A100 datasheet (BF16 312 dense).
# Keys are matched as whole words of the device's name ("A10" is not "A10G" nor "A100"). The A10G (AWS's
# variant) has no NVIDIA datasheet figure: it is not listed, and its runs report no MFU rather than a guess.
PEAK_FLOPS = {"RTX 4090": 165.2e12, "L4": 121e12, "A10": 125e12, "L40S": 362.05e12, "L40": 181.05e12,
              "RTX 3090": 35.6e12, "RTX A6000": 154.8e12, "T4": 65e12, "A100": 312e12}


def peak_flops_of(name: str) -> tuple[float | None, str]:
    """(dense 16-bit peak FLOP/s, where from) for a device name, from PEAK_FLOPS; (None, "unknown") if not there,
    or for a laptop part (same name, lower clocks and power: the desktop figure would overstate its MFU)."""
    if re.search(r"laptop|mobile|max-q", name, re.IGNORECASE):
        return None, "unknown"
    for key, flops in PEAK_FLOPS.items():
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", name):
            return flops, f"{key}: dense 16-bit tensor peak, vendor datasheet"
    return None, "unknown"


def build_profile(node: Node) -> dict:
    """The profile --profile auto builds for a single-node GPU no shipped profile matches: AUTO_BASE's settings,
    ZeRO-2, bf16 if the GPU has it else fp16 with dynamic loss scaling, this node's device count and memory, the
    peak FLOP/s of PEAK_FLOPS (none: no MFU), the micro-batch left to the planner (AUTO_ROWS rows per step)."""
    base = json.loads((PROFILE_DIR / f"{AUTO_BASE}.json").read_text())
    ours = dict(base["zerotrain"])
    for key in ("peak_flops_per_device", "peak_flops_note", "expected_mfu", "mfu_threshold", "mfu_note"):
        ours.pop(key, None)
    peak, note = peak_flops_of(node.name)
    if peak:
        ours.update(peak_flops_per_device=peak, peak_flops_note=note, expected_mfu=0.3, mfu_threshold=0.225,
                    mfu_note=f"assumed as for {AUTO_BASE} (25-35% with activation checkpointing); not measured")
    ours["description"] = f"built by --profile auto for {node.count} x {node.name}: {AUTO_BASE}'s settings at ZeRO-2"
    ours["hardware"] = {"accelerator": "cuda", "name_contains": [node.name], "devices_per_node": node.count,
                        "nodes": 1, "device_memory_gib": round(node.memory / 2**30, 1)}
    zero = {k: v for k, v in base["zero_optimization"].items() if not k.startswith(("stage3_", "zero_hpz"))}
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}  # DeepSpeed's dynamic loss scaling (0: dynamic)
    profile = {**base, "zerotrain": ours, "zero_optimization": {**zero, "stage": 2},
               # the micro-batch that fits this GPU's memory is the planner's (size_auto_micro_batch): it needs the model
               "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
               "bf16": {"enabled": True, "check_grad_overflow": False} if node.cuda_bf16 else {"enabled": False},
               "fp16": {"enabled": False} if node.cuda_bf16 else fp16}
    validate_profile(profile, f"profile {AUTO_PREFIX}{node.name}")
    return profile


def resolve_batch(profile: dict, micro: int | None, accum: int | None, global_tokens: int | None,
                  seq_len: int, world: int, where: str) -> tuple[int, int, int]:
    """(micro batch, grad accum, train batch) with micro x accum x world == train batch."""
    p_micro, p_accum, p_train = (profile.get(k, "auto") for k in BATCH_KEYS)
    cli = micro is not None or accum is not None or global_tokens is not None
    micro = micro if micro is not None else (p_micro if p_micro != "auto" else 1)
    if global_tokens is not None:
        per_accum = micro * world * seq_len
        if global_tokens % per_accum:
            raise UsageError(f"--global-batch-tokens {global_tokens}: not a multiple of micro {micro} x world {world}"
                             f" x seq-len {seq_len} = {per_accum}")
        accum = global_tokens // per_accum
    if accum is None:
        if p_accum != "auto":
            accum = p_accum
        elif p_train != "auto":
            if p_train % (micro * world):
                raise UsageError(f"{where}: train_batch_size {p_train} is not divisible by micro {micro} x world {world}")
            accum = p_train // (micro * world)
        else:
            accum = 1
    train = micro * accum * world
    if not cli and p_train != "auto" and p_train != train:
        raise UsageError(f"{where}: inconsistent batch: train_batch_size {p_train} != micro {micro} x accum {accum}"
                         f" x world {world} = {train}")
    return micro, accum, train


def resolve_ds_config(profile: dict, cfg, world: int, where: str) -> dict:
    """The exact dict for deepspeed.initialize: batch numbers and the optimizer (launcher/optimizers.py) filled in.

    The LR schedule is not in it: it is zerotrain.launcher.components.schedule's, handed to deepspeed.initialize.
    """
    ds = copy.deepcopy(profile)
    ds.pop("zerotrain", None)
    micro, accum, train = resolve_batch(profile, cfg.schedule.micro_batch, cfg.schedule.grad_accum,
                                        cfg.schedule.global_batch_tokens,
                                        cfg.data.seq_len, world, where)
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=train)
    offload, nvme, source = offload_settings(cfg, profile, where.removeprefix("profile "))
    ds = apply_offload(ds, offload, nvme, source)
    check_offload(ds.get("zero_optimization") or {}, source)

    ds = resolve_ds_optimizer(ds, cfg, where)  # --optimizer: the section DeepSpeed builds, or none for a client one
    ds.pop("scheduler", None)
    return accumulate_in_fp32(ds)


# DeepSpeed's sections whose names are not among deepspeed.runtime.constants' strings
DS_SECTIONS = ("zero_optimization", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
               "comms_logger", "compile", "aio", "sequence_parallel_size", "nebula", "elasticity", "autotuning",
               "compression_training", "data_efficiency", "curriculum_learning", "weight_quantization", "hybrid_engine")


def check_with_deepspeed(ds: dict, where: str) -> None:
    """The config deepspeed.initialize will get, checked by DeepSpeed's own config class before anything is built or
    written (a dry run too): its pydantic sections refuse a key they do not have, which would otherwise be a
    traceback from every rank at deepspeed.initialize. And what DeepSpeed takes unchecked and fails on or ignores
    later: gradient_clipping that is not a number, an optimizer type it has not, a top-level key a letter or two
    away from one of its own (it would be ignored: the run would train with the default). UsageError, one line."""
    import difflib

    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
    from pydantic import ValidationError

    known = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | set(DS_SECTIONS)
    for key in ds:
        close = [] if key in known else difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            raise UsageError(f"{where}: {key} is not a DeepSpeed key (did you mean {close[0]}?); DeepSpeed would"
                             " ignore it")
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise UsageError(f"{where}: gradient_clipping must be a non-negative number, got {clip!r}")
    kind = (ds.get("optimizer") or {}).get("type") if isinstance(ds.get("optimizer"), dict) else None
    if kind is not None:
        import torch

        if not isinstance(kind, str) or (kind.lower() not in DEEPSPEED_OPTIMIZERS
                                         and getattr(torch.optim, kind, None) is None):
            raise UsageError(f"{where}: optimizer type {kind!r} is not one DeepSpeed builds ({', '.join(DEEPSPEED_OPTIMIZERS)},"
                             " or a torch.optim class name)")
    # the batch numbers are ours (resolve_batch): DeepSpeedConfig derives the global batch from micro x accum x the
    # world it sees (1 before the process group exists, the real one after: pre-flight plans inside a group)
    unbatched = {k: v for k, v in ds.items() if k != "train_batch_size"}
    try:
        DeepSpeedConfig(unbatched)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        section = next((k for k, v in ds.items() if isinstance(v, dict) and loc and loc[0] in v), None)
        at = ".".join(([section] if section else []) + loc) or e.title
        close = difflib.get_close_matches(loc[-1], _model_fields(e.title), n=1) if loc else []
        hint = f" (did you mean {close[0]}?)" if close and err.get("type") == "extra_forbidden" else ""
        raise UsageError(f"{where}: {at}: {err.get('msg')}{hint}, got {err.get('input')!r} (DeepSpeed's"
                         f" {e.title})") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"{where}: DeepSpeed refuses the config: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _model_fields(title: str) -> list[str]:
    """The keys (names and aliases) of DeepSpeed's config section class named `title`, for a did-you-mean."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == title:
            return [k for name, f in cls.model_fields.items() for k in (name, f.alias) if k]
        todo += cls.__subclasses__()
    return []


def precision(ds: dict) -> str:
    """"bf16", "fp16" or "fp32": what a DeepSpeed dict (or a profile) trains in (validate_profile allows one)."""
    return next((k for k in ("bf16", "fp16") if isinstance(ds.get(k), dict) and ds[k].get("enabled") is True), "fp32")


def accumulate_in_fp32(ds: dict) -> dict:
    """bf16 at ZeRO-2/3: gradients summed over the micro-batches of a step in fp32, unless the dict says.

    DeepSpeed 0.19 accumulates in the model's dtype when `data_types.grad_accum_dtype` is unset: at ZeRO-2/3
    in bf16 each micro-batch's gradient is added into a bf16 partition, every addition rounded to 8 bits of
    mantissa (a relative error up to 2**-9 each time, over the 4 to 16 micro-batches of our GPU profiles),
    which autocast-style fp32 training never does. With "fp32" the partition is fp32 (stage_1_and_2.py's
    compact fp32 buffer, stage3.py's grad_partitions_flat_buffer); the planner's 18 bytes per parameter
    already count 4 for fp32 gradients. On 2 CPU ranks (debug model, grad-accum 4) step 1's gradient norm
    moved from 7.155304 to 7.155446 at both stages. Stages 0 and 1 are left as they are: DeepSpeed 0.19
    refuses bf16 with fp32 accumulation at stage 0 (NotImplementedError) and swaps in another optimizer
    wrapper (BF16_Optimizer, another checkpoint layout) at stage 1; offload keeps its own host-side buffers
    and is not run here.
    """
    zero = ds.get("zero_optimization") or {}
    data_types = ds.get("data_types") or {}
    offload = offloads_any(zero)
    if precision(ds) == "bf16" and zero.get("stage", 0) in (2, 3) and not offload \
            and "grad_accum_dtype" not in data_types:
        ds = {**ds, "data_types": {**data_types, "grad_accum_dtype": "fp32"}}
    return ds


def one_device_stage(ds: dict, world: int, device: str, start_stage: int | None = None) -> tuple[dict, str]:
    """(the dict, what was decided in words, or ""): ZeRO on ONE accelerator, as measured there.

    With a world of 1 ZeRO-3 partitions nothing, yet gathers and releases every parameter around every
    module's forward and backward: on one H100 (benchmarks/RESULTS.md, 2026-11-25) xlarge ran at 15.6-19.8%
    MFU at ZeRO-3 against 24.9-26.5% at ZeRO-2 with the same kernels. So ZeRO-3 runs as ZeRO-2 there: the same
    fp32 master weights, Adam state and fp32 gradient accumulation, DeepSpeed's ZeRO-1/2 checkpoint layout.
    And with nothing to reduce, overlap_comm (a side stream and its waits) and contiguous_gradients (every
    gradient copied into a bucket) are turned off: on one H200 (2026-11-27, `benchmarks/gpu_peers.py --programs
    B,Bz --b-zero '{"overlap_comm": false, "contiguous_gradients": false}'`, interleaved twice) 52,095-52,178
    against 51,120-51,200 tokens/s and 49.3 against 51.2 GiB. At world 8 the profile's values stand (not
    measured here). Stages 0 and 1 are not taken: DeepSpeed 0.19 refuses bf16 with fp32 accumulation at stage 0
    and swaps in BF16_Optimizer (another checkpoint layout, no universal conversion here) at stage 1.
    Not on a CPU (the CPU profiles are what the suite runs), not with offload (its parameters need ZeRO-3).
    `start_stage`: the stage a resumed run's checkpoint was saved with; a checkpoint cannot move between ZeRO-2
    and ZeRO-3 (launcher/resize/universal.py), so a run started on one device keeps ZeRO-2 on more.
    """
    zero = ds.get("zero_optimization") or {}
    if zero.get("stage") not in (2, 3) or offloads_any(zero) or device == "cpu":
        return ds, ""
    if world == 1:
        one = {"stage": 2, "overlap_comm": False, "contiguous_gradients": False}
        if all(zero.get(k) == v for k, v in one.items()):
            return ds, ""
        why = ("ZeRO-2 without overlap_comm and contiguous_gradients on one device (nothing to partition or reduce:"
               f" measured faster than the profile's ZeRO-{zero['stage']} settings on one GPU; set"
               " zero_optimization.stage 2 in the profile to resume this run on more devices)")
        return {**ds, "zero_optimization": {**zero, **one}}, why
    if start_stage == 2 and zero["stage"] == 3:
        return {**ds, "zero_optimization": {**zero, "stage": 2}}, (
            "ZeRO-2 instead of the profile's ZeRO-3: the run started on one device at ZeRO-2, and a checkpoint"
            " cannot move between ZeRO-2 and ZeRO-3")
    return ds, ""


def describe_precision(ds: dict) -> str:
    """One line for start-up and --dry-run: what is 16-bit and what stays fp32."""
    kind = precision(ds)
    if kind == "fp32":
        return "precision: fp32 (weights, activations, gradients and optimizer state)"
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype") or kind
    what = "dynamic loss scaling" if kind == "fp16" else "no loss scaling"
    return (f"precision: {kind} (DeepSpeed's {kind} section: {kind} weights, activations and gradients; fp32 master"
            f" weights and optimizer state; gradients accumulated over micro-batches in {accum}; {what})")


def profile_from_accelerate(values: dict, environ=None) -> dict:
    """Under `accelerate launch` with a `deepspeed_config_file`, that file is the profile.

    accelerate hands the file to the ranks as ACCELERATE_DEEPSPEED_CONFIG_FILE. A --profile (flag
    or recipe) naming another file is refused, naming both; one naming the same file is fine.
    Returns the values to override ({"profile": NAME} for a file in ds_configs/, so the run id is
    the one `--profile NAME` gives; else the file's absolute path), or {} outside accelerate.
    """
    environ = os.environ if environ is None else environ
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or path == "none":
        return {}
    where = f"accelerate's deepspeed_config_file {path} (ACCELERATE_DEEPSPEED_CONFIG_FILE)"
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{where}: no such file (a path in the accelerate config is relative to where"
                         " `accelerate launch` runs)")
    file = file.resolve()
    shipped = file.parent == PROFILE_DIR.resolve()
    given = values.get("profile")
    if given is not None:
        given_file = Path(given) if given.endswith(".json") or Path(given).is_file() else PROFILE_DIR / f"{given}.json"
        if given == "auto" or given_file.resolve() != file:
            raise UsageError(f"--profile {given} and {where}: two different profiles; drop --profile (under"
                             " accelerate the config file decides)")
    return {"profile": file.stem if shipped else str(file)}


def check_devices(profile_name: str, profile: dict, world: int, device_type: str | None = None,
                  local_devices: int = 0, detect=detect_profile) -> list[str]:
    """Warnings about the profile against this launch and machine; UsageError (one line) for a CPU profile on a
    node where DeepSpeed runs on CUDA (it would put the model on the GPUs with the CPU profile's gloo, fp32 and
    batch), and for a GPU profile where DeepSpeed sees no GPU (NCCL's traceback, or a silent run on the CPU). `device_type`, `local_devices`: what DeepSpeed's accelerator reports on this node (None: not asked,
    as for --dry-run, which is resolved against the profile's hardware). Pure: the caller asks the machine."""
    hw = profile_value(profile, "hardware", {})
    if hw.get("accelerator") == "cpu" and device_type == "cuda":
        try:
            instead = f"--profile {detect()[0]}"
        except UsageError:
            instead = "a GPU profile (`zerotrain profiles`; none shipped matches this node)"
        raise UsageError(f"--profile {profile_name}: a CPU profile, but this node has {local_devices} CUDA GPU(s),"
                         f" which DeepSpeed would use; use {instead}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to"
                         " train on the CPU")
    if hw.get("accelerator") == "cuda" and device_type == "cpu":
        backend = profile_value(profile, "dist_backend", None)
        then = "its nccl backend would fail" if backend in (None, "nccl") else "DeepSpeed would train on the CPU"
        raise UsageError(f"--profile {profile_name}: a GPU profile (hardware.accelerator cuda), but DeepSpeed sees no"
                         f" CUDA GPU on this node ({then}); use --profile cpu or auto here, or run it where the GPUs"
                         " are")
    out = []
    per_node, nodes = hw.get("devices_per_node"), hw.get("nodes", 1)
    if per_node is not None and world != per_node * nodes:
        out.append(f"world size {world} differs from profile {profile_name}'s devices_per_node x nodes ="
                   f" {per_node} x {nodes} = {per_node * nodes}: the batch is resolved for {world} rank(s)")
    if world == 1 and device_type == "cuda" and local_devices > 1:
        out.append(f"this node has {local_devices} GPUs and this run uses one; `zerotrain launch -n {local_devices}"
                   " <the same flags>` uses them all")
    return out
