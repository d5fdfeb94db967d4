"""The model family: presets, the depth and scaling rules, QK-norm, document layouts,
activation checkpointing, parameter and FLOP arithmetic. In-process, tiny sizes."""
import math
import re

import pytest
import torch

from zerotrain.modeling import sizes
from zerotrain.modeling.model import (PRESETS, DocumentLayout, ModelArgs, Transformer, count_params, cu_seqlens,
                            document_mask, flops_per_token, preset)


def tiny(**kw):
    return ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100), **kw})


# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,layers,dim", [
    ("tiny", 12, 512), ("small", 16, 768), ("medium", 24, 1024), ("medium-large", 20, 1152), ("large", 24, 1536),
    ("xlarge", 32, 1920), ("ws-760m", 24, 1024), ("ws-1.3b", 32, 1536)])
def test_presets_have_the_shapes_users_run_and_exact_counts(name, layers, dim):
    args = preset(name)
    assert (args.n_layers, args.dim) == (layers, dim)
    with torch.device("meta"):  # the real module, no memory
        model = Transformer(args)
    assert count_params(args)["total"] == sum(p.numel() for p in model.parameters())


def test_workstation_presets_are_named_after_their_counts():
    vocab = 128256  # the Llama 3 tokenizer, untied
    assert round(count_params(preset("ws-760m", vocab_size=vocab))["total"] / 1e6) == 760
    assert round(count_params(preset("ws-1.3b", vocab_size=vocab))["total"] / 1e8) == 13


def test_debug_preset_is_small_and_gqa():
    args = PRESETS["debug"]
    assert args.n_kv_heads < args.n_heads and count_params(args)["total"] < 2_000_000


@pytest.mark.parametrize("depth,dim,heads", [(12, 768, 6), (20, 1280, 10), (3, 256, 2), (2, 128, 1)])
def test_depth_rule(depth, dim, heads):
    args = sizes.depth_args(depth)
    assert (args.n_layers, args.dim, args.n_heads, args.head_dim) == (depth, dim, heads, 128)


def test_depth_rule_aspect_ratio_and_head_dim():
    args = sizes.depth_args(10, aspect_ratio=96, head_dim=64)
    assert (args.n_layers, args.dim, args.n_heads) == (10, 960, 15)


def test_depth_below_one_head_is_refused():
    with pytest.raises(ValueError, match="0.5 heads of 128, not a whole head"):
        sizes.depth_args(1)


def test_shipped_scaling_rules():
    rules = sizes.load_rules()
    enoki = sizes.rule_args(rules["enoki"], 16)
    assert (enoki.n_layers, enoki.dim, enoki.n_heads, enoki.head_dim, enoki.ffn_hidden) == (12, 1024, 16, 64, 4096)
    qwen3 = sizes.rule_args(rules["qwen3"], 4)
    assert (qwen3.n_layers, qwen3.dim, qwen3.n_heads, qwen3.head_dim, qwen3.ffn_hidden) == (8, 512, 4, 128, 1536)
    assert sizes.rule_lr(rules["enoki"], 10**6) is None  # no law shipped: none has been measured


