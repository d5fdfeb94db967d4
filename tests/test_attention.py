"""Attention backends (modeling/model.py): one document contract, three kernels.

- sdpa and flex give the same outputs and gradients (fp32, 1e-5) on packed rows of many documents,
  with GQA, MQA, MHA + QK-norm and odd lengths;
- every backend that runs here isolates documents: changing one document never changes another's logits;
- sdpa passes no mask at all when every row is one document, and never repeats k/v for GQA;
- varlen: PyTorch's `varlen_attn` runs flash kernels, CUDA only. Here everything of it runs but the kernel:
  a plain-PyTorch per-document reference is registered as the CPU implementation of the two aten
  operators torch's varlen op calls (`_flash_attention_forward` / `_backward`), for the length of one
  test (a scoped torch.library registration). So torch's own wrapper (its GQA check, how it reads
  window_size as "causal"), its custom op and autograd formula, and our cu_seqlens / max_seqlen /
  flattening all run, and the reference sees exactly the arguments the kernel would;
- compiled flex is one graph for every batch size (dynamo's eager backend here, over more batch sizes than
  dynamo's recompile limit), so it never falls back to eager flex, which materialises (B, H, T, T);
- `resolve_attention`: what auto picks, and one-line refusals of a backend that cannot run here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torch._dynamo.utils import counters

from zerotrain.launcher.config_resolve import drift, identity_hash
from zerotrain.modeling.model import (DocumentLayout, ModelArgs, Transformer, compiled_flex, cu_seqlens,
                                      document_block_mask, document_starts, flex_on_cpu, resolve_attention,
                                      varlen_available, _varlen_keywords)

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import reference_flash  # noqa: E402  (the plain-PyTorch flash kernel; also used inside sp_harness's ranks)

SHAPES = {
    "gqa": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "mqa": dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=1),
    "mha-qknorm": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, qk_norm=True),
}


def model_for(shape: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelArgs(vocab_size=100, **SHAPES[shape]))


def packed_batch(seed: int = 0):
    """3 rows of 37 tokens: many documents of odd lengths (including 1-token ones), a row that starts
    mid-document, and a row that is one document."""
    lengths = [[5, 1, 9, 3, 11, 1, 7], [4, 13, 1, 19], [37]]
    rows = []
    for row in lengths:
        rows.append(torch.cat([torch.arange(n) for n in row]))
    pos = torch.stack(rows)
    pos[1, :4] += 6  # the row begins inside a document cut off from the previous row
    x = torch.randint(0, 100, pos.shape, generator=torch.Generator().manual_seed(seed))
    return x, pos


def forward_backward(model, backend, x, pos):
    model.attention = backend
    model.zero_grad(set_to_none=True)
    logits = model(x, pos)
    (logits.float().square().mean() + model(x, pos, labels=x)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_flex_is_one_graph_for_every_batch_size():
    """Training, evaluation, its remainder and pre-flight's candidates each meet other batch sizes: compiled
    per shape, flex would pass dynamo's recompile limit and run eagerly. The batch dimension is dynamic."""
    limit = 3
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad():
        for batch in range(1, limit + 3):  # more batch sizes than the limit
            _, pos = packed_batch()
            pos = pos[torch.arange(batch) % 3]
            g = torch.Generator().manual_seed(batch)
            q, k, v = (torch.randn(batch, heads, pos.shape[1], 16, generator=g) for heads in (4, 2, 2))
            mask = document_block_mask(pos)
            out = compiled_flex(q, k, v, mask, backend="eager")
            assert torch.allclose(out, flex_on_cpu(q, k, v, mask), atol=1e-5), batch
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # a batch of 1 is specialised
    torch._dynamo.reset()


@pytest.mark.parametrize("shape", SHAPES)
def test_sdpa_and_flex_agree_on_outputs_and_gradients(shape):
    model = model_for(shape)
    x, pos = packed_batch()
    sdpa_out, sdpa_grads = forward_backward(model, "sdpa", x, pos)
    flex_out, flex_grads = forward_backward(model, "flex", x, pos)
    assert torch.allclose(sdpa_out, flex_out, atol=1e-5, rtol=0), (sdpa_out - flex_out).abs().max()
    for name, g in sdpa_grads.items():
        assert torch.allclose(g, flex_grads[name], atol=1e-5, rtol=0), (name, (g - flex_grads[name]).abs().max())


def documents(pos: torch.Tensor):
    """(row, start, end) of every document, from the positions (as the model derives them)."""
    starts = document_starts(pos)
    out = []
    for r in range(pos.shape[0]):
        s = starts[r].nonzero().flatten().tolist() + [pos.shape[1]]
        out += [(r, a, b) for a, b in zip(s[:-1], s[1:])]
    return out


