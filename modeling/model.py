"""A Llama-style decoder-only transformer: our own modules, Llama-compatible weight names.

Architecture choices, all of them:
- token embedding -> n_layers x [RMSNorm -> grouped-query attention -> residual,
  RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> linear head (optionally tied);
- rotary position embeddings computed from per-token ``position_ids`` (so packed rows whose
  positions restart at 0 at every document get correct rotations), in the Hugging Face
  ``rotate_half`` layout, so q/k weights map to HF Llama without a permutation; Llama 3.1's ``llama3``
  frequency scaling when ModelArgs.rope_scaling gives it (`rope_inv_freq`);
- optional QK-norm: an RMSNorm over each head's query and key before the rotation (Qwen3's
  placement, so such a model exports as ``Qwen3ForCausalLM``);
- attention never crosses a document boundary. `DocumentLayout.from_positions` is the one place
  boundaries are derived from ``position_ids`` (a document starts wherever the position is 0, and
  at the start of every row), in the form the chosen kernel takes (`Transformer.attention`, one of
  `ATTENTION_BACKENDS`; `resolve_attention` says which runs where):
  ``sdpa``  scaled_dot_product_attention, ``is_causal`` and no mask when every row is one document,
            a (B, 1, T, T) block-diagonal mask only when documents share a row; GQA in the kernel;
  ``flex``  flex_attention with a block-causal document mask (torchtitan's form), compiled on a GPU;
  ``varlen`` PyTorch's own variable-length flash kernel (torch.nn.attention.varlen, CUDA in 16-bit
            only) over documents laid end to end with ``cu_seqlens``; GQA in the kernel;
  all three are the same math (tests/test_attention.py); each is one entry of modeling/attention.py's
  KERNELS (where it runs, its mask form, its memory terms), which sizes, the planner and the run read too;
- the loss never holds (B, T, V) logits: `LMHead` computes the output projection and the
  cross-entropy in chunks of tokens, and its gradients with them (modeling/loss.py `chunked_next_token_loss`);
- optional Ulysses sequence parallelism (`SequenceShard`, set by the engine builder): N ranks share
  every row, each embeds, projects and takes the loss of its own T/N positions; around the attention
  kernel an all-to-all swaps the sequence split for a head split (`sequence_to_heads`, `heads_to_sequence`),
  so the kernel sees whole rows of H/N heads. Every rank gets the full row's ``position_ids`` and labels:
  document masks are derived from the whole row, and the loss of a shard is normalised by the labelled
  tokens of the whole row group (the sum over the N ranks is the unsharded loss);
- optional tiled MLP (`MLP.tiled`, set by the engine builder): each MLP computed over tiles of positions
  (`mlp_tiles`) and recomputed in backward, the same math (to rounding in the weight gradients);
- RMSNorm is computed in fp32; no biases anywhere; weights initialised in `init_weights` only
  (modeling/initial.py: the rule, its generator, and building a model whose weights a load writes).

This file is the model: no optimizer, no data, no DeepSpeed. Its sizes (`ModelArgs`, `PRESETS`, `preset`) and their arithmetic (`count_params`,
`flops_per_token`) are in modeling/sizes.py, which imports no torch (the light commands `zerotrain plan`
and `params` use them), and are importable from here too; the Hugging Face conversion is modeling/hf.py.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from zerotrain import ds_attributes, torch_private
from zerotrain.modeling.attention import KERNELS
from zerotrain.modeling.initial import drawing, init_weights
from zerotrain.modeling.loss import IGNORE_INDEX, chunked_target_loss, next_token_targets
from zerotrain.modeling.sizes import (ATTENTION_BACKENDS, LOSS_CHUNK_BYTES, PRESETS, ModelArgs,  # noqa: F401
                                      check_sequence_parallel, choose_attention, count_params, flops_per_token,
                                      loss_chunk_tokens, mlp_tiles, preset,
                                      varlen_available)  # sizes and which kernels run where, without torch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_inv_freq(head_dim: int, theta: float, device, scaling: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim/2,), fp32; with `scaling` (ModelArgs.rope_scaling, Llama 3.1's
    "llama3" type) rescaled exactly as transformers' `_compute_llama3_parameters` (modeling_rope_utils.py):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by factor, shorter
    than .../ high_freq_factor kept, the band between interpolated. Device ops only: no host sync."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype, scaling: dict | None = None):
    """cos/sin of shape (B, T, head_dim) for the given per-token positions (HF Llama layout)."""
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device, scaling)  # (head_dim/2,)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    # x: (B, T, n_heads, head_dim); cos/sin: (B, T, head_dim)
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


# -- attention: one document contract, three kernels ----------------------------------------------

PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_attention(name: str, device_type: str, dtype: torch.dtype) -> str:
    """The kernel `name` means for activations of `dtype` on `device_type` ("cuda", "cpu", ...), with
    this torch: modeling/sizes.py `choose_attention` (auto: varlen on CUDA in 16-bit, else sdpa; ValueError,
    one line, for a backend that cannot run here)."""
    return choose_attention(name, device_type, PRECISION.get(dtype, str(dtype).removeprefix("torch.")),
                            varlen_installed=varlen_available())


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts (position 0, or the first token of a row)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int: the index of each token's document within its row (1, 2, ...)."""
    return torch.cumsum(document_starts(position_ids).int(), dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, T, T), True where attention is allowed."""
    doc_ids = document_ids(position_ids)  # (B, T)
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal)[:, None]


def document_block_mask(position_ids: torch.Tensor) -> BlockMask:
    """flex_attention's block-causal document mask (torchtitan's form): a query sees the keys at or
    before it in its own document. Built compiled on a GPU (no (B, T, T) tensor); eagerly elsewhere."""
    doc_ids = document_ids(position_ids)  # (B, T)
    B, T = position_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(same_document_causal, B, None, T, T, device=position_ids.device,
                             _compile=position_ids.is_cuda)


def document_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """(n_docs + 1,) int32: where each document starts over the flattened (B*T) batch, and its end."""
    starts = document_starts(position_ids).flatten().nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([position_ids.numel()])]).to(torch.int32)


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries over the flattened (B*T) batch as (cu_seqlens int32, longest document)."""
    bounds = document_bounds(position_ids)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


