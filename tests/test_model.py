import pytest
import torch

from zerotrain.modeling.model import ModelArgs, Transformer, count_params, preset


def tiny(**kw):
    return ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100), **kw})


def test_shapes_and_vocab_padding():
    args = tiny()
    assert args.vocab_size == 128  # padded to a multiple of 64
    torch.manual_seed(0)
    m = Transformer(args)
    x = torch.randint(0, 100, (3, 17))
    assert m(x).shape == (3, 17, 128)
    n = count_params(args)
    assert n["total"] == sum(p.numel() for p in m.parameters())


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    x = torch.randint(0, 100, (1, 20))
    y = x.clone()
    y[0, 12:] = torch.randint(0, 100, (8,))
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.allclose(a[0, :12], b[0, :12], atol=1e-6)
    assert not torch.allclose(a[0, 12:], b[0, 12:], atol=1e-3)


def test_documents_in_a_packed_row_are_isolated():
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    doc_a, doc_b = torch.randint(0, 100, (9,)), torch.randint(0, 100, (11,))
    row = torch.cat([doc_a, doc_b])[None]
    pos = torch.cat([torch.arange(9), torch.arange(11)])[None]
    perturbed = row.clone()
    perturbed[0, :9] = torch.randint(0, 100, (9,))
    with torch.no_grad():
        packed, changed, alone = m(row, pos), m(perturbed, pos), m(doc_b[None])
    assert torch.allclose(packed[0, 9:], changed[0, 9:], atol=1e-5)
    assert torch.allclose(packed[0, 9:], alone[0], atol=1e-5)


def test_loss_ignores_masked_labels_and_init_is_deterministic():
    torch.manual_seed(3)
    a = Transformer(tiny())
    torch.manual_seed(3)
    b = Transformer(tiny())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    x = torch.randint(0, 100, (2, 10))
    labels = x.clone()
    labels[:, 5] = -100
    loss = a(x, labels=labels)
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.5


@pytest.mark.parametrize("kw,message", [
    (dict(dim=100, n_heads=3), "not divisible by n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "not divisible by n_kv_heads"),
    (dict(n_layers=0), "n_layers must be a positive integer"),
])
def test_inconsistent_args_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_unknown_preset():
    with pytest.raises(KeyError, match="unknown model preset"):
        preset("enormous")
