"""A plain-PyTorch reference registered as the CPU implementation of the two aten flash operators that
torch's `varlen_attn` calls (`_flash_attention_forward` / `_backward`), so that everything of the varlen
path but the CUDA kernel runs on a CPU: torch's own wrapper (its GQA check, how it reads window_size as
"causal"), its custom op and autograd formula, and our cu_seqlens / max_seqlen / flattening. Used by
tests/test_attention.py (one test at a time) and tests/helpers/sp_harness.py (varlen under sequence
parallelism, in the ranks of a real launch). The reference records the arguments it was called with.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

CALLS: list[dict] = []


def reference_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward's varlen contract in plain PyTorch: (total, H, hd) queries against
    (total, KV, hd) keys and values, causal within each document of cum_seq_q. Returns its 5 outputs,
    logsumexp (H, total) among them."""
    CALLS.append(dict(q=tuple(query.shape), k=tuple(key.shape), cu=cum_seq_q.clone(), cu_k=cum_seq_k.clone(),
                      max_q=max_q, max_k=max_k, causal=is_causal, window=(window_size_left, window_size_right),
                      dropout=dropout_p))
    out, lse = _reference_attention(query, key, value, cum_seq_q, is_causal, scale)
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def _reference_attention(q, k, v, cu, causal, scale):
    rep = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1).float() for t in (q, k, v))  # (heads, len, hd)
        kd, vd = kd.repeat_interleave(rep, 0), vd.repeat_interleave(rep, 0)
        s = qd @ kd.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        lses.append(s.logsumexp(-1))
        outs.append((s.softmax(-1) @ vd).transpose(0, 1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def reference_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """The gradients of the reference above, written out (operators registered for a backend run below
    autograd, so they cannot ask autograd): dV = P^T dO, dS = P (dP - rowsum(dP P)), dQ = dS K s, dK = dS^T Q s,
    with the GQA groups' dK and dV summed into their shared kv head."""
    rep = query.shape[1] // key.shape[1]
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for a, b in zip(cum_seq_q[:-1].tolist(), cum_seq_q[1:].tolist()):
        q, k, v, do = (t[a:b].transpose(0, 1).float() for t in (query, key, value, grad_out))
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = q @ k.transpose(1, 2) * scale
        if is_causal:
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        p = s.softmax(-1)
        dp = do @ v.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[a:b] = (ds @ k * scale).transpose(0, 1)
        dk_full, dv_full = ds.transpose(1, 2) @ q * scale, p.transpose(1, 2) @ do  # (H, len, hd)
        dk[a:b] = dk_full.unflatten(0, (-1, rep)).sum(1).transpose(0, 1)
        dv[a:b] = dv_full.unflatten(0, (-1, rep)).sum(1).transpose(0, 1)
    return dq, dk, dv


@contextmanager
def registered():
    """The reference as the CPU implementation of the two flash operators while the block runs; yields CALLS."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", reference_flash_forward, "CPU")
    lib.impl("_flash_attention_backward", reference_flash_backward, "CPU")
    CALLS.clear()
    try:
        yield CALLS
    finally:
        lib._destroy()  # the registration goes; the CPU dispatch raises NotImplementedError again
        CALLS.clear()
