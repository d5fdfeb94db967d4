import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.modeling.initial import init_weights
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


class NormalDraws(TorchDispatchMode):
    """Records (device type, dtype, generator given) of every normal_ drawn under it."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.normal_.default:
            self.draws.append((args[0].device.type, args[0].dtype, kwargs.get("generator") is not None))
        return func(*args, **kwargs)


def test_init_draws_on_the_cpu_in_fp32_from_its_own_generator_whatever_the_parameters():
    """As under deepspeed.zero.Init on a GPU (parameters in bf16 on cuda:LOCAL_RANK, the default generator not
    where a CPU build leaves it): the values are drawn on the CPU in fp32 from init_weights' own generator,
    and the weights are the fp32 CPU build's, cast."""
    torch.manual_seed(3)
    reference = Transformer(tiny())
    torch.manual_seed(3)
    torch.rand(1000)  # the default generator elsewhere (a CUDA build's constructors draw from the CUDA one)
    try:
        torch.set_default_dtype(torch.bfloat16)
        model = Transformer(tiny())
    finally:
        torch.set_default_dtype(torch.float32)
    torch.manual_seed(3)
    with NormalDraws() as seen:
        init_weights(model)
    drawn = [n for n, _ in model.named_parameters() if not n.endswith("norm.weight")]
    assert seen.draws == [("cpu", torch.float32, True)] * len(drawn)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16)), name


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