def assert_documents_isolated(model, backend):
    model.attention = backend
    x, pos = packed_batch()
    with torch.no_grad():
        base = model(x, pos)
        for r, a, b in documents(pos):
            changed = x.clone()
            changed[r, a:b] = (x[r, a:b] + 1 + torch.arange(b - a)) % 100  # every token of this document
            out = model(changed, pos)
            inside = torch.zeros_like(pos, dtype=torch.bool)
            inside[r, a:b] = True
            assert not torch.allclose(out[inside], base[inside], atol=1e-4), (backend, r, a, b)
            assert torch.allclose(out[~inside], base[~inside], atol=1e-5, rtol=0), (backend, r, a, b)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_changing_one_document_never_changes_another(backend):
    assert_documents_isolated(model_for("gqa", seed=1), backend)


def test_sdpa_uses_no_mask_for_rows_of_one_document_and_gqa_in_the_kernel(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append((q.shape[1], k.shape[1], attn_mask is not None, is_causal, enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    model = model_for("gqa")
    model.attention = "sdpa"
    x = torch.randint(0, 100, (2, 16))
    one_doc = torch.stack([torch.arange(16), torch.arange(16) + 30])  # the 2nd row continues a document
    with torch.no_grad():
        unmasked = model(x, one_doc)
        assert calls == [(4, 2, False, True, True)] * 2  # 2 layers: no mask, causal, kv heads not repeated
        calls.clear()
        assert DocumentLayout.from_positions(one_doc, "sdpa").mask is None
        masked = model(x, one_doc.clone().index_fill_(1, torch.tensor([8]), 0))  # one row now holds 2 documents
    assert calls == [(4, 2, True, False, True)] * 2
    assert torch.allclose(masked[:, :8], unmasked[:, :8], atol=1e-6)  # the mask changes only what it must


# -- varlen: everything but the CUDA kernel ---------------------------------------------------------

@pytest.fixture
def reference_flash_kernel():
    """The reference as the CPU implementation of the two flash operators, for this test only."""
    with reference_flash.registered() as calls:
        yield calls


needs_varlen = pytest.mark.skipif(not varlen_available(), reason="torch.nn.attention.varlen needs torch >= 2.9")


@needs_varlen
def test_varlen_without_a_gpu_is_the_kernels_own_refusal():
    model = model_for("gqa")
    model.attention = "varlen"
    x, pos = packed_batch()
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        model(x, pos)


@needs_varlen
@pytest.mark.parametrize("shape", SHAPES)
def test_varlen_inputs_and_results_match_a_per_document_reference(shape, reference_flash_kernel):
    from torch.nn.attention import varlen

    model = model_for(shape)
    x, pos = packed_batch()
    sdpa_out, sdpa_grads = forward_backward(model, "sdpa", x, pos)
    varlen_out, varlen_grads = forward_backward(model, "varlen", x, pos)
    args = model.args
    B, T = x.shape
    expected_cu, longest = cu_seqlens(pos)
    assert expected_cu.tolist() == [0, 5, 6, 15, 18, 29, 30, 37, 41, 54, 55, 74, 111] and longest == 37
    forwards = [c for c in reference_flash_kernel]
    kv_heads = args.n_kv_heads if "enable_gqa" in _varlen_keywords(varlen.varlen_attn) else args.n_heads
    assert len(forwards) == 2 * args.n_layers  # the logits pass and the loss pass, every layer
    for call in forwards:
        assert call["q"] == (B * T, args.n_heads, args.head_dim)  # flattened, documents end to end
        # GQA: kv heads as they are where the kernel takes fewer (torch >= 2.13), repeated where not (2.11 on an H100)
        assert call["k"] == (B * T, kv_heads, args.head_dim)
        assert call["cu"].dtype == torch.int32 and torch.equal(call["cu"], expected_cu)
        assert torch.equal(call["cu_k"], expected_cu) and call["max_q"] == call["max_k"] == T  # the row bounds every document
        assert call["causal"] and call["window"] == (-1, 0) and call["dropout"] == 0.0
    assert torch.allclose(varlen_out, sdpa_out, atol=1e-5, rtol=0), (varlen_out - sdpa_out).abs().max()
    for name, g in sdpa_grads.items():
        assert torch.allclose(g, varlen_grads[name], atol=1e-5, rtol=0), (name, (g - varlen_grads[name]).abs().max())


@needs_varlen
def test_varlen_plumbing_isolates_documents(reference_flash_kernel):
    assert_documents_isolated(model_for("mqa", seed=2), "varlen")


# -- choosing --------------------------------------------------------------------------------------

def test_auto_and_refusals():
    assert resolve_attention("auto", "cpu", torch.float32) == "sdpa"
    assert resolve_attention("auto", "cpu", torch.bfloat16) == "sdpa"
    assert resolve_attention("auto", "cuda", torch.float32) == "sdpa"  # flash kernels take 16-bit only
    assert resolve_attention("auto", "cuda", torch.bfloat16) == ("varlen" if varlen_available() else "sdpa")
    assert resolve_attention("flex", "cpu", torch.float32) == "flex"
    assert resolve_attention("sdpa", "cuda", torch.float16) == "sdpa"
    if varlen_available():
        assert resolve_attention("varlen", "cuda", torch.bfloat16) == "varlen"
        with pytest.raises(ValueError, match=r"^varlen runs PyTorch's flash kernels, CUDA only; this run is on cpu"):
            resolve_attention("varlen", "cpu", torch.bfloat16)
        with pytest.raises(ValueError, match="take bf16 or fp16; this run computes in fp32"):
            resolve_attention("varlen", "cuda", torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; choose from auto, sdpa, flex, varlen"):
        resolve_attention("flash", "cpu", torch.float32)


def test_model_default_is_auto_and_the_same_math_as_sdpa():
    model = model_for("gqa")
    assert model.attention == "auto"
    x, pos = packed_batch()
    with torch.no_grad():
        auto = model(x, pos)
        model.attention = "sdpa"
        assert torch.equal(model(x, pos), auto)


# -- the driver ------------------------------------------------------------------------------------

def test_attention_is_not_part_of_the_run_identity():
    from zerotrain.launcher.config import RunConfig

    flex = RunConfig.from_flat(dict(data="mix.json", attention="flex"))
    sdpa = RunConfig.from_flat(dict(data="mix.json", attention="sdpa"))
    assert identity_hash(flex) == identity_hash(sdpa) == identity_hash(RunConfig.from_flat(dict(data="mix.json")))
    assert drift(flex, sdpa.to_dict()) == []  # a resume may switch kernels: the math is the same


@pytest.mark.launches
def test_flex_and_sdpa_train_the_same_two_rank_run(tmp_path, mix_path):
    """The real driver, 2 ranks under the deepspeed launcher (cpu profile: ZeRO-3), same seed and data:
    10 steps with --attention flex and with --attention sdpa log the same losses to 1e-4; the kernel is
    printed at start-up and recorded in config.json."""
    from conftest import launch, read_metrics

    out = tmp_path / "runs"
    common = ["--profile", "cpu", "--data", str(mix_path), "--out", str(out), "--model", "debug", "--seq-len", "128",
              "--micro-batch", "2", "--max-steps", "10", "--warmup-steps", "1", "--lr", "3e-3"]
    losses = {}
    for backend in ("flex", "sdpa"):
        proc = launch("deepspeed", common + ["--run-id", backend, "--attention", backend])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"attention: {backend} (--attention {backend})" in proc.stdout
        saved = __import__("json").loads((out / backend / "config.json").read_text())
        assert saved["attention"] == backend and saved["run"]["attention"] == backend
        losses[backend] = [m["loss"] for m in read_metrics(out / backend)]
    assert len(losses["flex"]) == 10 and losses["flex"][-1] < losses["flex"][0]
    assert losses["flex"] == pytest.approx(losses["sdpa"], abs=1e-4), losses


def _varlen_of_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1)):
    """torch 2.11's signature (seen on an H100): a causal window, no enable_gqa, so heads must match."""
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn takes as many kv heads as query heads"
    return _REAL_VARLEN[0](query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size)


def _varlen_of_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9/2.10's signature: is_causal instead of a window, no enable_gqa."""
    assert key.shape[1] == query.shape[1], "torch 2.10's varlen_attn takes as many kv heads as query heads"
    return _REAL_VARLEN[0](query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                           window_size=(-1, 0) if is_causal else (-1, -1))


_REAL_VARLEN: list = []


@needs_varlen
@pytest.mark.parametrize("older", [_varlen_of_torch_2_11, _varlen_of_torch_2_10], ids=["torch2.11", "torch2.10"])
def test_varlen_with_an_older_torch_signature_matches_sdpa(older, reference_flash_kernel, monkeypatch):
    from torch.nn.attention import varlen

    _REAL_VARLEN[:] = [varlen.varlen_attn]
    monkeypatch.setattr(varlen, "varlen_attn", older)
    model = model_for("gqa")
    x, pos = packed_batch()
    sdpa_out, sdpa_grads = forward_backward(model, "sdpa", x, pos)
    varlen_out, varlen_grads = forward_backward(model, "varlen", x, pos)
    assert reference_flash_kernel and all(c["causal"] and c["window"] == (-1, 0) for c in reference_flash_kernel)
    assert all(c["k"][1] == model.args.n_heads for c in reference_flash_kernel)  # kv heads repeated for it
    assert torch.allclose(varlen_out, sdpa_out, atol=1e-5, rtol=0), (varlen_out - sdpa_out).abs().max()
    for name, g in sdpa_grads.items():
        assert torch.allclose(g, varlen_grads[name], atol=1e-5, rtol=0), (name, (g - varlen_grads[name]).abs().max())
