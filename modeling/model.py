"""A Llama-style decoder-only transformer: our own modules, Llama-compatible weight names.

Architecture choices, all of them:
- token embedding -> n_layers x [RMSNorm -> grouped-query attention -> residual,
  RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> linear head (optionally tied);
- rotary position embeddings computed from per-token ``position_ids`` (so packed rows whose
  positions restart at 0 at every document get correct rotations), in the Hugging Face
  ``rotate_half`` layout, so q/k weights map to HF Llama without a permutation;
- optional QK-norm: an RMSNorm over each head's query and key before the rotation (Qwen3's
  placement, so such a model exports as ``Qwen3ForCausalLM``);
- attention never crosses a document boundary. `DocumentLayout.from_positions` is the one place
  boundaries are derived from ``position_ids`` (a document starts wherever the position is 0, and
  at the start of every row): on a GPU with ``flash_attn`` installed as ``cu_seqlens`` for its
  variable-length kernel, otherwise as a block-diagonal causal mask for
  ``scaled_dot_product_attention``;
- RMSNorm is computed in fp32; no biases anywhere; weights initialised in `init_weights` only.

This file is the model, its sizes (`ModelArgs`, `PRESETS`) and its arithmetic (`count_params`,
`flops_per_token`): no optimizer, no data, no DeepSpeed (beyond gathering ZeRO-3 parameters in
`init_weights`). Depth and heads-based size rules are in modeling/sizes.py, the Hugging Face
conversion in modeling/hf.py.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional, GPU only: the variable-length kernel of flash-attn 2
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    ffn_hidden: int | None = None  # None: ffn_mult x dim rounded up to ffn_multiple_of
    ffn_mult: float = 8 / 3  # only used when ffn_hidden is None
    ffn_multiple_of: int = 64
    vocab_size: int = 258  # padded up to vocab_multiple_of in __post_init__
    vocab_multiple_of: int = 64
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"model args: {msg}")

        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(f"{name} must be a positive integer, got {v!r}")

        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "vocab_multiple_of",
                     "ffn_multiple_of"):
            positive_int(name)
        for name in ("rope_theta", "norm_eps", "init_std", "ffn_mult"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a positive number, got {v!r}")
        for name in ("tie_embeddings", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        positive_int("n_kv_heads")
        if self.dim % self.n_heads:
            bad(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            bad(f"head dim {self.dim // self.n_heads} must be even for rotary embeddings")
        if self.ffn_hidden is None:
            m = self.ffn_multiple_of
            object.__setattr__(self, "ffn_hidden", m * math.ceil(int(self.ffn_mult * self.dim) / m))
        positive_int("ffn_hidden")
        padded = self.vocab_multiple_of * math.ceil(self.vocab_size / self.vocab_multiple_of)
        object.__setattr__(self, "vocab_size", padded)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


# Named presets: the shapes this toolkit's users train today (layers x dim). Head dim is 64 below
# dim 1536 and 128 from there; the MLP is SwiGLU with 8/3 x dim hidden units (multiple of 64)
# unless stated. `debug` is what the tests and the demo train on 2 CPU cores. The two `ws-`
# presets are the dual 48 GB workstation configurations; their names are their total counts with
# an untied 128,256-token vocabulary (the Llama 3 tokenizer): `zerotrain params --vocab-size 128256`.
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    "tiny": ModelArgs(dim=512, n_layers=12, n_heads=8),
    "small": ModelArgs(dim=768, n_layers=16, n_heads=12),
    "medium": ModelArgs(dim=1024, n_layers=24, n_heads=16),
    "medium-large": ModelArgs(dim=1152, n_layers=20, n_heads=18),
    "large": ModelArgs(dim=1536, n_layers=24, n_heads=12),
    "xlarge": ModelArgs(dim=1920, n_layers=32, n_heads=15),
    "ws-760m": ModelArgs(dim=1024, n_layers=24, n_heads=16, ffn_hidden=5376),
    "ws-1.3b": ModelArgs(dim=1536, n_layers=32, n_heads=12),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def use_flash_varlen(x: torch.Tensor) -> bool:
    """flash-attn's variable-length kernel: installed, on a GPU, in a 16-bit dtype (its requirements)."""
    return flash_attn_varlen_func is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class DocumentLayout(NamedTuple):
    """Where the documents of a batch are, derived once per forward from the position ids.

    Exactly one of the two forms is set: `mask` (B, 1, T, T) for scaled_dot_product_attention,
    or `cu_seqlens` (n_docs + 1,) int32 over the flattened batch plus `max_seqlen` for
    flash-attn's variable-length kernel.
    """

    mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0

    @staticmethod
    def from_positions(position_ids: torch.Tensor, varlen: bool) -> "DocumentLayout":
        if varlen:
            return DocumentLayout(None, *cu_seqlens(position_ids))
        return DocumentLayout(mask=document_mask(position_ids))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos/sin of shape (B, T, head_dim) for the given per-token positions (HF Llama layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    # x: (B, T, n_heads, head_dim); cos/sin: (B, T, head_dim)
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts (position 0, or the first token of a row)."""
    starts = position_ids == 0
    starts[:, 0] = True
    return starts


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, T, T), True where attention is allowed."""
    doc_ids = torch.cumsum(document_starts(position_ids).int(), dim=-1)  # (B, T)
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same_doc & causal)[:, None]


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Document boundaries over the flattened (B*T) batch as (cu_seqlens int32, longest document)."""
    starts = document_starts(position_ids).flatten().nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([position_ids.numel()])])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())


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

    def forward(self, x, cos, sin, docs: DocumentLayout):
        B, T, _ = x.shape
        q, k, v = self.project(x)
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))  # (B, T, H, hd)
        k = self.k_norm(k.view(B, T, self.n_kv_heads, self.head_dim))  # (B, T, KV, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if docs.cu_seqlens is not None:  # flash-attn: documents laid end to end, GQA in the kernel
            out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), docs.cu_seqlens,
                                         docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen, causal=True)
            return self.o_proj(out.reshape(B, T, -1))  # out: (B*T, H, hd)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask)  # (B, H, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, docs: DocumentLayout):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.activation_checkpointing = False
        init_weights(self)

    def forward(self, input_ids, position_ids=None, labels=None, loss_reduction: str = "mean"):
        """input_ids (B, T). Returns logits (B, T, V), or the next-token loss when labels given:
        its mean over labelled positions, or with loss_reduction="sum" their sum (`next_token_loss`).

        labels follow the Hugging Face convention: same shape as input_ids, -100 where no loss;
        the shift by one happens here.
        """
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.args.head_dim, self.args.rope_theta, x.dtype)
        docs = DocumentLayout.from_positions(position_ids, varlen=use_flash_varlen(x))
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, docs, use_reentrant=False)
            else:
                x = layer(x, cos, sin, docs)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return next_token_loss(logits, labels, loss_reduction)


def next_token_loss(logits, labels, reduction: str = "mean"):
    """Cross-entropy of logits[:, :-1] against labels[:, 1:] (-100: no loss), in fp32.

    "mean": over this micro-batch's labelled positions (pretraining: every micro-batch then weighs
    the same). "sum": the sum over them, 0 when there are none, for a loss that is the mean over
    the labelled tokens of the whole global batch (SFT, where micro-batches hold different numbers
    of response tokens): each micro-batch's sum is scaled by `global_token_mean_scale` before the
    DeepSpeed backward.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction=reduction)


