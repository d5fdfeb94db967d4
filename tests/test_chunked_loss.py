"""The chunked next-token loss (modeling/model.py `LMHead`, modeling/loss.py `chunked_next_token_loss`): the same loss and
gradients as the definition on full logits (`next_token_loss`) to 1e-6 in fp32, for the mean and the
token-weighted sum, tied and untied, with ignored labels and rows without any; no tensor of (B, T, V)
elements is ever made; and under a real 2-rank ZeRO-3 launch the head weight is gathered by the head's
own hooks, once per forward and once per backward whatever the number of chunks."""
from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import BIN, REPO, free_port
from zerotrain.modeling.loss import chunked_next_token_loss, next_token_loss
from zerotrain.modeling.model import ModelArgs, Transformer


def tiny(**kw):
    return ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100), **kw})


def batch(B=3, T=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 100, (B, T), generator=g)
    pos = torch.cat([torch.arange(5), torch.arange(9), torch.arange(T - 14)]).expand(B, T)
    labels = x.clone()
    labels[0, 3:8] = -100  # a prompt inside a row
    labels[1] = -100  # a row with no labels at all
    labels[2, -1] = -100
    return x, pos, labels


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    (loss * 0.37).backward()  # an upstream gradient other than 1, as DeepSpeed's 1/grad_accum gives
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_1e6(a, b):
    """Equal to 1e-6, relative to the tensor's scale (a sum-reduced loss's gradients are ~count x larger)."""
    assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 7, 63, 10_000])  # one token, not dividing B*T, exactly B*T, one chunk
