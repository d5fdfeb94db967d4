"""Memory per rank of one configuration: model states + ZeRO buffers + activations + context, plus a fragmentation
allowance (`memory`), and the largest micro-batch that fits (`max_micro_batch`).

- model states: DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
  `estimate_zero3_model_states_mem_needs`, no offload): ZeRO-2 2P + 18P/N, ZeRO-3 4·L + 18P/N
  (P parameters, N ranks, L the largest module's own parameters; 18 = 2 fp16 grads + 4 fp32 grads +
  4 fp32 master + 8 Adam). ZeRO-0 and ZeRO-1 follow the same accounting: 20P (DeepSpeed's 16-bit
  optimizer wrapper keeps all of it on every rank) and 4P + 16P/N (16-bit params and grads whole).
  Runs without bf16/fp16 (the cpu profile) keep one fp32 copy of the weights and no 16-bit grads:
  16P, 8P + 16P/N, 4P + 16P/N, 8·L + 20P/N. Other optimizers replace the 8 bytes of Adam state with the
  registry's (launcher/optimizers.py `state_bytes_per_param`: Lion 4, AdEMAMix 12, Muon 4 on matrices and 8
  elsewhere). The two offload variants DeepSpeed estimates are shown too (ZeRO-2 optimizer offload 2P; ZeRO-3
  parameter + optimizer offload 4·L).
- ZeRO buffers (DeepSpeed allocates these; its estimators leave them out): the gradient bucket
  (`reduce_bucket_size` elements of the model's dtype, twice with `overlap_comm` at ZeRO-1/2); at ZeRO-3
  the copy `reduce_scatter_coalesced` makes of a bucket (torch.cat) and the parameters kept
  gathered between forward and backward (those re-used within `stage3_max_reuse_distance`: the last
  R/2 of the forward, so min(P, R/2 + prefetch bucket)). On a CPU node untouched pages of a bucket
  cost nothing, so a bucket counts min(bucket, P) there, and gloo stages one more bucket-size copy
  in its reduce-scatter / reduce (measured: benchmarks/run.py planner_rss). ZeRO++ hpZ's secondary weight
  partition counts with the buffers.
- activations: launcher/planning/activations.py; context and fragmentation: launcher/planning/hardware.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerotrain.launcher.planning.activations import activation_bytes
from zerotrain.launcher.planning.hardware import CPU_PROCESS_BYTES, FRAGMENTATION, Setup
from zerotrain.modeling.sizes import count_params

STAGES = (0, 1, 2, 3)
OFFLOAD = ("zero2_offload", "zero3_offload")
STAGE_LABELS = {"zero2_offload": "2 + optimizer offload", "zero3_offload": "3 + param/optimizer offload"}
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7, "stage3_max_reuse_distance": 1e9,
               "contiguous_gradients": True, "sub_group_size": 1e9}


@dataclass(frozen=True)
class Memory:
    """Per-rank bytes by component of one configuration."""
    model_states: float  # parameters, gradients and optimizer states
    buffers: float  # ZeRO's buckets and gathered parameters
    activations: float  # the activations' peak (activations.py)
    context: float  # the CUDA context, or a CPU rank's own memory
    fragmentation: float

    @property
    def total(self) -> float:
        return self.model_states + self.buffers + self.activations + self.context + self.fragmentation

    def as_dict(self) -> dict[str, float]:
        """The components and the total, in this order (the plan's rows)."""
        return {"model_states": self.model_states, "buffers": self.buffers, "activations": self.activations,
                "context": self.context, "fragmentation": self.fragmentation, "total": self.total}


def largest_layer(args) -> int:
    """Parameters of the largest single module (DeepSpeed's `model_to_params`: own parameters, not recursive)."""
    return max(args.vocab_size * args.dim, args.dim * args.ffn_hidden, args.dim * args.n_heads * args.head_dim)


def deepspeed_model_states(stage, total_params: int, largest_layer_params: int, gpus_per_node: int = 1,
                           nodes: int = 1, optimizer_bytes: float = 8) -> tuple[float, float]:
    """(GPU bytes, CPU bytes) per rank for 16-bit mixed precision, as DeepSpeed estimates them.

    Stages 2 and 3 (and the offload variants) reproduce `estimate_zero2_model_states_mem_needs` /
    `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
    additional_buffer_factor 1.5) exactly for Adam; tests/test_planner.py checks that. Stages 0
    and 1 have no DeepSpeed estimator; they follow the same byte accounting.
    """
    P, L, gpus = total_params, largest_layer_params, gpus_per_node * nodes
    per_param = 2 + 4 + 4 + optimizer_bytes  # 16-bit grads, fp32 grads, fp32 master, optimizer states
    if stage == 0:
        return 2 * P + per_param * P, 0.0
    if stage == 1:
        return 4 * P + int((per_param - 2) * P / gpus), 0.0
    if stage == 2:
        return 2 * P + int(per_param * P / gpus), P * 4 * gpus_per_node * 1.5
    if stage == 3:
        return 4 * L + int(per_param * P / gpus), L * 4 * gpus_per_node * 1.5
    if stage == "zero2_offload":
        return 2 * P, P * max(4 * gpus, 16) * 1.5
    if stage == "zero3_offload":
        return 4 * L, P * 18 * (1 / nodes) * 1.5
    raise ValueError(f"unknown stage {stage!r}")


def stage_key(ds_config: dict):
    """The planner's row for a resolved DeepSpeed dict: its ZeRO stage, or the offload variant it runs
    (zero3_offload: parameters and optimizer offloaded at ZeRO-3; zero2_offload: the optimizer at ZeRO-2).
    ZeRO-3 with only the optimizer offloaded is planned as plain ZeRO-3 (its device memory, an upper bound)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    on = {k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device", "none") != "none"}
    if stage == 3 and on == {"offload_optimizer", "offload_param"}:
        return "zero3_offload"
    if stage == 2 and on == {"offload_optimizer"}:
        return "zero2_offload"
    return stage


def model_states_bytes(stage, P: int, L: int, gpus_per_node: int, nodes: int, mixed: bool,
                       optimizer_bytes: float = 8) -> float:
    """Per-rank bytes of parameters, gradients and optimizer states."""
    if mixed or stage in OFFLOAD:
        return deepspeed_model_states(stage, P, L, gpus_per_node, nodes, optimizer_bytes)[0]
    # fp32 everywhere: one 4-byte copy of the weights (no 16-bit one), fp32 grads, DeepSpeed's fp32 master
    # partition still made (a clone) at ZeRO-1/2/3, optimizer states.
    n = gpus_per_node * nodes
    partitioned = 4 + 4 + optimizer_bytes  # fp32 grad partition, fp32 master, optimizer states
    return {0: (4 + 4 + optimizer_bytes) * P, 1: 8 * P + partitioned * P / n, 2: 4 * P + partitioned * P / n,
            3: 8 * L + (4 + partitioned) * P / n}[stage]


def zero_buffers_bytes(stage, P: int, zero: dict, mixed: bool, cpu: bool) -> float:
    """Per-rank bytes of the ZeRO buffers DeepSpeed allocates beyond its estimate (see the module docstring)."""
    if stage in OFFLOAD:
        stage = int(stage[4])
    p = 2 if mixed else 4
    bucket = float(zero.get("reduce_bucket_size", DS_DEFAULTS["reduce_bucket_size"]))
    used = min(bucket, P)  # elements of a bucket that real gradients ever touch
    held = used if cpu else bucket  # a GPU allocates the whole bucket up front
    gloo = used if cpu else 0  # gloo's reduce-scatter / reduce stage a full copy (measured)
    contiguous = zero.get("contiguous_gradients", DS_DEFAULTS["contiguous_gradients"])
    if stage == 0:
        return p * (used + gloo)  # the engine flattens each all-reduce bucket
    if stage in (1, 2):
        overlap = bool(zero.get("overlap_comm", False))  # DeepSpeed's default: off below ZeRO-3
        return p * ((held * (2 if overlap else 1) if contiguous else 0) + gloo)
    reuse = float(zero.get("stage3_max_reuse_distance", DS_DEFAULTS["stage3_max_reuse_distance"]))
    prefetch = float(zero.get("stage3_prefetch_bucket_size", DS_DEFAULTS["stage3_prefetch_bucket_size"]))
    gathered = min(P, reuse / 2 + prefetch)
    # ZeRO++ hpZ (zero_hpz_partition_size H > 1): each rank also keeps a secondary 16-bit copy of the weights,
    # partitioned over the H ranks of its node, so backward gathers inside the node (DeepSpeed's
    # partition_parameters.py `_partition_param_sec`): P / H more elements per rank
    hpz = int(zero.get("zero_hpz_partition_size", 1) or 1)
    secondary = P / hpz if hpz > 1 else 0
    return p * ((held if contiguous else 0) + used + gloo + gathered + secondary)


def memory(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool) -> Memory:
    """Per-rank bytes by component for one ZeRO stage (0-3 or an offload variant)."""
    P = count_params(args)["total"]
    states = model_states_bytes(stage, P, largest_layer(args), setup.gpus_per_node, setup.nodes, setup.mixed,
                                setup.optimizer_bytes)
    buffers = zero_buffers_bytes(stage, P, setup.zero, setup.mixed, setup.cpu)
    act = activation_bytes(args, micro, seq_len, 2 if setup.mixed else 4, checkpointing, setup.kernel,
                           setup.accelerator, setup.sequence_parallel, setup.tiled_mlp, setup.compiled).peak
    context = CPU_PROCESS_BYTES if setup.cpu else setup.context_bytes
    frag = FRAGMENTATION * (states + buffers + act)
    return Memory(states, buffers, act, context, frag)


def max_micro_batch(args, setup: Setup, stage, seq_len: int, checkpointing: bool) -> int:
    """The largest micro-batch whose memory fits the device (0: not even one row; 2**30: no limit found).

    Memory grows with the micro-batch but not linearly: the chunked loss's transient is a fixed size
    up to one chunk, so the answer is searched (doubling, then bisection), not extrapolated from two rows.
    """
    return largest(lambda micro: memory(args, setup, stage, micro, seq_len, checkpointing).total
                   <= setup.device_bytes, 1 << 30)


def largest(fits, limit: int) -> int:
    """The largest k in [1, limit] with fits(k), for a `fits` that holds up to some k and not beyond (0: not
    even 1; `limit`: no end found below it): doubling, then bisection."""
    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, bad * 2
        if bad > limit:
            return limit
    while bad - good > 1:  # fits(good) and not fits(bad)
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good