def test_scaling_rule_learning_rate_law(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("mine:\n  head_dim: 64\n  layers_per_head: [1, 1]\n  mlp_ratio: 4\n  kv_heads_ratio: 2\n"
                    "  tie_embeddings: true\n  lr: {a: 5.0, b: 1.0e5, d: -0.4}\n")
    rule = sizes.get_rule("mine", path)
    args = sizes.rule_args(rule, 6)
    assert (args.n_layers, args.dim, args.n_kv_heads, args.tie_embeddings) == (6, 384, 3, True)
    p = count_params(args)["non_embedding"]
    assert sizes.rule_lr(rule, p) == pytest.approx(5.0 * (1e5 + p) ** -0.4)


@pytest.mark.parametrize("body,message", [
    ("r:\n  head_dim: 64\n  layers_per_head: [1, 1]\n", "missing mlp_ratio"),
    ("r:\n  head_dim: 64\n  layers_per_head: [1, 1]\n  mlp_ratio: 4\n  depth: 3\n", "unknown key 'depth'"),
    ("r:\n  head_dim: 64\n  layers_per_head: 3\n  mlp_ratio: 4\n", "layers_per_head must be"),
    ("r:\n  head_dim: 64\n  layers_per_head: [1, 1]\n  mlp_ratio: 4\n  lr: {a: 1}\n", "exactly a, b and d"),
    ("r: [unclosed\n", "invalid YAML"),
])
def test_bad_rules_file_is_refused(tmp_path, body, message):
    path = tmp_path / "rules.yaml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message):
        sizes.load_rules(path)


def test_unknown_rule():
    with pytest.raises(ValueError, match="unknown scaling rule 'nope'; known: enoki, qwen3"):
        sizes.get_rule("nope")


@pytest.mark.parametrize("kw,message", [
    (dict(ffn_hidden=0), "ffn_hidden must be a positive integer"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive number"),
    (dict(norm_eps=0), "norm_eps must be a positive number"),
    (dict(tie_embeddings="yes"), "tie_embeddings must be true or false"),
    (dict(n_kv_heads=0), "n_kv_heads must be a positive integer"),
    (dict(dim=72, n_heads=4, n_kv_heads=4), "head dim 18"),  # passes: 18 is even
    (dict(dim=60, n_heads=4, n_kv_heads=4), "head dim 15 must be even"),
])
def test_inconsistent_model_args(kw, message):
    if message == "head dim 18":
        assert tiny(**kw).head_dim == 18
        return
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_flops_per_token():
    args = tiny()
    n = count_params(args)["non_embedding"] + args.vocab_size * args.dim
    assert flops_per_token(args, 256) == 6 * n + 12 * args.n_layers * args.dim * 256


# -- QK-norm -------------------------------------------------------------------------------------

def test_qk_norm_normalises_each_head_and_is_counted():
    args = tiny(qk_norm=True)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= names
    assert count_params(args)["total"] == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        before = model(x)
        model.layers[0].self_attn.q_norm.weight.mul_(3.0)  # only matters if q_norm is applied
        after = model(x)
    assert not torch.allclose(before, after, atol=1e-4)


# -- document layouts ----------------------------------------------------------------------------

def test_cu_seqlens_and_mask_describe_the_same_documents():
    torch.manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4],
                        [3, 4, 5, 0, 1, 2, 3, 0, 0, 1]])  # row 2 starts mid-document: a new one for us
    cu, longest = cu_seqlens(pos)
    assert cu.tolist() == [0, 3, 5, 10, 13, 17, 18, 20] and cu.dtype == torch.int32 and longest == 5
    # the mask built from cu_seqlens over the flattened batch equals document_mask, row by row
    flat_doc = torch.zeros(pos.numel(), dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        flat_doc[a:b] = i
    doc = flat_doc.view(2, 10)
    expected = (doc[:, :, None] == doc[:, None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    assert torch.equal(document_mask(pos)[:, 0], expected)
    layout = DocumentLayout.from_positions(pos, "varlen")
    # the kernel is given the row length as its bound on the longest document (no host sync, one compiled graph)
    assert layout.mask is None and torch.equal(layout.cu_seqlens, cu) and layout.max_seqlen == pos.shape[1]
    assert torch.equal(DocumentLayout.from_positions(pos, "sdpa").mask, document_mask(pos))


def test_packed_documents_with_qk_norm_and_mha_are_isolated():
    torch.manual_seed(1)
    model = Transformer(tiny(qk_norm=True, n_kv_heads=4)).eval()
    a, b = torch.randint(0, 100, (7,)), torch.randint(0, 100, (13,))
    row, pos = torch.cat([a, b])[None], torch.cat([torch.arange(7), torch.arange(13)])[None]
    other = row.clone()
    other[0, :7] = (row[0, :7] + 1) % 100  # every token of A changed
    with torch.no_grad():
        packed, changed, alone = model(row, pos), model(other, pos), model(b[None])
    assert not torch.allclose(packed[0, :7], changed[0, :7], atol=1e-3)
    assert torch.allclose(packed[0, 7:], changed[0, 7:], atol=1e-5)
    assert torch.allclose(packed[0, 7:], alone[0], atol=1e-5)


# -- activation checkpointing --------------------------------------------------------------------

def test_activation_checkpointing_recomputes_and_leaves_loss_and_grads_unchanged():
    def run(checkpointing):
        torch.manual_seed(0)
        model = Transformer(tiny(n_layers=3)).train()
        model.activation_checkpointing = checkpointing
        calls = []
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
        x = torch.randint(0, 100, (2, 16))
        pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
        loss = model(x, pos, labels=x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], len(calls)

    loss0, grads0, calls0 = run(False)
    loss1, grads1, calls1 = run(True)
    assert calls0 == 3 and calls1 == 6  # each block's forward starts again during backward
    assert torch.allclose(loss0, loss1, atol=1e-6)
    assert all(torch.allclose(g0, g1, atol=1e-6) for g0, g1 in zip(grads0, grads1))
    assert math.isfinite(loss0.item())


def test_explicit_head_dim_and_llama3_rope_scaling_args():
    """head_dim other than dim / heads (Qwen3's shape) sizes the attention; a preset re-derives it from a new
    shape; rope_scaling takes the llama3 type's four numbers only, and leaves plain RoPE's frequencies alone."""
    from zerotrain.modeling.model import rope_inv_freq

    args = tiny(head_dim=32)
    model = Transformer(args)
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert count_params(args)["total"] == sum(p.numel() for p in model.parameters())
    assert preset("debug", dim=256).head_dim == 64 and preset("debug").head_dim == 32
    llama3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
              "original_max_position_embeddings": 16}
    assert tiny(rope_scaling=llama3).rope_scaling == {**llama3, "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0}
    for bad, message in (({"rope_type": "yarn", "factor": 4.0}, "rope_scaling must be {'rope_type': 'llama3'"),
                         ({**llama3, "beta": 1}, "rope_scaling: unknown key 'beta'"),
                         ({**llama3, "high_freq_factor": 1}, "high_freq_factor 1.0 must exceed low_freq_factor 1.0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            tiny(rope_scaling=bad)
    with pytest.raises(ValueError, match="head dim 15 must be even"):
        tiny(head_dim=15)
    plain = rope_inv_freq(16, 10000.0, "cpu")
    scaled = rope_inv_freq(16, 10000.0, "cpu", tiny(rope_scaling=llama3).rope_scaling)
    wavelen = 2 * math.pi / plain  # short wavelengths kept, long ones divided by the factor, the band between moved
    assert torch.equal(scaled[wavelen < 4], plain[wavelen < 4]) and wavelen.max() > 16
    assert torch.allclose(scaled[wavelen > 16], plain[wavelen > 16] / 8)
