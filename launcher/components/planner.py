"""The planner: memory per GPU, time and money of a run before it starts (`zerotrain plan`), and the
driver's fit check (`fit_check`), which refuses a config that cannot fit before anything is built.

    zerotrain plan [driver flags] [--gpus N --gpu-mem GiB --nodes M] [--zero S] [--mfu F] [--json]

One source of truth with the model: parameters and training FLOPs per token come from
`zerotrain.modeling.sizes.count_params` / `flops_per_token`; the batch from `zerotrain.launcher.profiles.resolve_batch`.

Memory per rank = model states + ZeRO buffers + activations + context, plus a fragmentation allowance:

- model states: DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
  `estimate_zero3_model_states_mem_needs`, no offload): ZeRO-2 2P + 18P/N, ZeRO-3 4·L + 18P/N
  (P parameters, N ranks, L the largest module's own parameters; 18 = 2 fp16 grads + 4 fp32 grads +
  4 fp32 master + 8 Adam). ZeRO-0 and ZeRO-1 follow the same accounting: 20P (DeepSpeed's 16-bit
  optimizer wrapper keeps all of it on every rank) and 4P + 16P/N (16-bit params and grads whole).
  Runs without bf16/fp16 (the cpu profile) keep one fp32 copy of the weights and no 16-bit grads:
  16P, 8P + 16P/N, 4P + 16P/N, 8·L + 20P/N. Other optimizers replace the 8 bytes of Adam state
  (Lion 4, AdEMAMix 12, Muon 4 on matrices and 8 elsewhere). The two offload variants DeepSpeed
  estimates are shown too (ZeRO-2 optimizer offload 2P; ZeRO-3 parameter + optimizer offload 4·L).
- ZeRO buffers (DeepSpeed allocates these; its estimators leave them out): the gradient bucket
  (`reduce_bucket_size` elements of the model's dtype, twice with `overlap_comm` at ZeRO-1/2); at ZeRO-3
  the copy `reduce_scatter_coalesced` makes of a bucket (torch.cat) and the parameters kept
  gathered between forward and backward (those re-used within `stage3_max_reuse_distance`: the last
  R/2 of the forward, so min(P, R/2 + prefetch bucket)). On a CPU node untouched pages of a bucket
  cost nothing, so a bucket counts min(bucket, P) there, and gloo stages one more bucket-size copy
  in its reduce-scatter / reduce (measured: benchmarks/run.py planner_rss).
- activations: `activation_bytes` below (formula in its docstring, checked against the tensors
  autograd really saves in tests/test_planner.py), for the attention kernel the run gets
  (`--attention`, or the profile's `zerotrain.attention`; auto: varlen on a GPU in 16-bit, sdpa
  otherwise, modeling/sizes.py `choose_attention`); the fit check uses the kernel the driver resolved.
- context: the CUDA context, cuBLAS/NCCL workspaces: the profile's `zerotrain.hardware.context_gib` (with
  its reason in `context_note`: the NVSwitch H100 profiles add NCCL's NVLS buffers), else 1 GiB per GPU
  process; or on a CPU node the resident size of a driver rank before it builds the model (0.6 GiB,
  measured here). ZeRO++ hpZ's secondary weight partition counts with the buffers.
- fragmentation: 10% of everything but the context (PyTorch's caching allocator on a GPU, glibc's
  arenas on a CPU).

Host memory with offload (`host_memory`, per node; DeepSpeed 0.19.8's allocations, read from its
runtime/zero/stage_1_and_2.py, stage3.py and swap_tensor/): with P/N the rank's partition, a the model's
dtype (2 in bf16/fp16, 4 in fp32), o the optimizer's state bytes (Adam 8):
- optimizer in host memory: fp32 master partition and optimizer states (4 + o)·P/N; gradients: at ZeRO-3
  the flat partition buffer in the model's dtype (the gradient accumulation dtype, DeepSpeed's default) and
  the fp32 gradients the optimizer steps, (a + 4)·P/N; at ZeRO-1/2 the fp32 partition 4·P/N, plus a·P/N
  accumulated per parameter on the host when grad-accum > 1; buffers at ZeRO-1/2: the 16-bit copy of the
  partition a·P/N and a staging buffer of the largest parameter;
- optimizer on NVMe: the gradient buffer a·P/N and `buffer_count` (4) swap buffers of the largest sub-group
  (min(sub_group_size, P/N) fp32 elements);
- parameters in host memory (ZeRO-3): their 16-bit partition a·P/N; on NVMe: min(max_in_cpu, P/N) of it
  and `buffer_count` × `buffer_size` swap buffers (5 × 1e8 elements by default);
- each rank's own resident memory before the model (0.6 GiB, measured here on CPU; a CUDA process maps
  more: not measured).
On a CPU node untouched pages cost nothing, so a swap buffer counts at most what is swapped (as buckets do
above), and host and device are the same RAM: the fit check adds the ranks' memory to it. The host's
size: the profile's `zerotrain.hardware.host_memory_gib` (`zerotrain plan`, `--dry-run`), the RAM
available now (a real run), or on a CPU node the RAM available. Checked against the CPU runs' offloaded
tensors in tests/test_offload_runs.py (within 20%).

Time: tokens/s = MFU × peak FLOP/s × GPUs / FLOPs per token (model FLOPs: recomputation under
activation checkpointing is not counted, so an AC profile's expected MFU is lower). With offload, each step
also moves state over each GPU's host link (`offload_traffic`), at the profile's
`zerotrain.hardware.host_link_gb_s` (GB/s, its source in `host_link_note`): the optimizer's gradients to the
host once per micro-batch and the updated 16-bit partition back once per step (a·P/N each), offloaded
parameters to the device for every forward, recomputation and backward (a·P/N each); not overlapped with
compute (an upper bound; DeepSpeed overlaps part of it), and neither CPU Adam's time nor NVMe's reads and
writes are counted. With sequence parallelism over N ranks (Ulysses), each step also waits on the
all-to-alls around attention (`all_to_all_bytes`): per layer and micro-batch, q, k, v (k and v at max(kv heads, N)
heads) and the kernel's output in forward, their gradients in backward, the forward's again in the
recomputation under activation checkpointing; each rank sends (N-1)/N of its (B, T/N, heads, head dim) tensors,
at the per-direction rate of the slowest link its group spans: `zerotrain.hardware.interconnect_gb_s` within a
node, `internode_gb_s` when a group crosses nodes (each with a `*_note` naming its source; spec figures, not
measured), not overlapped with compute (an upper bound). `max_seq_len`: the longest row that fits, by the
same memory. The MFU default
is the profile's `zerotrain.expected_mfu`; `zerotrain.mfu_threshold` (0.75 × expected) is pre-flight's.
Compute-optimal (Chinchilla): C = 6·N·D with the plan's N and D, D_opt = 20·N_opt, so N_opt = √(C/120).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.node import Node
from zerotrain.launcher.profiles import AUTO_ROWS, precision
from zerotrain.modeling.sizes import (choose_attention, count_params, flops_per_token, loss_chunk_tokens,
                                      math_kernel, mlp_tiles)
from zerotrain.modeling.sizes import check_sequence_parallel as check_model_sequence_parallel

GiB = 2**30
CUDA_CONTEXT_BYTES = 1.0 * GiB  # CUDA context + cuBLAS workspace + NCCL buffers per GPU process
CPU_PROCESS_BYTES = 0.6 * GiB  # RSS of a driver rank before the model (torch, deepspeed, datasets imported)
FRAGMENTATION = 0.10
CHINCHILLA_TOKENS_PER_PARAM = 20
STAGES = (0, 1, 2, 3)
OFFLOAD = ("zero2_offload", "zero3_offload")
STAGE_LABELS = {"zero2_offload": "2 + optimizer offload", "zero3_offload": "3 + param/optimizer offload"}
OPTIMIZER_STATE_BYTES = {None: 8, "adamw": 8, "adamw-decaying-wd": 8, "lion": 4, "ademamix": 12}
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7, "stage3_max_reuse_distance": 1e9,
               "contiguous_gradients": True, "sub_group_size": 1e9}
# DeepSpeed 0.19.8's defaults for the swap sections (runtime/zero/offload_config.py)
DS_OFFLOAD_DEFAULTS = {"offload_param": {"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
                       "offload_optimizer": {"buffer_count": 4}}
HOST_PROCESS_BYTES = CPU_PROCESS_BYTES  # a rank's own resident memory before the model, measured on CPU


# ------------------------------------------------------------------------------------------------
# The model's numbers
# ------------------------------------------------------------------------------------------------

def largest_layer(args) -> int:
    """Parameters of the largest single module (DeepSpeed's `model_to_params`: own parameters, not recursive)."""
    return max(args.vocab_size * args.dim, args.dim * args.ffn_hidden, args.dim * args.n_heads * args.head_dim)


def optimizer_state_bytes(optimizer: str | None, args) -> float:
    """Bytes of optimizer state per parameter (Adam's 8 in DeepSpeed's formula)."""
    if optimizer == "muon":  # momentum (4) on 2-D block weights, AdamW (8) on embeddings, head, norms
        total = count_params(args)["total"]
        norms = args.n_layers * 2 * args.dim + args.dim
        matrices = count_params(args)["non_embedding"] - norms
        return (4 * matrices + 8 * (total - matrices)) / total
    return OPTIMIZER_STATE_BYTES.get(optimizer, 8)


# ------------------------------------------------------------------------------------------------
# Model states: DeepSpeed's estimators
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Activations of our block
# ------------------------------------------------------------------------------------------------

def activation_bytes(args, micro: int, seq_len: int, act_bytes: int, checkpointing: bool,
                     attention: str, device_type: str = "cpu", sequence_parallel: int = 1,
                     tiled_mlp: bool = False, compiled: bool = False) -> dict:
    """Bytes of activations per rank for one micro-batch: what autograd keeps, and the peak.

    Per token, per block (modeling/model.py `Block`), with a = 2 (bf16/fp16) or 4 (fp32) bytes,
    d = dim, f = ffn hidden, H / KV heads of head dim h, T = seq len:

        2 RMSNorms    2·(8 + a)·d    fp32 input (4d; the input itself when a = 4), fp32 normalised (4d),
                                     output (a·d, held by the projections after it)
        attention     a·(2d + 2·KV·h) + 4H   q, k, v (KV heads: every kernel takes GQA as it is), output,
                                             fp32 log-sum-exp (varlen, flex, and sdpa)
                      + a·T                  sdpa only: the block-diagonal mask as a float, made and kept per
                                             call (packed rows, where documents share a row: the driver's)
        math kernel   a·d + 4·H·(3h + T)     instead of both lines above, where sdpa is PyTorch's math kernel
                                             (CUDA, packed rows, GQA: sizes.math_kernel): q, k and v upcast to
                                             fp32 with the kv heads repeated, and the (B, H, T, T) fp32 softmax,
                                             kept by every layer until its backward
        SwiGLU        4·a·f          gate, silu(gate), up, their product
        + 8                          the norms' rsqrt
        QK-norm       (8h + 4)·(H + KV)   each head's fp32 input and normalised value (the output is not kept:
                                          the rotation after it needs only cos and sin)

    Per token once: final norm 8·d + 4 (its output is not kept: the chunked loss keeps its gradient
    instead, a·d), rotary cos and sin 2·a·h, the input ids 8, sdpa's boolean mask T (alive through
    the forward, and a checkpoint input). Per micro-batch once: the head's weight gradient, a·V·d (V the
    padded vocabulary): the chunked loss (modeling/model.py `chunked_next_token_loss`) computes its
    gradients in forward and keeps no logits. flex's BlockMask, 16·B·n·(n + 1) bytes for n = ceil(T/128)
    blocks (four (B, 1, n, n) int32 block indices and four (B, 1, n) counts, for the forward and the backward),
    built once per micro-batch and alive through both (`flex_block_mask_bytes`).
    With sequence parallelism over N ranks (modeling/model.py SequenceShard) every per-token term counts this
    rank's T/N positions, with three differences per position: the kernel's k and v after the exchange hold
    max(KV, N) heads (fewer kv heads than N are repeated), the kernel's head-split output and o_proj's
    sequence-split input are two tensors (+ a·d), and the sdpa masks span the whole row (a·T·N and T·N), as
    do the input ids the embedding keeps (8·N: a slice of the whole row's).
    With --tiled-mlp (DeepSpeed's TiledMLP: the MLP's forward under no_grad, tile by tile, keeping only its
    input, which is the norm's output counted above) the SwiGLU's 4·a·f per position is not kept; its backward
    recomputes one tile at a time: a zeroed input gradient a·d per position and one tile's intermediates with
    their gradients, about 8·a·f per position of the tile (ceil(B·T/N / tiles) positions, sizes.mlp_tiles), on
    top of the block's other gradients (an estimate: the autograd test checks what is saved, not the backward).
    Compiled blocks (`compiled`: --compile, a CUDA profile's zerotrain.compile; engine.compile_blocks): inductor's
    partitioner keeps each norm's input and rsqrt, 2·(a·d + 4), instead of its fp32 copies, three of the SwiGLU's
    four (f)-wide tensors, 3·a·f, and each QK-norm's input and rsqrt, (a·h + 4)·(H + KV): what autograd kept of
    a compiled block on the CPU in bf16 (16·d + a·f per token less than eager, dim 256/512, ffn 704/1408); on one
    H200 (2026-11-27, xlarge, micro-batch 8 x 2048) this planned 54.4 GiB of tensors against 49.3-51.2 GiB
    allocated, where the eager terms planned 74.4 (the eager run held 67.4).
    Saved (no checkpointing) = tokens × (n_layers × block + once) + a·V·d. With activation checkpointing
    each block keeps only its input: tokens × (n_layers × a·d + once) + a·V·d.
    Peak = saved + the larger of two transients: at the loss, one chunk of c tokens (c =
    `loss_chunk` below: ~261 tokens at V = 128,256 on a CPU, more on an accelerator, at most the micro-batch): its fp32
    logits, worked on in place, and in 16-bit one 16-bit copy (the product before its cast, the gradient's
    cast), (4 + a)·c·V in 16-bit and 4·c·V in fp32; and in 16-bit the fp32 accumulator of the weight gradient
    and one chunk's 16-bit product (4 + a)·V·d; in backward, one block's gradients (one block's activations; with checkpointing two:
    the recomputed block and its gradients).
    """
    d, f, H, KV, h, V, T = args.dim, args.ffn_hidden, args.n_heads, args.n_kv_heads, args.head_dim, \
        args.vocab_size, seq_len
    a = act_bytes
    if attention not in ("sdpa", "flex", "varlen"):
        raise ValueError(f"activation_bytes: attention must be a kernel (sdpa, flex or varlen), got {attention!r}")
    sdpa, n = attention == "sdpa", sequence_parallel
    math = math_kernel(attention, device_type, KV < H)
    norms = 2 * (a * d + 4) if compiled else 2 * (8 + a) * d
    kernel_kv = KV if n == 1 else max(KV, n)
    # the math kernel's per-token terms hold under SP too: H/N heads over the whole row = H heads per local token
    attn = (a * d + 4 * H * (3 * h + T) if math
            else a * (2 * d + 2 * kernel_kv * h) + 4 * H + (a * T * n if sdpa else 0)) + (a * d if n > 1 else 0)
    qk_norm = ((a * h + 4) if compiled else (8 * h + 4)) * (H + KV) if args.qk_norm else 0  # per head
    swiglu = (3 if compiled else 4) * a * f
    block = norms + attn + qk_norm + (0 if tiled_mlp else swiglu) + 8
    once = 8 * d + 4 + a * d + 2 * a * h + 8 * n + (T * n if sdpa else 0)
    tokens = micro * seq_len // n
    head_grad = a * V * d
    kept_per_block = a * d if checkpointing else block
    block_mask = flex_block_mask_bytes(micro, T) if attention == "flex" else 0
    saved = tokens * (args.n_layers * kept_per_block + once) + head_grad + block_mask
    kernel_workspace = 4 * H * T if math else 4 * H if attention == "flex" and device_type != "cpu" else 0
    backward = tokens * ((2 if checkpointing else 1) * block + kernel_workspace)
    backward += tiled_mlp_backward_bytes(tokens, a, d, swiglu, T // n) if tiled_mlp else 0
    head_accumulator = (4 + a) * V * d if a < 4 else 0
    per_logit = 4 + (a if a < 4 else 0)
    chunk = loss_chunk(V, tokens, backward - head_accumulator, device_type, per_logit)
    at_loss = per_logit * chunk * V + head_accumulator
    transient = max(at_loss, backward)
    return {"saved": saved, "transient": transient, "peak": saved + transient, "block_per_token": block,
            "loss_chunk": chunk}


def tiled_mlp_backward_bytes(tokens: int, a: int, d: int, swiglu: int, positions: int) -> int:
    """What TiledMLP's backward adds (--tiled-mlp): the zeroed input gradient of every position, and one tile's
    recomputed intermediates with their gradients (`positions`: a rank's per row, which sets the tiles)."""
    return tokens * a * d + 2 * swiglu * -(-tokens // mlp_tiles(positions, d))


def flex_block_mask_bytes(micro: int, seq_len: int) -> int:
    """flex's document BlockMask for one micro-batch (modeling/model.py `document_block_mask`, one mask for
    every head): kv_num_blocks, full_kv_num_blocks, q_num_blocks, full_q_num_blocks (B, 1, n) and their
    indices (B, 1, n, n), int32, n = ceil(T / 128) (torch's default block size)."""
    n = -(-seq_len // 128)
    return 16 * micro * n * (n + 1)


def loss_chunk(V: int, tokens: int, room: float, device_type: str, per_logit: int) -> int:
    """Tokens per chunk of the chunked loss. On a CPU: `loss_chunk_tokens(V)` (128 MiB of fp32 logits, ~261
    tokens at V = 128,256). On an accelerator, where a ~261-token chunk leaves the GPU waiting on a small
    product and a re-read of the head per chunk: as many tokens as the memory backward needs anyway (`room`:
    one block's gradients, less the fp32 head accumulator) holds at `per_logit` bytes x V each (6 in 16-bit), so
    the peak does not grow; never fewer than the CPU's. At most the micro-batch's tokens."""
    least = loss_chunk_tokens(V)
    chunk = least if device_type == "cpu" else max(least, int(room // (per_logit * V)))
    return max(1, min(tokens, chunk))


def run_loss_chunk(args, ds_config: dict, seq_len: int, checkpointing: bool, attention: str,
                   device_type: str, sequence_parallel: int = 1, tiled_mlp: bool = False) -> int | None:
    """The run's chunk (EngineSpec.loss_chunk_tokens): None on a CPU (the model's own default, the same size)."""
    if device_type == "cpu":
        return None
    mixed = precision(ds_config) != "fp32"
    return activation_bytes(args, ds_config["train_micro_batch_size_per_gpu"], seq_len, 2 if mixed else 4,
                            checkpointing, attention, device_type, sequence_parallel, tiled_mlp)["loss_chunk"]


# ------------------------------------------------------------------------------------------------
# One configuration's memory
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """What memory depends on besides the model: hardware, precision, ZeRO settings."""
    accelerator: str  # "cuda" or "cpu"
    gpus_per_node: int
    nodes: int
    device_bytes: float  # per GPU, or per rank on a CPU node
    mixed: bool  # bf16 / fp16
    zero: dict  # the profile's zero_optimization section
    optimizer_bytes: float = 8
    attention: str = "auto"  # as asked (--attention / zerotrain.attention); `kernel` is what runs
    context_bytes: float = CUDA_CONTEXT_BYTES  # per GPU process: the profile's hardware.context_gib, else 1 GiB
    sequence_parallel: int = 1  # ranks sharing each row: each holds the activations of seq_len / N positions
    host_bytes: float | None = None  # RAM of a node: hardware.host_memory_gib, or on a CPU node the RAM available
    host_link_bytes_per_s: float | None = None  # each GPU's link to the host: hardware.host_link_gb_s
    interconnect_bytes_per_s: float | None = None  # GPU to GPU within a node, per direction: hardware.interconnect_gb_s
    internode_bytes_per_s: float | None = None  # per GPU between nodes, per direction: hardware.internode_gb_s
    tiled_mlp: bool = False  # --tiled-mlp: the MLP's intermediates not kept (activation_bytes)
    compiled: bool = False  # blocks compiled (--compile, zerotrain.compile): fewer intermediates kept (activation_bytes)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def cpu(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def kernel(self) -> str:
        """The attention kernel: auto resolved for this hardware and precision (varlen assumed in torch)."""
        return choose_attention(self.attention, self.accelerator, "bf16" if self.mixed else "fp32")


def memory(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool) -> dict:
    """Per-rank bytes by component for one ZeRO stage (0-3 or an offload variant)."""
    P = count_params(args)["total"]
    states = model_states_bytes(stage, P, largest_layer(args), setup.gpus_per_node, setup.nodes, setup.mixed,
                                setup.optimizer_bytes)
    buffers = zero_buffers_bytes(stage, P, setup.zero, setup.mixed, setup.cpu)
    act = activation_bytes(args, micro, seq_len, 2 if setup.mixed else 4, checkpointing, setup.kernel,
                           setup.accelerator, setup.sequence_parallel, setup.tiled_mlp, setup.compiled)["peak"]
    context = CPU_PROCESS_BYTES if setup.cpu else setup.context_bytes
    frag = FRAGMENTATION * (states + buffers + act)
    return {"model_states": states, "buffers": buffers, "activations": act, "context": context,
            "fragmentation": frag, "total": states + buffers + act + context + frag}



# ------------------------------------------------------------------------------------------------
# Host memory and the host link, with offload (see the module docstring)
# ------------------------------------------------------------------------------------------------

def offload_devices(stage, zero: dict) -> dict[str, str]:
    """{"optimizer"/"parameters": "cpu" or "nvme"} a planner row offloads: an offload row its variant (on the
    device the profile's section names, else cpu), another row what its zero section says (ZeRO-3 with only
    the optimizer offloaded is row 3)."""
    sections = {"optimizer": "offload_optimizer", "parameters": "offload_param"}
    said = {what: (zero.get(section) or {}).get("device", "none") for what, section in sections.items()}
    if stage in OFFLOAD:
        wanted = ("optimizer",) if stage == "zero2_offload" else ("optimizer", "parameters")
        return {what: said[what] if said[what] != "none" else "cpu" for what in wanted}
    return {what: device for what, device in said.items() if device != "none"}


def host_memory(args, setup: Setup, stage, grad_accum: int = 1) -> dict:
    """Bytes of host memory one node's offloaded state takes, by component (per rank x ranks per node), and
    `total` with the ranks' own memory; all 0 when the row offloads nothing."""
    devices = offload_devices(stage, setup.zero)
    out = {"optimizer": 0.0, "gradients": 0.0, "parameters": 0.0, "buffers": 0.0}
    if devices:
        s = int(stage[4]) if stage in OFFLOAD else stage
        P = count_params(args)["total"]
        part = P / setup.world  # this rank's partition
        a = 2 if setup.mixed else 4
        section = {k: {**DS_OFFLOAD_DEFAULTS[k], **(setup.zero.get(k) or {})} for k in DS_OFFLOAD_DEFAULTS}

        def resident(buffer_bytes: float, used_bytes: float) -> float:  # untouched pages cost nothing on a CPU
            return min(buffer_bytes, used_bytes) if setup.cpu else buffer_bytes

        optimizer = devices.get("optimizer")
        if optimizer == "cpu":
            out["optimizer"] = (4 + setup.optimizer_bytes) * part
            if s == 3:
                out["gradients"] = (a + 4) * part
            else:
                out["gradients"] = 4 * part + (a * part if grad_accum > 1 else 0)
                out["buffers"] += a * part + a * largest_layer(args)
        elif optimizer == "nvme":
            sub_group = min(float(setup.zero.get("sub_group_size", DS_DEFAULTS["sub_group_size"])), part)
            out["gradients"] = a * part
            out["buffers"] += resident(section["offload_optimizer"]["buffer_count"] * sub_group * 4,
                                       (4 + setup.optimizer_bytes) * part)
        params = devices.get("parameters")
        if params == "cpu":
            out["parameters"] = a * part
        elif params == "nvme":
            out["parameters"] = a * min(float(section["offload_param"]["max_in_cpu"]), part)
            swap = section["offload_param"]
            out["buffers"] += resident(swap["buffer_count"] * float(swap["buffer_size"]) * a, a * part)
        out = {k: v * setup.gpus_per_node for k, v in out.items()}
    state = sum(out.values())
    return {**out, "state": state, "processes": HOST_PROCESS_BYTES * setup.gpus_per_node if devices else 0.0,
            "total": state + (HOST_PROCESS_BYTES * setup.gpus_per_node if devices else 0.0)}


def offload_traffic(args, setup: Setup, stage, grad_accum: int, checkpointing: bool) -> dict:
    """Bytes one GPU moves over its host link per optimizer step with offload, and the seconds that takes at
    the profile's host link bandwidth (None when the profile names none; 0 bytes when nothing is offloaded)."""
    devices = offload_devices(stage, setup.zero)
    P = count_params(args)["total"]
    part = P / setup.world
    a = 2 if setup.mixed else 4
    moved = 0.0
    if "optimizer" in devices:  # gradients to the host every micro-batch, the updated partition back every step
        moved += a * part * grad_accum + a * part
    if "parameters" in devices:  # fetched for the forward, the recomputation under AC, and the backward
        moved += a * part * grad_accum * (3 if checkpointing else 2)
    rate = setup.host_link_bytes_per_s
    seconds = 0.0 if not moved else moved / rate if rate else None
    return {"bytes_per_gpu": moved, "seconds": seconds}


def host_verdict(need: float, host: float | None, what: str) -> str | None:
    """The one-line refusal when a node's host memory cannot hold the offloaded state (None: it can, or the
    host's size is unknown)."""
    if host is None or need <= host:
        return None
    return (f"does not fit on the host: the offloaded state needs {_size(need / GiB)} of host memory per node,"
            f" {what} has {_size(host / GiB)}; offload less (--offload optimizer or none), more nodes, or"
            " --nvme-path DIR")


# ------------------------------------------------------------------------------------------------
# Sequence parallelism: the all-to-all, and the longest row that fits (see the module docstring)
# ------------------------------------------------------------------------------------------------

def check_sequence_parallel(sp: int, flag: str, seq_len: int, args, world: int, one_rank: str = "this launch has 1"
                            ) -> None:
    """UsageError (one line naming `flag`, before anything is written) when N = sp ranks cannot share each row:
    N divides the world, --seq-len and the attention heads (the kv heads divide by N or N by them:
    modeling/sizes.py check_sequence_parallel); N > 1 needs more than one rank. The run's check
    (launcher/run_plan.py) and `zerotrain plan`'s; `one_rank` ends the line for a world of 1 (plan: how to
    plan more ranks)."""
    if sp == 1:
        return
    if world == 1:
        raise UsageError(f"{flag}: sequence parallelism needs more than one rank; {one_rank}")
    if world % sp:
        raise UsageError(f"{flag}: must divide the world size {world} (N ranks share each row)")
    if seq_len % sp:
        raise UsageError(f"{flag}: must divide --seq-len {seq_len} (each rank holds seq_len / N positions)")
    try:
        check_model_sequence_parallel(args, sp)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def sequence_parallel_sizes(args, world: int, seq_len: int) -> list[int]:
    """Every N the run accepts for this model, world and --seq-len (check_sequence_parallel)."""
    def accepted(n: int) -> bool:
        try:
            check_sequence_parallel(n, "", seq_len, args, world)
            return True
        except UsageError:
            return False

    return [n for n in range(1, world + 1) if accepted(n)]


def all_to_all_bytes(args, micro: int, seq_len: int, act_bytes: int, sequence_parallel: int,
                     checkpointing: bool) -> dict:
    """Bytes one rank sends per attention layer for one micro-batch under Ulysses over N ranks
    (modeling/model.py Attention.forward, sequence_to_heads / heads_to_sequence).

    Forward, four all-to-alls of this rank's (B, T/N, heads, h) tensors: q at H heads, k and v at max(KV, N)
    heads (fewer kv heads than N are repeated before the exchange), the kernel's output at H heads. Backward
    exchanges the same four gradients. Under activation checkpointing the forward's four run again in the
    recomputation. Each rank keeps 1/N of every tensor and sends the other (N-1)/N."""
    n = sequence_parallel
    if n <= 1:
        return {"forward": 0.0, "backward": 0.0, "recompute": 0.0, "per_layer": 0.0}
    heads = 2 * args.n_heads + 2 * max(args.n_kv_heads, n)
    tensors = micro * (seq_len // n) * heads * args.head_dim * act_bytes  # the four tensors this rank holds
    sent = tensors * (n - 1) / n
    recompute = sent if checkpointing else 0.0
    return {"forward": sent, "backward": sent, "recompute": recompute, "per_layer": 2 * sent + recompute}


def sequence_link(setup: Setup) -> tuple[float | None, str, str]:
    """(bytes/s per direction of the slowest link a sequence-parallel group spans, its name, the profile key
    that states it). Groups are ranks g*N .. g*N+N-1: within a node when N divides the GPUs per node, else
    across nodes."""
    n = setup.sequence_parallel
    if setup.nodes > 1 and setup.gpus_per_node % n:
        rate, where, key = setup.internode_bytes_per_s, "between nodes", "zerotrain.hardware.internode_gb_s"
    else:
        rate, where, key = setup.interconnect_bytes_per_s, "within a node", "zerotrain.hardware.interconnect_gb_s"
    return rate, f"{where} ({key})", key


def all_to_all_summary(args, setup: Setup, micro: int, seq_len: int, checkpointing: bool, grad_accum: int) -> dict:
    """The plan's `all_to_all`: GB one GPU sends per layer and per step, the link and its GB/s, and the seconds
    per step at that rate, not overlapped with compute (None without the profile's bandwidth; 0 at N = 1)."""
    moved = all_to_all_bytes(args, micro, seq_len, 2 if setup.mixed else 4, setup.sequence_parallel, checkpointing)
    per_step = moved["per_layer"] * args.n_layers * grad_accum
    rate, link, _ = sequence_link(setup)
    def seconds(moved_bytes: float) -> float | None:
        return 0.0 if not moved_bytes else moved_bytes / rate if rate else None

    return {"gb_per_layer_forward": round(moved["forward"] / 1e9, 4),
            "gb_per_layer": round(moved["per_layer"] / 1e9, 4), "gb_per_step_per_gpu": round(per_step / 1e9, 3),
            "link": link, "link_gb_s": None if rate is None else rate / 1e9,
            "seconds_per_layer": seconds(moved["per_layer"]), "seconds_per_step": seconds(per_step)}


def max_seq_len(args, setup: Setup, stage, checkpointing: bool, micro: int = 1, limit: int = 1 << 24) -> int:
    """The longest row (a multiple of the setup's N) whose memory at `micro` rows fits the device, by the same
    `memory` the fit check uses (0: not even N positions; `limit`: no limit found below it). Memory grows with
    the row, so the answer is searched (doubling, then bisection) in steps of N."""
    n = setup.sequence_parallel
    return n * largest(lambda k: memory(args, setup, stage, micro, k * n, checkpointing)["total"]
                       <= setup.device_bytes, limit // n)


def sequence_summary(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
                     grad_accum: int) -> dict:
    """The plan's `sequence_parallel`: N, the sizes this model, world and row accept, the all-to-all, and the
    longest row that fits at micro-batch 1 for the chosen stage, with and without activation checkpointing."""
    return {"size": setup.sequence_parallel, "valid_sizes": sequence_parallel_sizes(args, setup.world, seq_len),
            "all_to_all": all_to_all_summary(args, setup, micro, seq_len, checkpointing, grad_accum),
            "max_seq_len": max_seq_len(args, setup, stage, checkpointing),
            "max_seq_len_with_ac": max_seq_len(args, setup, stage, True)}


def max_micro_batch(args, setup: Setup, stage, seq_len: int, checkpointing: bool) -> int:
    """The largest micro-batch whose memory fits the device (0: not even one row; 2**30: no limit found).

    Memory grows with the micro-batch but not linearly: the chunked loss's transient is a fixed size
    up to one chunk, so the answer is searched (doubling, then bisection), not extrapolated from two rows.
    """
    return largest(lambda micro: memory(args, setup, stage, micro, seq_len, checkpointing)["total"]
                   <= setup.device_bytes, 1 << 30)


def size_auto_micro_batch(profile: dict, cfg, model_args, knobs: dict, world: int) -> dict:
    """The micro-batch of a profile --profile auto built (train_micro_batch_size_per_gpu "auto": profiles.build_profile)
    when no --micro-batch is given: the largest power of two up to AUTO_ROWS whose memory fits the profile's device
    (the node's own memory, recorded when it was built), and grad accum making up AUTO_ROWS rows per device per step,
    so a step trains the same rows on a 24 GiB and an 8 GiB GPU, only split differently. Any other profile: unchanged.
    The run (run_plan.plan), --dry-run and `zerotrain plan` all size it here."""
    if profile.get("train_micro_batch_size_per_gpu") != "auto" or profile.get("gradient_accumulation_steps") != "auto" \
            or getattr(cfg, "micro_batch", None) is not None:
        return profile
    setup = setup_from(profile, knobs, world=world, nodes=1, optimizer=getattr(cfg, "optimizer", None),
                       args=model_args, attention=getattr(cfg, "attention", None))
    fits = max_micro_batch(model_args, setup, stage_key(profile), cfg.seq_len,
                           bool(knobs.get("activation_checkpointing")))
    micro = 1
    while micro * 2 <= min(fits, AUTO_ROWS):
        micro *= 2
    return {**profile, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": "auto" if cfg.grad_accum is not None or cfg.global_batch_tokens is not None
            else AUTO_ROWS // micro}


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


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _size(gib: float) -> str:
    """A GiB figure for a sentence: GiB up to 1024, then TiB, PiB, EiB."""
    for unit in ("GiB", "TiB", "PiB", "EiB"):
        if abs(gib) < 1024 or unit == "EiB":
            return f"{gib:.2f} {unit}" if unit == "GiB" else f"{gib:.3g} {unit}"
        gib /= 1024


def _gib(x: float) -> float:
    return round(x / GiB, 2)


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------

def setup_from(ds_config: dict, knobs: dict, world: int | None = None, nodes: int | None = None,
               device_bytes: float | None = None, optimizer: str | None = None, args=None,
               attention: str | None = None) -> Setup:
    """A Setup from a profile (DeepSpeed dict + the run's resolved settings, `plan.settings.values`: hardware,
    attention; a profile's zerotrain section holds the same keys), with hardware overrides.
    `attention`: --attention, else the profile's zerotrain.attention, else auto; one that cannot run
    on this hardware and precision is refused (UsageError)."""
    hw = knobs.get("hardware") or {}
    accel = hw.get("accelerator", "cuda")
    nodes = nodes or hw.get("nodes", 1)
    per_node = world // nodes if world else hw.get("devices_per_node", 1)
    if device_bytes is None:
        device_bytes = hw["device_memory_gib"] * GiB if "device_memory_gib" in hw else \
            available_ram() / per_node if accel == "cpu" else None
    if device_bytes is None:
        raise UsageError("the profile does not say how much memory a GPU has (zerotrain.hardware.device_memory_gib);"
                         " give --gpu-mem GiB")
    mixed = precision(ds_config) != "fp32"
    setup = Setup(accel, per_node, nodes, float(device_bytes), mixed, dict(ds_config.get("zero_optimization", {})),
                  optimizer_state_bytes(optimizer, args) if args is not None else 8,
                  attention or knobs.get("attention") or "auto",
                  float(hw.get("context_gib", CUDA_CONTEXT_BYTES / GiB)) * GiB,
                  int(knobs.get("sequence_parallel") or 1),
                  float(hw["host_memory_gib"]) * GiB if "host_memory_gib" in hw else
                  available_ram() if accel == "cpu" else None,
                  float(hw["host_link_gb_s"]) * 1e9 if "host_link_gb_s" in hw else None,
                  *(float(hw[key]) * 1e9 if key in hw else None for key in ("interconnect_gb_s", "internode_gb_s")),
                  bool(knobs.get("tiled_mlp")), bool(knobs.get("compile")))
    try:
        setup.kernel
    except ValueError as e:
        raise UsageError(f"--attention {setup.attention}: {e}") from None
    return setup


def available_ram() -> float:
    """Bytes of RAM available now (MemAvailable), the budget of a CPU node's ranks."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def make_plan(args, setup: Setup, stage: int, micro: int, accum: int, seq_len: int, checkpointing: bool,
              peak_flops: float | None = None, mfu: float | None = None, total_tokens: int | None = None,
              max_hours: float | None = None, budget_usd: float | None = None, gpu_hour_usd: float | None = None,
              max_steps: int | None = None, tokens_set_length: bool = False) -> dict:
    """Everything `zerotrain plan` prints, as one JSON-ready dict (keys documented in docs/planning.md).
    `tokens_set_length`: --total-tokens sets the run's length (launcher/hparams.py), its last step whole."""
    counts = count_params(args)
    fpt = flops_per_token(args, seq_len)
    per_stage = {}
    for s in (*STAGES, *OFFLOAD):
        m = memory(args, setup, s, micro, seq_len, checkpointing)
        per_stage[f"zero{s}" if isinstance(s, int) else s] = {
            **{f"{k}_gib": _gib(v) for k, v in m.items()}, "fits": m["total"] <= setup.device_bytes,
            "max_micro_batch": max_micro_batch(args, setup, s, seq_len, checkpointing)}
    chosen = per_stage[stage if stage in OFFLOAD else f"zero{stage}"]
    tokens_per_step = micro * accum * (setup.world // setup.sequence_parallel) * seq_len  # N ranks share a row
    plan = {
        "model": {"layers": args.n_layers, "dim": args.dim, "heads": args.n_heads, "kv_heads": args.n_kv_heads,
                  "ffn_hidden": args.ffn_hidden, "vocab_size": args.vocab_size, "tie_embeddings": args.tie_embeddings},
        "params_total": counts["total"], "params_non_embedding": counts["non_embedding"],
        "flops_per_token": fpt,
        "hardware": {"accelerator": setup.accelerator, "gpus_per_node": setup.gpus_per_node, "nodes": setup.nodes,
                     "world": setup.world, "device_memory_gib": _gib(setup.device_bytes),
                     "peak_flops_per_device": peak_flops},
        "precision": "bf16/fp16 mixed" if setup.mixed else "fp32", "attention": setup.kernel,
        "zero_stage": stage, "activation_checkpointing": checkpointing, "seq_len": seq_len, "micro_batch": micro,
        "memory": per_stage, "memory_per_gpu_gib": chosen["total_gib"], "fits": chosen["fits"],
        "headroom_gib": round(_gib(setup.device_bytes) - chosen["total_gib"], 2),
        "max_micro_batch": chosen["max_micro_batch"], "grad_accum": accum, "tokens_per_step": tokens_per_step,
    }
    plan["would_fit"] = [] if chosen["fits"] else alternatives(args, setup, int(stage[4]) if stage in OFFLOAD else stage,
                                                               micro, seq_len, checkpointing)
    for name, s in zip(per_stage, (*STAGES, *OFFLOAD)):  # the offload rows' host memory per node, and the chosen's
        if s in OFFLOAD or (s == stage and offload_devices(s, setup.zero)):
            per_stage[name]["host_per_node_gib"] = _gib(host_need(args, setup, s, micro, seq_len, checkpointing,
                                                                  accum)[1])
    plan.update(offload_summary(args, setup, stage, micro, seq_len, checkpointing, accum))
    plan["sequence_parallel"] = sequence_summary(args, setup, stage, micro, seq_len, checkpointing, accum)
    plan.update(budget(counts["total"], fpt, tokens_per_step, setup.world, peak_flops, mfu, total_tokens,
                       max_hours, budget_usd, gpu_hour_usd, max_steps, tokens_set_length,
                       (plan["offload_traffic"]["seconds_per_step"] or 0.0)
                       + (plan["sequence_parallel"]["all_to_all"]["seconds_per_step"] or 0.0)))
    plan["verdict"] = verdict(plan)
    return plan


def alternatives(args, setup: Setup, stage: int, micro: int, seq_len: int, checkpointing: bool) -> list[dict]:
    """What would fit instead, smallest change first: activation checkpointing, a higher ZeRO stage
    (with and without it), a smaller micro-batch (grad accum grows to keep the global batch), more
    GPUs (whole nodes). Each entry: the change and its memory per GPU."""
    out = []

    def add(change: str, s, mb, ac, st=setup):
        m = memory(args, st, s, mb, seq_len, ac)["total"]
        if m <= st.device_bytes:
            out.append({"change": change, "memory_per_gpu_gib": _gib(m)})

    ac_name = "activation checkpointing"
    if not checkpointing:
        add(ac_name, stage, micro, True)
    # long rows: flex instead of sdpa's T x T mask per row, and more ranks per row (sequence parallelism)
    sizes = [n for n in sequence_parallel_sizes(args, setup.world, seq_len) if n > setup.sequence_parallel]
    kinds = [(f"--sequence-parallel {n}", replace(setup, sequence_parallel=n)) for n in sizes]
    if setup.kernel == "sdpa":  # flex (and varlen) keep no mask; sdpa keeps one of T x T per row on every rank
        flex = replace(setup, attention="flex")
        kinds = [("--attention flex", flex)] + kinds + [
            (f"--attention flex + --sequence-parallel {n}", replace(flex, sequence_parallel=n)) for n in sizes]
    for change, st in kinds:
        n = len(out)
        add(change, stage, micro, checkpointing, st)
        if len(out) == n and not checkpointing:
            add(f"{change} + {ac_name}", stage, micro, True, st)
    for s in range(stage + 1, 4):
        add(f"ZeRO-{s}", s, micro, checkpointing)
        if not checkpointing:
            add(f"ZeRO-{s} + {ac_name}", s, micro, True)
    for s, ac in ((stage, checkpointing), (3, True)):
        mb = max_micro_batch(args, setup, s, seq_len, ac)
        if 1 <= mb < micro:
            add(f"micro-batch {mb}" if (s, ac) == (stage, checkpointing) else f"ZeRO-3 + {ac_name} + micro-batch {mb}",
                s, mb, ac)
            break
    for variant, flag, s in (("zero2_offload", "ZeRO-2 + --offload optimizer", 2), ("zero3_offload",
                                                                                   "ZeRO-3 + --offload all", 3)):
        if s >= stage and not out:  # offload trades speed for memory: offered when nothing faster fits
            add(flag + (f" + {ac_name}" if not checkpointing else ""), variant, micro, True)
    if not out:  # not even one row fits: the longest row that would, at micro-batch 1
        for s, ac in ((stage, checkpointing), (3, True)):
            lo, hi = 0, seq_len
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if memory(args, setup, s, 1, mid, ac)["total"] <= setup.device_bytes else (lo, mid)
            if lo >= 1:
                how = "" if (s, ac) == (stage, checkpointing) else f"ZeRO-3 + {ac_name} + "
                m = memory(args, setup, s, 1, lo, ac)["total"]
                out.append({"change": f"{how}micro-batch 1 x seq-len {lo}", "memory_per_gpu_gib": _gib(m)})
                break
    if not out and stage > 0:  # ZeRO-0 keeps everything on every rank: more GPUs never help it
        for s, ac in ((stage, checkpointing), (3, True)):
            for nodes in range(setup.nodes + 1, setup.nodes * 1024 + 1):
                more = replace(setup, nodes=nodes)
                if memory(args, more, s, micro, seq_len, ac)["total"] <= setup.device_bytes:
                    how = "" if (s, ac) == (stage, checkpointing) else f" with ZeRO-3 + {ac_name}"
                    add(f"{more.world} GPUs ({nodes} nodes of {setup.gpus_per_node}){how}", s, micro, ac, more)
                    break
            if out:
                break
    return out


def budget(params: int, fpt: float, tokens_per_step: int, world: int, peak: float | None, mfu: float | None,
           total_tokens, max_hours, budget_usd, gpu_hour_usd, max_steps, tokens_set_length=False,
           comm_s_per_step: float = 0.0) -> dict:
    """Steps, tokens, hours and dollars; the binding limit is the one that allows the fewest tokens.
    `comm_s_per_step`: the seconds per step not overlapped with compute (the host link's with offload, the
    sequence-parallel all-to-all's), added to the compute's."""
    out = {"mfu": mfu, "tokens_per_s": None}
    tps = mfu * peak * world / fpt if peak and mfu else None
    if tps is not None and comm_s_per_step:
        tps = tokens_per_step / (tokens_per_step / tps + comm_s_per_step)
    limits = {}
    if total_tokens is not None:
        limits["total_tokens"] = total_tokens
    if tps is not None:
        if max_hours is not None:
            limits["max_hours"] = max_hours * 3600 * tps
        if budget_usd is not None and gpu_hour_usd:
            limits["budget_usd"] = budget_usd / (gpu_hour_usd * world) * 3600 * tps
    if limits:
        binding = min(limits, key=limits.get)
        steps = int(limits[binding] // tokens_per_step)
        if binding == "total_tokens" and tokens_set_length:  # the run's length: rounded up to a whole last step
            steps = -(-total_tokens // tokens_per_step)
    else:
        binding, steps = "max_steps", max_steps or 0
    tokens = steps * tokens_per_step
    out.update(binding=binding, steps=steps, tokens=tokens, tokens_per_param=round(tokens / params, 3),
               chinchilla_tokens_per_param=CHINCHILLA_TOKENS_PER_PARAM)
    if tps is not None:
        hours = tokens / tps / 3600
        out.update(tokens_per_s=round(tps, 1), hours=round(hours, 2),
                   usd=round(hours * world * gpu_hour_usd, 2) if gpu_hour_usd else None)
    else:
        out.update(hours=None, usd=None)
    compute = 6 * params * tokens  # Chinchilla's C = 6 N D on the plan's own N and D
    n_opt = math.sqrt(compute / (6 * CHINCHILLA_TOKENS_PER_PARAM)) if compute else 0
    out["compute_optimal"] = {"flops": compute, "params": round(n_opt),
                              "tokens": round(CHINCHILLA_TOKENS_PER_PARAM * n_opt)}
    return out


def host_need(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
              grad_accum: int) -> tuple[dict, float]:
    """(host_memory's components, the bytes a node's host memory must hold): the offloaded state and the ranks'
    own memory; on a CPU node, where host and device are the same RAM, the ranks' device memory as well."""
    host = host_memory(args, setup, stage, grad_accum)
    need = host["total"]
    if setup.cpu and offload_devices(stage, setup.zero):
        need += setup.gpus_per_node * memory(args, setup, stage, micro, seq_len, checkpointing)["total"]
    return host, need


def offload_summary(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
                    grad_accum: int) -> dict:
    """The plan's `host_memory` (GiB per node by component, the node's need, the host's size, what is offloaded
    where, whether it fits) and `offload_traffic` (GB per step per GPU, the link's GB/s, the seconds it adds)."""
    host, need = host_need(args, setup, stage, micro, seq_len, checkpointing, grad_accum)
    traffic = offload_traffic(args, setup, stage, grad_accum, checkpointing)
    return {"host_memory": {**{f"{k}_gib": _gib(v) for k, v in host.items()}, "per_node_gib": _gib(need),
                            "host_memory_gib": None if setup.host_bytes is None else _gib(setup.host_bytes),
                            "offloaded": offload_devices(stage, setup.zero),
                            "fits": setup.host_bytes is None or need <= setup.host_bytes},
            "offload_traffic": {"gb_per_step_per_gpu": round(traffic["bytes_per_gpu"] / 1e9, 3),
                                "host_link_gb_s": None if setup.host_link_bytes_per_s is None
                                else setup.host_link_bytes_per_s / 1e9,
                                "seconds_per_step": 0.0 if setup.cpu else traffic["seconds"]}}


def verdict(plan: dict) -> str:
    """One line: fits (with headroom) or not (by how much, and what would); an offloaded run that fits its
    devices but not its host says that."""
    hw = plan["hardware"]
    host = plan.get("host_memory") or {}
    if plan["fits"] and not host.get("fits", True):
        return host_verdict(host["per_node_gib"] * GiB, host["host_memory_gib"] * GiB,
                            "a node (zerotrain.hardware.host_memory_gib)")
    unit = "rank" if hw["accelerator"] == "cpu" else "GPU"
    stage = STAGE_LABELS.get(plan["zero_stage"], plan["zero_stage"])
    where = f"ZeRO-{stage}{' + activation checkpointing' if plan['activation_checkpointing'] else ''}," \
            f" micro-batch {plan['micro_batch']} x {plan['seq_len']}, {hw['world']} x {_size(hw['device_memory_gib'])}"
    need = plan["memory_per_gpu_gib"]
    if plan["fits"]:
        return f"fits: {_size(need)} per {unit} ({where}), headroom {_size(plan['headroom_gib'])}, largest" \
               f" micro-batch {plan['max_micro_batch']}"
    alts = "; ".join(f"{a['change']} ({_size(a['memory_per_gpu_gib'])})" for a in plan["would_fit"][:4])
    return f"does not fit: needs {_size(need)} per {unit} ({where}), short by {_size(-plan['headroom_gib'])}; " + \
        (f"would fit: {alts}" if alts else "nothing tried fits: a smaller model")


def render(plan: dict) -> str:
    """The plan as the table `zerotrain plan` prints."""
    m, hw = plan["model"], plan["hardware"]
    lines = [f"model: {m['layers']} layers x {m['dim']} (heads {m['heads']}, kv {m['kv_heads']}, ffn {m['ffn_hidden']},"
             f" vocab {m['vocab_size']}): {plan['params_total']:,} params ({plan['params_non_embedding']:,}"
             f" non-embedding), {plan['flops_per_token']:.3e} training FLOPs/token at seq {plan['seq_len']}",
             f"hardware: {hw['world']} x {hw['accelerator']} ({hw['nodes']} node(s)), {hw['device_memory_gib']} GiB"
             f" each, {plan['precision']}, attention {plan['attention']}; batch {plan['micro_batch']} x"
             f" {plan['grad_accum']} x {hw['world'] // plan['sequence_parallel']['size']} x"
             f" {plan['seq_len']} = {plan['tokens_per_step']:,} tokens/step", "",
             "| ZeRO | model states | buffers | activations | context | fragm. | total GiB | fits | max micro |",
             "|---|---|---|---|---|---|---|---|---|"]
    ac = " + AC" if plan["activation_checkpointing"] else ""
    for name, r in plan["memory"].items():
        label = STAGE_LABELS.get(
            name, name[4:]) + ac + (" (chosen)" if name in (plan["zero_stage"], f"zero{plan['zero_stage']}") else "")
        lines.append(f"| {label} | {r['model_states_gib']} | {r['buffers_gib']} | {r['activations_gib']} |"
                     f" {r['context_gib']} | {r['fragmentation_gib']} | {r['total_gib']} |"
                     f" {'yes' if r['fits'] else 'no'} | {r['max_micro_batch']} |")
    lines += [""] + render_offload(plan) + render_sequence(plan) + [""]
    if plan["hours"] is not None:
        usd = f", ${plan['usd']:,.0f}" if plan["usd"] is not None else ""
        extra = {what: seconds for what, seconds in (
            ("offload traffic", (plan.get("offload_traffic") or {}).get("seconds_per_step")),
            ("all-to-all", (plan.get("sequence_parallel") or {}).get("all_to_all", {}).get("seconds_per_step")))
            if seconds}
        traffic = " with " + " and ".join(f"{v:.3g} s per step of {k}" for k, v in extra.items()) if extra else ""
        lines.append(f"time: {plan['steps']:,} steps = {plan['tokens']:,} tokens ({plan['binding']} binds) at MFU"
                     f" {plan['mfu']} of {hw['peak_flops_per_device']:.3g} FLOP/s per device ="
                     f" {plan['tokens_per_s']:,.0f} tokens/s{traffic}: {plan['hours']:,} h{usd}")
    else:
        lines.append(f"time: {plan['steps']:,} steps = {plan['tokens']:,} tokens (no peak FLOP/s: give a --profile or"
                     " --peak-tflops for hours and dollars)")
    co = plan["compute_optimal"]
    lines.append(f"tokens per parameter: {plan['tokens_per_param']} (Chinchilla ~{CHINCHILLA_TOKENS_PER_PARAM});"
                 f" compute-optimal for C = 6ND = {co['flops']:.3g} FLOPs: {_count(co['params'])} params on"
                 f" {_count(co['tokens'])} tokens")
    lines.append(plan["verdict"])
    return "\n".join(lines)


def render_sequence(plan: dict) -> list[str]:
    """The sequence-parallel lines: N, the all-to-all per layer and per step over the slowest link the group
    spans, and the longest row that fits at micro-batch 1."""
    sp = plan.get("sequence_parallel")
    if not sp:
        return []
    a, n = sp["all_to_all"], sp["size"]
    valid = ", ".join(map(str, sp["valid_sizes"]))
    if n == 1:
        lines = [f"sequence parallel: off (--sequence-parallel N; for this model, world and row N may be {valid})"]
    else:
        recompute = " and the recomputation" if plan["activation_checkpointing"] else ""
        when = (f"at {a['link_gb_s']:g} GB/s {a['link']}: {a['seconds_per_layer'] * 1e3:.3g} ms per layer,"
                f" {a['seconds_per_step']:.3g} s per step, not overlapped (an upper bound), in the time below"
                if a["link_gb_s"] is not None else f"{a['link']}: no bandwidth in the profile, not in the time")
        unit = "rank" if plan["hardware"]["accelerator"] == "cpu" else "GPU"
        lines = [f"sequence parallel: {n} ranks per row (N may be {valid}); all-to-all per {unit} per layer:"
                 f" {a['gb_per_layer_forward']:g} GB forward (q, k, v, output; (N-1)/N of each), {a['gb_per_layer']:g}"
                 f" GB with the backward{recompute}; {a['gb_per_step_per_gpu']:g} GB per step {when}"]
    stage = STAGE_LABELS.get(plan["zero_stage"], plan["zero_stage"])
    lines.append(f"longest row that fits at micro-batch 1 (ZeRO-{stage}, {plan['attention']}, N = {n}):"
                 f" {sp['max_seq_len']:,} positions" + ("" if plan["activation_checkpointing"] else
                                                        f", {sp['max_seq_len_with_ac']:,} with activation checkpointing"))
    return lines


def render_offload(plan: dict, rows: bool = True) -> list[str]:
    """The host-memory and host-link lines: with `rows` (`zerotrain plan`) each offload row's host memory per
    node first; for an offloaded run its components and traffic (--dry-run and the start-up too)."""
    h, t = plan["host_memory"], plan["offload_traffic"]
    of = f" of {_size(h['host_memory_gib'])}" if h["host_memory_gib"] is not None else \
        " (host size unknown: zerotrain.hardware.host_memory_gib)"
    lines = []
    if rows:
        per_row = {STAGE_LABELS.get(name) or f"{name[4:]} + {' + '.join(h['offloaded'])} offload":
                   r["host_per_node_gib"] for name, r in plan["memory"].items() if "host_per_node_gib" in r}
        lines.append("host memory per node, offload rows: "
                     + "; ".join(f"ZeRO-{k} {_size(v)}" for k, v in per_row.items()) + of)
    if h["offloaded"]:
        where = ", ".join(f"{what} -> {device}" for what, device in h["offloaded"].items())
        lines.append(f"host memory (offload: {where}): {_size(h['per_node_gib'])} per node{of}"
                     f" (optimizer {h['optimizer_gib']}, gradients {h['gradients_gib']}, parameters"
                     f" {h['parameters_gib']}, buffers {h['buffers_gib']}, ranks' own {h['processes_gib']} GiB"
                     + (", the ranks' device memory: the same RAM" if plan["hardware"]["accelerator"] == "cpu" else "")
                     + ")" + ("" if h["fits"] else ": does not fit"))
        if plan["hardware"]["accelerator"] == "cpu":
            lines.append("offload traffic: none over a bus on a CPU node (host and device are the same RAM); the"
                         " time below is the compute's")
        else:
            link = (f"at {t['host_link_gb_s']:g} GB/s (zerotrain.hardware.host_link_gb_s):"
                    f" +{t['seconds_per_step']:.3g} s per step, not overlapped (an upper bound), in the time below"
                    if t["host_link_gb_s"] is not None else
                    "(no host link bandwidth in the profile: zerotrain.hardware.host_link_gb_s; not in the time)")
            lines.append(f"offload traffic: {t['gb_per_step_per_gpu']:g} GB per step per GPU over its host link"
                         f" {link}; CPU Adam's time and NVMe I/O not counted")
    return lines


# ------------------------------------------------------------------------------------------------
# `zerotrain plan`
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# The driver asks the planner first
# ------------------------------------------------------------------------------------------------

def device_memory_here(accelerator: str, local_world: int) -> tuple[float, str, str]:
    """(bytes this rank may use, "cuda" or "cpu", what that is): the GPU's total memory, or the RAM
    available now divided among this node's ranks."""
    if accelerator != "cpu":
        node = Node.here()
        if node.device == "cuda":
            return node.memory, "cuda", f"{node.name}, {node.memory / GiB:.1f} GiB"
    ram = available_ram()
    return ram / local_world, "cpu", f"{ram / GiB:.1f} GiB RAM available / {local_world} local rank(s)"


def planned_here(cfg, model_args, ds_config: dict, knobs: dict, world: int,
                 attention: str | None = None) -> tuple[dict, "Setup", str]:
    """(the run's planned memory per rank by component, the Setup, what the device is in words) on this node's
    device: what fit_check refuses on, and what an out-of-memory end names as the planned peak."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    hw = knobs.get("hardware") or {}
    device_bytes, accel, what = device_memory_here(hw.get("accelerator", "cuda"), local_world)
    nodes = max(1, world // max(1, local_world))
    hardware = {**hw, "accelerator": accel}
    setup = setup_from(ds_config, {**knobs, "hardware": hardware}, world=max(1, world // nodes) * nodes, nodes=nodes,
                       device_bytes=device_bytes, optimizer=getattr(cfg, "optimizer", None), args=model_args,
                       attention=attention)
    ac = bool(knobs.get("activation_checkpointing"))
    micro = ds_config["train_micro_batch_size_per_gpu"]
    return memory(model_args, setup, stage_key(ds_config), micro, cfg.seq_len, ac), setup, what


def fit_check(cfg, model_args, ds_config: dict, knobs: dict, world: int, attention: str | None = None) -> dict:
    """Refuse (UsageError, the planner's one-line verdict) a resolved run that cannot fit on this device.

    Called by launcher/run_plan.py plan_run before anything is built or written; skipped with
    --no-fit-check. `attention`: the kernel the driver resolved for this node (None: the profile's, else
    auto); `knobs`: the run's resolved settings (hardware, activation_checkpointing). Returns the chosen
    stage's memory by component (bytes).
    """
    m, setup, what = planned_here(cfg, model_args, ds_config, knobs, world, attention)
    device_bytes, accel = setup.device_bytes, setup.accelerator
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    ac = bool(knobs.get("activation_checkpointing"))  # resolved once (launcher/settings.py): flag | profile | off
    micro = ds_config["train_micro_batch_size_per_gpu"]
    if m["total"] > device_bytes:
        plan = {"hardware": {"world": setup.world, "device_memory_gib": _gib(device_bytes), "accelerator": accel},
                "zero_stage": stage, "activation_checkpointing": ac, "micro_batch": micro, "seq_len": cfg.seq_len,
                "memory_per_gpu_gib": _gib(m["total"]), "fits": False,
                "headroom_gib": round(_gib(device_bytes) - _gib(m["total"]), 2),
                "would_fit": alternatives(model_args, setup, stage, micro, cfg.seq_len, ac)}
        raise UsageError(f"{verdict(plan)} [{what}; `zerotrain plan` for the table; --no-fit-check to try anyway]")
    host_check(model_args, replace(setup, host_bytes=available_ram()), stage_key(ds_config), micro, cfg.seq_len, ac,
               ds_config.get("gradient_accumulation_steps", 1), "this node's RAM available now")
    return m


def host_check(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool, grad_accum: int,
               what: str) -> None:
    """Refuse (UsageError, one line) an offloaded run whose state a node's host memory (setup.host_bytes; None:
    unknown, not checked) cannot hold: the driver's fit check (the RAM available now) and --dry-run (the
    profile's zerotrain.hardware.host_memory_gib)."""
    if not offload_devices(stage, setup.zero):
        return
    need = host_need(args, setup, stage, micro, seq_len, checkpointing, grad_accum)[1]
    problem = host_verdict(need, setup.host_bytes, what)
    if problem:
        raise UsageError(f"{problem} [`zerotrain plan` for the table; --no-fit-check to try anyway]")


def offload_lines(args, ds_config: dict, knobs: dict, world: int, seq_len: int, attention: str | None,
                  refuse: bool) -> list[str]:
    """The start-up's and --dry-run's host-memory and traffic lines for an offloaded run, on the profile's
    hardware (none without offload); `refuse` (a dry run): UsageError, one line, when the profile's host memory
    (zerotrain.hardware.host_memory_gib) cannot hold it."""
    hw = knobs.get("hardware") or {}
    if not offload_devices(stage_key(ds_config), ds_config.get("zero_optimization") or {}):
        return []
    nodes = hw.get("nodes", 1)
    setup = setup_from(ds_config, knobs, world=world, nodes=nodes if world % nodes == 0 else 1,
                       device_bytes=float(hw.get("device_memory_gib", 1)) * GiB, attention=attention)
    micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config.get("gradient_accumulation_steps", 1)
    ac = bool(knobs.get("activation_checkpointing"))
    stage = stage_key(ds_config)
    if refuse:
        host_check(args, setup, stage, micro, seq_len, ac, accum, "a node (zerotrain.hardware.host_memory_gib)")
    return render_offload({"hardware": {"accelerator": setup.accelerator},
                           **offload_summary(args, setup, stage, micro, seq_len, ac, accum)}, rows=False)