def global_token_mean_scale(grad_accum: int, world: int, global_tokens: int) -> float:
    """The factor for each micro-batch's loss SUM so that DeepSpeed's backward yields the gradient of
    (sum of every token loss of the global batch) / global_tokens.

    `engine.backward(loss)` divides the loss by the gradient-accumulation steps, and the ZeRO
    gradient reduction averages over the data-parallel ranks, so the gradient that reaches the
    optimizer is (1 / (accum x world)) x the sum over all micro-batches of grad(loss). Giving it
    loss = sum_m x accum x world / N makes that sum_m grad(sum_m) / N. `global_tokens` (N: labelled
    tokens in all micro-batches of all ranks, `zerotrain.dataio.loader.trainable_tokens`) must be known
    before the first backward: the step's pre-step all-gather carries each rank's count. The
    all-reduced sum of these scaled losses divided by accum x world is then the step's loss.
    """
    if global_tokens <= 0:
        raise ValueError(f"a global batch with {global_tokens} labelled tokens has no loss to average")
    return grad_accum * world / global_tokens


@torch.no_grad()
def init_weights(model: Transformer) -> None:
    """The one place weights are initialised (deterministic under torch.manual_seed).

    Normal(0, init_std) for embeddings and projections; the two residual projections of
    each block (attention o_proj, MLP down_proj) are scaled by 1/sqrt(2 * n_layers) so the
    residual stream's variance does not grow with depth; norms start at 1.
    Under `deepspeed.zero.Init` each parameter is already partitioned: it is gathered, set on
    rank 0 and scattered back, so every ZeRO stage starts from the same weights for a seed.
    """
    std = model.args.init_std
    resid_std = std / math.sqrt(2 * model.args.n_layers)
    for name, p in model.named_parameters():
        with gathered(p):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=resid_std)
            else:
                nn.init.normal_(p, mean=0.0, std=std)


def gathered(p):
    """Context in which a ZeRO-3 partitioned parameter is whole, and rank 0's writes to it are kept."""
    if hasattr(p, "ds_id"):  # a ZeRO-3 partitioned parameter
        import deepspeed

        return deepspeed.zero.GatheredParameters([p], modifier_rank=0)
    return contextlib.nullcontext()


def held_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds: its ZeRO-3 partition (padding included), else everything."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def count_params(args: ModelArgs) -> dict:
    """Total and non-embedding parameter counts (norms included; a tied head counted once)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    mlp = 3 * args.dim * args.ffn_hidden
    per_layer = attn + mlp + 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0)
    embed = args.vocab_size * args.dim
    non_embedding = args.n_layers * per_layer + args.dim
    total = non_embedding + embed + (0 if args.tie_embeddings else embed)
    return {"total": total, "non_embedding": non_embedding}


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul params) + 12 x n_layers x dim x seq_len (attention scores).

    The attention term counts the full causal-free T x T product (the PaLM convention), an upper bound
    for packed rows where masked-out blocks are skipped by fused kernels.
    """
    n = count_params(args)["non_embedding"] + args.vocab_size * args.dim  # the head's matmul counts
    return 6 * n + 12 * args.n_layers * args.dim * seq_len
