"""Activation memory of our block (modeling/model.py): what autograd keeps for one micro-batch and the peak over
it, for the attention kernel the run gets (`--attention`, or the profile's `zerotrain.attention`; auto: varlen on a
GPU in 16-bit, sdpa otherwise, modeling/sizes.py `choose_attention`; the fit check uses the kernel the driver
resolved). The formula is in the docstrings of `activation_bytes` and `block_bytes`, checked against the tensors
autograd really saves in tests/test_planner.py."""
from __future__ import annotations

from dataclasses import dataclass

from zerotrain.launcher.profiles import precision
from zerotrain.modeling.attention import KERNELS
from zerotrain.modeling.sizes import loss_chunk_tokens, math_kernel, mlp_tiles


@dataclass(frozen=True)
class Activations:
    """Bytes of activations per rank for one micro-batch."""
    saved: float  # what autograd keeps from the forward to the backward
    transient: float  # the larger of the loss's chunk and one block's backward, on top of `saved`
    block_per_token: float  # one block's saved bytes per token (without checkpointing)
    loss_chunk: int  # tokens per chunk of the chunked loss

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def activation_bytes(args, micro: int, seq_len: int, act_bytes: int, checkpointing: bool,
                     attention: str, device_type: str = "cpu", sequence_parallel: int = 1,
                     tiled_mlp: bool = False, compiled: bool = False) -> Activations:
    """Bytes of activations per rank for one micro-batch: what autograd keeps, and the peak.

    One block's bytes per token: `block_bytes` (a = 2 (bf16/fp16) or 4 (fp32) bytes, d = dim, h = head dim,
    H / KV heads, V the padded vocabulary, T = seq len). Per token once: final norm 8·d + 4 (its output is not
    kept: the chunked loss keeps its gradient instead, a·d), rotary cos and sin 2·a·h, the input ids 8, and under
    sdpa where documents share a row (the driver's packed rows) the block-diagonal mask, boolean T and as a float
    a·T (modeling/model.py `additive_mask`: made once per forward, every block's sdpa shares and keeps it; a
    checkpoint input; the math kernel keeps no mask, so unchecked the float one dies with the forward). Per
    micro-batch once: the head's weight gradient, a·V·d: the chunked loss (modeling/loss.py
    `chunked_next_token_loss`) computes its gradients in forward and keeps no logits; flex's BlockMask
    (`flex_block_mask_bytes`). With sequence parallelism over N ranks every per-token term counts this rank's T/N
    positions; the sdpa masks span the whole row (a·T·N and T·N), as do the input ids the embedding keeps (8·N: a
    slice of the whole row's).
    Saved (no checkpointing) = tokens × (n_layers × block + once) + a·V·d. With activation checkpointing
    each block keeps only its input: tokens × (n_layers × a·d + once) + a·V·d.
    Peak = saved + the larger of two transients: at the loss, one chunk of c tokens (c = `loss_chunk`: ~261
    tokens at V = 128,256 on a CPU, more on an accelerator, at most the micro-batch): its fp32 logits, worked on in
    place, and in 16-bit one 16-bit copy (the product before its cast, the gradient's cast), (4 + a)·c·V in 16-bit
    and 4·c·V in fp32; and in 16-bit the fp32 accumulator of the weight gradient and one chunk's 16-bit product
    (4 + a)·V·d; in backward, one block's gradients (one block's activations; with checkpointing two: the
    recomputed block and its gradients), with the math kernel's workspace and TiledMLP's recomputed tile
    (`tiled_mlp_backward_bytes`).
    """
    d, H, h, V, T, a, n = args.dim, args.n_heads, args.head_dim, args.vocab_size, seq_len, act_bytes, sequence_parallel
    if attention not in KERNELS:
        raise ValueError(f"activation_bytes: attention must be a kernel ({_kernel_names()}), got {attention!r}")
    kernel = KERNELS[attention]
    math = math_kernel(attention, device_type, args.n_kv_heads < H)
    block, swiglu = block_bytes(args, a, T, math, n, tiled_mlp, compiled)
    # sdpa's masks: the boolean one, and its float form unless the math kernel (which keeps no mask) runs unchecked
    masks = (T * n + (a * T * n if checkpointing or not math else 0)) if kernel.row_mask else 0
    once = 8 * d + 4 + a * d + 2 * a * h + 8 * n + masks
    tokens = micro * seq_len // n
    head_grad = a * V * d
    kept_per_block = a * d if checkpointing else block
    block_mask = flex_block_mask_bytes(micro, T) if kernel.block_mask else 0
    saved = tokens * (args.n_layers * kept_per_block + once) + head_grad + block_mask
    kernel_workspace = 4 * H * T if math else 4 * H if kernel.accelerator_workspace and device_type != "cpu" else 0
    backward = tokens * ((2 if checkpointing else 1) * block + kernel_workspace)
    backward += tiled_mlp_backward_bytes(tokens, a, d, swiglu, T // n) if tiled_mlp else 0
    head_accumulator = (4 + a) * V * d if a < 4 else 0
    per_logit = 4 + (a if a < 4 else 0)
    chunk = loss_chunk(V, tokens, backward - head_accumulator, device_type, per_logit)
    at_loss = per_logit * chunk * V + head_accumulator
    transient = max(at_loss, backward)
    return Activations(saved, transient, block, chunk)


def block_bytes(args, a: int, T: int, math: bool, n: int, tiled_mlp: bool, compiled: bool) -> tuple[int, int]:
    """(what autograd keeps of one block (modeling/model.py `Block`) per token, the SwiGLU's intermediates per
    token): the second is left out of the first under --tiled-mlp, whose backward recomputes it a tile at a time.

    With a = 2 (bf16/fp16) or 4 (fp32) bytes, d = dim, f = ffn hidden, H / KV heads of head dim h, T = seq len:

        2 RMSNorms    2·(8 + a)·d    fp32 input (4d; the input itself when a = 4), fp32 normalised (4d),
                                     output (a·d, held by the projections after it)
        attention     a·(2d + 2·KV·h) + 4H   q, k, v (KV heads: every kernel takes GQA as it is), output,
                                             fp32 log-sum-exp (varlen, flex, and sdpa)
        math kernel   a·d + 4·H·(3h + T)     instead of both lines above, where sdpa is PyTorch's math kernel
                                             (`math`: CUDA, packed rows, GQA: sizes.math_kernel): q, k and v
                                             upcast to fp32 with the kv heads repeated, and the (B, H, T, T) fp32
                                             softmax, kept by every layer until its backward
        SwiGLU        4·a·f          gate, silu(gate), up, their product
        + 8                          the norms' rsqrt
        QK-norm       (8h + 4)·(H + KV)   each head's fp32 input and normalised value (the output is not kept:
                                          the rotation after it needs only cos and sin)

    With sequence parallelism over n ranks (modeling/model.py SequenceShard), per position: the kernel's k and v
    after the exchange hold max(KV, n) heads (fewer kv heads than n are repeated), and the kernel's head-split
    output and o_proj's sequence-split input are two tensors (+ a·d); the math kernel's terms hold as they are
    (H/n heads over the whole row = H heads per local token).
    With --tiled-mlp (DeepSpeed's TiledMLP: the MLP's forward under no_grad, tile by tile, keeping only its
    input, which is the norm's output counted above) the SwiGLU's 4·a·f per position is not kept; its backward
    recomputes one tile at a time (`tiled_mlp_backward_bytes`; an estimate: the autograd test checks what is
    saved, not the backward).
    Compiled blocks (`compiled`: --compile, a CUDA profile's zerotrain.compile; engine.compile_blocks): inductor's
    partitioner keeps each norm's input and rsqrt, 2·(a·d + 4), instead of its fp32 copies, three of the SwiGLU's
    four (f)-wide tensors, 3·a·f, and each QK-norm's input and rsqrt, (a·h + 4)·(H + KV): what autograd kept of
    a compiled block on the CPU in bf16 (16·d + a·f per token less than eager, dim 256/512, ffn 704/1408); on one
    H200 (2026-11-27, xlarge, micro-batch 8 x 2048) this planned 54.4 GiB of tensors against 49.3-51.2 GiB
    allocated, where the eager terms planned 74.4 (the eager run held 67.4).
    """
    d, f, H, KV, h = args.dim, args.ffn_hidden, args.n_heads, args.n_kv_heads, args.head_dim
    norms = 2 * (a * d + 4) if compiled else 2 * (8 + a) * d
    kernel_kv = KV if n == 1 else max(KV, n)
    attn = (a * d + 4 * H * (3 * h + T) if math
            else a * (2 * d + 2 * kernel_kv * h) + 4 * H) + (a * d if n > 1 else 0)
    qk_norm = ((a * h + 4) if compiled else (8 * h + 4)) * (H + KV) if args.qk_norm else 0  # per head
    swiglu = (3 if compiled else 4) * a * f
    return norms + attn + qk_norm + (0 if tiled_mlp else swiglu) + 8, swiglu


def _kernel_names() -> str:
    """"sdpa, flex or varlen": the registry's kernels (modeling/attention.py KERNELS), as a message lists them."""
    names = list(KERNELS)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


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
                            checkpointing, attention, device_type, sequence_parallel, tiled_mlp).loss_chunk