class DocumentLayout(NamedTuple):
    """Where the documents of a batch are, in the form one kernel takes; derived once per forward.

    backend "sdpa": `mask` (B, 1, T, T), boolean, when documents share a row (the model's forward hands the blocks
    its `additive_mask`), None when every row holds one document (then is_causal, no mask at all). "flex": `block_mask`. "varlen": `cu_seqlens`
    (n_docs + 1,) int32 over the flattened batch and `max_seqlen`, the row length (a bound on the longest
    document: see from_positions).
    """

    backend: str
    mask: torch.Tensor | None = None
    block_mask: BlockMask | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @staticmethod
    def from_positions(position_ids: torch.Tensor, backend: str, device: torch.device | None = None) -> "DocumentLayout":
        """The one place document boundaries become masks or cu_seqlens (from position_ids alone).

        `device`: where the kernel runs, when position_ids are still on the host (the trainer's batch before
        its copy): the boundaries are then read on the host and only the result is copied (asynchronously
        from pinned memory), so the forward has no host sync. Without it, on position_ids' own device.
        """
        device = position_ids.device if device is None else torch.device(device)
        layout = KERNELS[backend].layout if backend in KERNELS else None  # modeling/attention.py: the kernel's form
        if layout == "cu_seqlens":
            # max_seqlen: the row length, a bound on the longest document. The flash kernel only sizes its grid
            # by it (blocks past a document's end exit at once); the same value for every batch keeps a compiled
            # block from specialising on it, and reading the longest document would be a host sync on a device.
            return DocumentLayout(backend, None, None, _to_device(document_bounds(position_ids), device),
                                  position_ids.shape[-1])
        if layout == "block_mask":
            return DocumentLayout(backend, block_mask=document_block_mask(_to_device(position_ids, device)))
        if layout != "mask":
            raise ValueError(f"unknown attention backend {backend!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
        # A row of one document needs no mask, and without one SDPA may take its flash kernel and never builds
        # the O(T^2) mask. Read on the host when position_ids are there; else one host sync per forward.
        shared = bool(document_starts(position_ids)[:, 1:].any())
        return DocumentLayout(backend, mask=document_mask(_to_device(position_ids, device)) if shared else None)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as sdpa's additive form, 0 or -inf in `dtype`: the values sdpa
    makes of a boolean mask itself (torch.where in its composite), but sdpa makes them in every call, forward and
    backward, and keeps its copy for backward in every layer; made once per forward, every block shares one
    (measured on the CPU, benchmarks/RESULTS.md 2026-11-27: two `where` over (B, 1, T, T) per layer and step)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the copy (pinned first, where the device is an accelerator)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type != "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sdpa_kernel(q, k, v, docs: DocumentLayout):
    """q (B, T, H, hd), k/v (B, T, KV, hd) -> (B, T, H, hd)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask, is_causal=docs.mask is None,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


_compiled_flex: dict[str, object] = {}  # torch.compile backend -> flex_attention compiled once per process


def flex_kernel(q, k, v, docs: DocumentLayout):
    """q (B, T, H, hd), k/v (B, T, KV, hd) -> (B, T, H, hd), through flex_attention and the document BlockMask."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
    if q.device.type == "cpu":  # eager, GQA handled by the operator
        return flex_on_cpu(q, k, v, docs.block_mask).transpose(1, 2)
    return compiled_flex(q, k, v, docs.block_mask).transpose(1, 2)


def compiled_flex(q, k, v, block_mask: BlockMask, backend: str = "inductor"):
    """flex_attention, compiled once per process, with the batch dimension dynamic. q (B, H, T, hd).

    Uncompiled, flex_attention materialises the (B, H, T, T) scores; compiled for each shape it meets,
    every new batch size (training, evaluation and its remainder, pre-flight's candidates) would add a
    graph, and past dynamo's recompile limit (torch._dynamo.config.recompile_limit) it would run eagerly
    again. So the batch dimension of the inputs and of the BlockMask's tensors is marked dynamic: one
    graph for every batch size (dynamo specialises a batch of 1, so two at the most).
    """
    if backend not in _compiled_flex:
        _compiled_flex[backend] = torch.compile(flex_attention, backend=backend)
    for t in (q, k, v, *block_mask.as_tuple(flatten=True)):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == q.shape[0]:
            torch_private.mark_dynamic(t, 0)
    return _compiled_flex[backend](q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def flex_on_cpu(q, k, v, block_mask: BlockMask):
    """flex_attention on a CPU, with a backward. q (B, H, T, hd), k/v (B, KV, T, hd) -> (B, H, T, hd).

    torch 2.13's public `flex_attention` refuses any CPU input that requires grad, compiled or not
    (`_validate_device` in torch/nn/attention/flex_attention.py). Its eager path runs the
    `flex_attention` higher-order operator, whose CPU implementation (`math_attention` and
    `sdpa_dense_backward` in torch/_higher_order_ops/flex_attention.py: fp32 scores, GQA by repeating
    k/v) has both passes; we call that operator directly, with the public function's defaults
    (no score modification, scale 1/sqrt(head dim)). Checked against torch 2.13.
    """
    flex_attention_op = torch_private.flex_attention_operator()
    out, _log2_sum_exp, _max = flex_attention_op(q, k, v, _identity_score, block_mask.as_tuple(),
                                                 q.shape[-1] ** -0.5, {})
    return out


def varlen_kernel(q, k, v, docs: DocumentLayout):
    """q (B, T, H, hd), k/v (B, T, KV, hd) -> (B, T, H, hd): documents end to end through the flash kernel."""
    from torch.nn.attention import varlen  # ~1 s to import: only when this kernel runs

    B, T = q.shape[:2]
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    accepts = _varlen_keywords(varlen.varlen_attn)
    # "causal" is window_size (-1, 0) since torch 2.11 (it compares the tuple), is_causal=True in 2.9/2.10.
    causal = {"window_size": (-1, 0)} if "window_size" in accepts else {"is_causal": True}
    if k.shape[1] == q.shape[1]:
        gqa = {}
    elif "enable_gqa" in accepts:  # torch >= 2.13: fewer kv heads go to the kernel as they are, never repeated
        gqa = {"enable_gqa": True}
    else:  # torch 2.9-2.12 has no enable_gqa (found on an H100 with torch 2.11): repeat the kv heads, as sdpa does
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = {}
    out = varlen.varlen_attn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen,
                             **causal, **gqa)
    return out.view(B, T, *out.shape[1:])  # out: (B*T, H, hd)


@functools.cache
def _varlen_keywords(fn) -> frozenset:
    """The keywords this torch's varlen_attn takes: its signature changed between 2.9, 2.11 and 2.13 (read once
    per process, not at every call)."""
    return frozenset(inspect.signature(fn).parameters)


# name -> kernel function, one per modeling/attention.py KERNELS entry (its `function`, defined above)
ATTENTION_KERNELS = {name: globals()[entry.function] for name, entry in KERNELS.items()}


class SequenceShard(NamedTuple):
    """Ulysses sequence parallelism as the model sees it: `size` ranks share every row; this rank holds
    positions [rank * T/size, (rank + 1) * T/size) of it. `exchange` is a differentiable all-to-all over
    dimension 0 (whose length is `size`) within those ranks: slice i goes to rank i, and slice i of the
    result came from rank i (DeepSpeed's: launcher/components/ds_compat/sequence.py sequence_all_to_all).
    `gradient_factor` multiplies the gradient (not the value) of this rank's loss share: the engine's
    gradient reduction divides the sum over all ranks by world/size in some DeepSpeed paths and by the
    whole world in others (ds_compat.sequence_parallel_gradient_factor says which, for the built engine)."""

    size: int
    rank: int
    exchange: Callable[[torch.Tensor], torch.Tensor]
    gradient_factor: float = 1.0

    def local(self, length: int) -> slice:
        """This rank's positions of a row of `length` (a multiple of size: the planner refuses others)."""
        if length % self.size:
            raise ValueError(f"sequence parallelism over {self.size} ranks needs a row length divisible by"
                             f" {self.size}, got {length}")
        step = length // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def sequence_to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(B, T/N, heads, hd) on each rank -> (B, T, heads/N, hd): rank g keeps heads [g*heads/N, (g+1)*heads/N)
    of every position of the row (the all-to-all before the attention kernel)."""
    B, local_len, heads, hd = x.shape
    n = shard.size
    x = x.reshape(B, local_len, n, heads // n, hd).permute(2, 0, 1, 3, 4)  # (N, B, T/N, heads/N, hd): group g -> rank g
    x = shard.exchange(x.contiguous())  # (N, B, T/N, heads/N, hd): slice s is rank s's stretch of the row
    return x.permute(1, 0, 2, 3, 4).reshape(B, n * local_len, heads // n, hd)


def heads_to_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """(B, T, heads/N, hd) -> (B, T/N, heads, hd): the inverse of sequence_to_heads (after the kernel)."""
    B, length, local_heads, hd = x.shape
    n = shard.size
    x = x.reshape(B, n, length // n, local_heads, hd).permute(1, 0, 2, 3, 4)  # (N, B, T/N, heads/N, hd): stretch s -> rank s
    x = shard.exchange(x.contiguous())  # (N, B, T/N, heads/N, hd): slice g is head group g, from rank g
    return x.permute(1, 2, 0, 3, 4).reshape(B, length // n, n * local_heads, hd)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else nn.Identity()

    def project(self, x):
        """q, k, v before the head split (benchmarks/projections.py swaps in one fused weight here)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, docs: DocumentLayout, shard: SequenceShard | None = None):
        B, T, _ = x.shape  # T: this rank's positions (the whole row without sequence parallelism)
        q, k, v = self.project(x)
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))  # (B, T, H, hd)
        k = self.k_norm(k.view(B, T, self.n_kv_heads, self.head_dim))  # (B, T, KV, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if shard is not None:
            if self.n_kv_heads < shard.size:  # each rank needs a kv head of its own: repeat them (their
                # gradients are summed back by repeat_interleave's backward); query head h still meets kv h // (H/KV)
                k, v = (t.repeat_interleave(shard.size // self.n_kv_heads, dim=2) for t in (k, v))
            q, k, v = (sequence_to_heads(t, shard) for t in (q, k, v))  # (B, N*T, heads/N, hd)
        out = ATTENTION_KERNELS[docs.backend](q, k, v, docs)  # (B, T, H, hd) or, sharded, (B, N*T, H/N, hd)
        if shard is not None:
            out = heads_to_sequence(out, shard)  # (B, T, H, hd)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        # --tiled-mlp: (this module, x, tiles) -> `compute` over `tiles` stretches of the positions, recomputed
        # in backward, so the (positions x ffn_hidden) intermediates are never held for the whole row (set by
        # the engine builder: DeepSpeed's TiledMLP, launcher/components/ds_compat/sequence.py tiled_mlp)
        self.tiled: Callable | None = None

    def forward(self, x):  # x: (B, T, dim), T this rank's positions
        if self.tiled is not None:
            return self.tiled(self, x, mlp_tiles(x.shape[-2], x.shape[-1]))
        return self.compute(x)

    def compute(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, docs: DocumentLayout, shard: SequenceShard | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, docs, shard)
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHead(nn.Linear):
    """The output projection (its weight is nn.Linear's: the state-dict key stays `lm_head.weight`, and
    tying assigns the embedding's Parameter to it). Given labels, its forward returns the next-token
    loss instead of the logits (`chunked_next_token_loss`). The loss is computed here, in this module's
    own forward, for ZeRO-3: DeepSpeed gathers a module's parameters only around that module's forward
    and backward, so the weight is gathered once for every chunk of the step (and gathered at all).
    It takes `targets`, the labels already shifted (`next_token_targets`), and for "mean" optionally
    `mean_over`, the labelled-token count to divide by (a sequence shard's: the whole row group's).
    """

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)
        self.chunk_tokens: int | None = None  # None: loss_chunk_tokens(vocab) (LOSS_CHUNK_BYTES of fp32 logits)

    def forward(self, x, targets=None, reduction: str = "mean", mean_over=None):
        if targets is None:
            return super().forward(x)
        chunk = self.chunk_tokens or loss_chunk_tokens(self.out_features)
        return chunked_target_loss(x, self.weight, targets, reduction, chunk, mean_over)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = LMHead(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        self.sequence_parallel: SequenceShard | None = None  # set by the engine builder (N > 1 only)
        # One of ATTENTION_BACKENDS. "auto" is resolved at every forward from the activations' device and
        # dtype; a named backend is used as it is (the driver checks it with resolve_attention at start-up).
        self.attention = "auto"
        if drawing():
            init_weights(self)

    def backend_for(self, device_type: str) -> str:
        """The attention kernel this model runs on `device_type` for its parameters' dtype (the activations')."""
        if self.attention != "auto":
            return self.attention
        return resolve_attention("auto", device_type, self.embed_tokens.weight.dtype)

    def document_layout(self, position_ids: torch.Tensor, device) -> DocumentLayout:
        """The batch's DocumentLayout for this model's kernel on `device`, from position_ids still on the host:
        the trainer calls it before the batch's copy, so the forward reads no boundary from the device."""
        return DocumentLayout.from_positions(position_ids, self.backend_for(torch.device(device).type), device)

    def forward(self, input_ids, position_ids=None, labels=None, loss_reduction: str = "mean",
                documents: DocumentLayout | None = None):
        """input_ids (B, T). Returns logits (B, T, V), or the next-token loss when labels given:
        its mean over labelled positions, or with loss_reduction="sum" their sum (`next_token_loss`
        defines it; `LMHead` computes it in chunks, never holding the logits).

        labels follow the Hugging Face convention: same shape as input_ids, -100 where no loss;
        the shift by one happens here.

        With sequence parallelism every rank of the group is given the same whole rows: it computes the
        positions `shard.local(T)` only, returns logits (B, T/N, V) for them, or its share of the loss
        (its positions' token losses over the whole row group's labelled count, so that the sum over
        the group's ranks is the unsharded loss; "sum": its positions' sum).

        `documents`: the batch's layout made by `document_layout` on the host (whole rows); without it, derived
        here from position_ids (one host sync on an accelerator for sdpa and varlen).
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        shard = self.sequence_parallel
        local = shard.local(T) if shard is not None else slice(None)
        x = self.embed_tokens(input_ids[:, local])
        cos, sin = rotary_cos_sin(position_ids[:, local], self.args.head_dim, self.args.rope_theta, x.dtype,
                                  self.args.rope_scaling)
        docs = documents
        if docs is None:  # the whole row: the kernel sees whole rows
            backend = resolve_attention("auto", x.device.type, x.dtype) if self.attention == "auto" else self.attention
            docs = DocumentLayout.from_positions(position_ids, backend)
        if docs.mask is not None and docs.mask.dtype == torch.bool:
            docs = docs._replace(mask=additive_mask(docs.mask, x.dtype))
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, docs, shard, use_reentrant=False)
            else:
                x = layer(x, cos, sin, docs, shard)
        if labels is None:
            return self.lm_head(self.norm(x))
        targets = next_token_targets(labels)  # (B, T): shifted over the whole row (a shard's last target is
        # the next shard's first label)
        mean_over = (targets != IGNORE_INDEX).sum() if shard is not None and loss_reduction == "mean" else None
        loss = self.lm_head(self.norm(x), targets[:, local], loss_reduction, mean_over)
        if shard is not None and shard.gradient_factor != 1.0:
            loss = _ScaleGradient.apply(loss, shard.gradient_factor)
        return loss


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `factor` in backward (SequenceShard.gradient_factor)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def held_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds: its ZeRO-3 partition (padding included), else everything."""
    return sum(ds_attributes.held(p).numel() for p in model.parameters())