def test_same_loss_and_gradients_as_full_logits(tied, reduction, chunk):
    torch.manual_seed(0)
    model = Transformer(tiny(tie_embeddings=tied))
    model.lm_head.chunk_tokens = chunk
    x, pos, labels = batch()

    ref_loss, ref_grads = loss_and_grads(model, lambda: next_token_loss(model(x, pos), labels, reduction))
    loss, grads = loss_and_grads(model, lambda: model(x, pos, labels=labels, loss_reduction=reduction))
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert_close_1e6(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and ("lm_head.weight" in grads) != tied
    for name in grads:
        assert_close_1e6(grads[name], ref_grads[name])
    with torch.no_grad():  # evaluation: the same loss, no gradients computed
        assert_close_1e6(model(x, pos, labels=labels, loss_reduction=reduction), ref_loss)


def test_logits_without_labels_and_edge_cases():
    torch.manual_seed(0)
    model = Transformer(tiny())
    x, pos, labels = batch()
    head_inputs = []
    model.lm_head.register_forward_hook(lambda mod, inputs, out: head_inputs.append(inputs[0]))
    logits = model(x, pos)
    assert logits.shape == (3, 21, 128)  # without labels: the logits, as nn.Linear gives them
    assert torch.equal(logits, torch.nn.functional.linear(head_inputs[0], model.lm_head.weight))
    assert list(model.state_dict()).count("lm_head.weight") == 1 and isinstance(model.lm_head, torch.nn.Linear)
    nothing = torch.full_like(labels, -100)
    assert model(x, pos, labels=nothing, loss_reduction="sum").item() == 0.0  # an SFT micro-batch without responses
    assert torch.isnan(model(x, pos, labels=nothing)) and torch.isnan(next_token_loss(logits, nothing))  # as before
    with pytest.raises(ValueError, match="loss reduction must be 'mean' or 'sum', got 'avg'"):
        model(x, pos, labels=labels, loss_reduction="avg")


def test_backward_twice_is_refused_not_wrong():
    torch.manual_seed(0)
    model = Transformer(tiny())
    x, pos, labels = batch()
    loss = model(x, pos, labels=labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the chunked next-token loss twice"):
        loss.backward()


class LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_batch_by_vocab_is_ever_made():
    """What the issue's 7.1 GB came from: (B, T, V) logits, their fp32 copy, the log-softmax and its
    gradient. Here the vocabulary dwarfs everything else, so the largest tensor of a forward + backward
    is one chunk's logits or the weight-shaped gradient."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=4096)
    torch.manual_seed(0)
    model = Transformer(args)
    model.lm_head.chunk_tokens = 16
    B, T = 4, 64
    x = torch.randint(0, 4096, (B, T))
    with LargestTensor() as seen:
        model(x, labels=x).backward()
    assert seen.largest == max(16 * args.vocab_size, args.vocab_size * args.dim)
    with LargestTensor() as full:
        next_token_loss(model(x), x).backward()
    assert full.largest >= B * (T - 1) * args.vocab_size  # the check above would see the full path


def test_bf16_gradients_track_the_full_logits_path():
    """bf16 activations and weights: the chunked path rounds where the full path does (the fp32 softmax's
    gradient cast to bf16 before the matmuls); the weight gradient is accumulated over chunks in fp32."""
    torch.manual_seed(0)
    model = Transformer(tiny()).to(torch.bfloat16)
    model.lm_head.chunk_tokens = 8
    x, pos, labels = batch()
    ref_loss, ref = loss_and_grads(model, lambda: next_token_loss(model(x, pos), labels))
    loss, got = loss_and_grads(model, lambda: model(x, pos, labels=labels))
    assert loss.dtype == torch.float32 and abs(loss.item() - ref_loss.item()) < 1e-2
    for name in got:
        assert got[name].dtype == torch.bfloat16
        err = ((got[name].float() - ref[name].float()).norm() / ref[name].float().norm()).item()
        assert err < 2e-2, (name, err)


def test_chunked_loss_function_directly_matches_definition():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :4] = -100
    ref = next_token_loss(hidden @ weight.t(), labels)
    got = chunked_next_token_loss(hidden, weight, labels, "mean", 5)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert_close_1e6(got, ref)
    for a, b in zip(got_grads, ref_grads):
        assert_close_1e6(a, b)
    assert got_grads[0][:, -1].abs().max() == 0  # the last position of a row predicts nothing


@pytest.mark.launches
def test_zero3_gathers_the_head_once_per_pass_and_matches_the_plain_model(tmp_path):
    """A real 2-rank ZeRO-3 launch (tests/helpers/head_zero3_harness.py), tied and untied heads, 8 chunks
    per micro-batch: DeepSpeed fetches lm_head's parameters once in forward and once in backward; the
    loss and the full gradients equal a plain model's full-logits loss on the same weights."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "helpers" / "head_zero3_harness.py"), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((tmp_path / "result.json").read_text())
    assert [r["tied"] for r in results] == [False, True]
    for res in results:
        assert res["chunks"] == 8
        assert res["head_fetches"] == {"forward": 1, "backward": 1}, res
        assert abs(res["loss"] - res["reference_loss"]) <= 1e-6 * max(1, abs(res["reference_loss"])), res
        assert res["grad_max_err"] <= 1e-6, res


class Traffic(TorchDispatchMode):
    """Records each operator run under it: its name, the (shape, dtype) of every tensor it reads (its arguments,
    `out=` excepted) and writes (what it returns), and the bytes of both. Views (t, slice, expand...) move
    nothing and are not recorded. An operator's internal temporaries are not seen: which is why the loss no
    longer calls aten's logsumexp (an (n, V) fp32 temporary of its own, invisible here). An allocation
    (aten.empty) writes nothing and is not counted; gather and scatter_add_ are counted as if they moved their
    whole (n, V) operand, though they touch n of its elements: the counts are an upper bound."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and not str(func).startswith("aten.empty"):
            flat = [*args, *(v for k, v in kwargs.items() if k != "out")]
            reads = [(tuple(t.shape), t.dtype, t.numel() * t.element_size()) for t in flat if isinstance(t, torch.Tensor)]
            outs = out if isinstance(out, (tuple, list)) else (out,)
            writes = [(tuple(t.shape), t.dtype, t.numel() * t.element_size()) for t in outs if isinstance(t, torch.Tensor)]
            self.ops.append((str(func), reads, writes))
        return out


def test_the_head_gradient_at_the_llama3_vocabulary_is_one_kernel_per_chunk_without_a_vd_temporary():
    """bf16 on an accelerator (meta tensors here: shapes and operators, no memory) at a 128,256 vocabulary and
    the planner's GPU chunk for ws-1.3b: each chunk's head gradient is accumulated into the fp32 gradient by one
    addmm (out_dtype fp32), never written as a (V, D) product first and added after. Bytes per chunk, counted
    operator by operator: the head weight is read exactly twice (the logits' product and d(hidden)'s: three
    products with three different contractions, so no aten operator can share one read between them; Liger's
    fused linear cross-entropy reads it twice too), the fp32 accumulator read and written once, and the (n, V)
    logits moved at most 54 bytes per element as counted: 42 really (12 of the count are gather's and
    scatter_add_'s, which touch n elements). Before, 58 were counted and aten's logsumexp moved 24 more unseen
    (74 really): its temporary is gone, and the scaling writes the 16-bit gradient in the same pass."""
    V, D, T, chunk = 128256, 2048, 4096, 1693
    hidden = torch.empty(1, T, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(V, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
    labels = torch.zeros(1, T, dtype=torch.long, device="meta")
    with Traffic() as seen:
        loss = chunked_next_token_loss(hidden, weight, labels, chunk_tokens=chunk)
    # a chunk's operators: from its logits' product (the head read as (D, V)) to the next chunk's
    starts = [i for i, (op, reads, _) in enumerate(seen.ops) if (D, V) in [shape for shape, _, _ in reads]]
    assert len(starts) == -(-T // chunk)
    per_chunk = [seen.ops[a:b] for a, b in zip(starts, starts[1:])]
    for ops in per_chunk[:-1]:  # full chunks (the last holds T mod chunk tokens)
        n = chunk
        head = [(op, shape) for op, reads, _ in ops for shape, dtype, _ in reads
                if dtype == torch.bfloat16 and sorted(shape) == sorted((V, D))]
        assert head == [("aten.mm.default", (D, V)), ("aten.mm.default", (V, D))], head
        accumulator = [(op, side) for op, reads, writes in ops for side, tensors in (("read", reads), ("write", writes))
                       for shape, dtype, _ in tensors if (shape, dtype) == ((V, D), torch.float32)]
        assert accumulator == [("aten.addmm.dtype_out", "read"), ("aten.addmm.dtype_out", "write")], accumulator
        assert not [op for op, _, writes in ops for shape, dtype, _ in writes
                    if shape == (V, D) and dtype != torch.float32]  # no (V, D) product per chunk
        moved = sum(b for _, reads, writes in ops for _, _, b in reads + writes)
        fixed = 2 * (2 * V * D) + 2 * (4 * V * D) + 6 * n * D * 2  # head x2, accumulator r+w, h and d(hidden)
        assert moved - fixed <= 54 * n * V + 512 * n, (moved - fixed) / (n * V)  # 512 x n: the (n,) vectors
    loss.backward()
    assert weight.grad.shape == (V, D) and weight.grad.dtype == torch.bfloat16
