"""Evaluation: the holdout (dataio/sources/holdout.py), eval rows, and the all-rank Evaluator
(launcher/components/evaluate.py).

Unit tests run in one process without a process group; one real 2-rank `deepspeed` launch
(ZeRO-3, tests/helpers/eval_harness.py) checks the collective path against a single-process
evaluation of the same rows and weights.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import BIN, REPO, free_port, write_mix
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.pieces import default_piece_len
from zerotrain.dataio.pipeline.loader import cut_data, make_loader, open_data
from zerotrain.dataio.sources.holdout import (MAX_FRACTION, holdout_rows, holdout_summary, mix_rows, pack_rows,
                                              split_holdout)
from zerotrain.dataio.sources.readers import load_text_source
from zerotrain.dataio.sources.tokenizer import ByteTokenizer
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.modeling.model import ModelArgs, Transformer

EOS = ByteTokenizer.eos_id


def unique_docs(prefix: str, n: int, seed: int, max_words: int = 25) -> list[str]:
    """Documents that name themselves ("p0042: ..."), short enough to fit in a 256-token row."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta eps zeta eta theta iota kappa lambda mu".split()
    return [f"{prefix}{i:04d}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, max_words)))
            for i in range(n)]


def write_unique_mix(root, n_prose=300, n_notes=200, weights=(0.6, 0.4), extra=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "prose.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in unique_docs("p", n_prose, 1)))
    (root / "notes.txt").write_text("\n\n".join(unique_docs("n", n_notes, 2)) + "\n")
    sources = [{"name": "prose", "path": "prose.jsonl", "weight": weights[0]},
               {"name": "notes", "path": "notes.txt", "weight": weights[1]}] + (extra or [])
    (root / "mix.json").write_text(json.dumps({"sources": sources}))
    # What load_data reads before it cuts long documents into pieces: where the holdout is taken.
    data = open_data(str(root / "mix.json"), ByteTokenizer())
    data.stores = [None if s.streamed else load_text_source(s) for s in data.specs]
    return data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_unique_mix(tmp_path_factory.mktemp("holdout"))


def doc_keys(store) -> list[tuple]:
    return list(zip(store.chunk.tolist(), store.start.tolist(), store.end.tolist()))


def texts(store) -> list[str]:
    return [store.text(d) for d in range(len(store))]


def segments(input_ids: torch.Tensor, position_ids: torch.Tensor, decode=None, eos=EOS) -> list[str]:
    """The documents in packed rows: segments start at position 0; text up to the EOS; padding dropped."""
    decode = decode or (lambda ids: bytes(ids).decode("utf-8"))
    out = []
    for ids, pos in zip(input_ids.tolist(), position_ids.tolist()):
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            seg = ids[a:b]
            body = seg[:seg.index(eos)] if eos in seg else seg
            if body:
                out.append(decode(body))
    return out


# --------------------------------------------------------------------------------------------
# The holdout
# --------------------------------------------------------------------------------------------

def test_holdout_is_deterministic_per_seed_disjoint_and_complete(data):
    train, held = split_holdout(data.stores, data.specs, seed=7, eval_tokens=2000, tokenizer=data.tokenizer)
    train2, held2 = split_holdout(data.stores, data.specs, seed=7, eval_tokens=2000, tokenizer=data.tokenizer)
    _, other = split_holdout(data.stores, data.specs, seed=8, eval_tokens=2000, tokenizer=data.tokenizer)
    for i, store in enumerate(data.stores):
        assert doc_keys(held[i]) == doc_keys(held2[i]) and doc_keys(train[i]) == doc_keys(train2[i])
        assert doc_keys(held[i]) != doc_keys(other[i])  # the seed picks the documents
        tr, ev = set(doc_keys(train[i])), set(doc_keys(held[i]))
        assert not tr & ev and tr | ev == set(doc_keys(store)) and len(tr) + len(ev) == len(store)
        assert doc_keys(train[i]) == sorted(doc_keys(train[i]))  # natural order kept
        assert train[i].chunks is store.chunks and held[i].chunks is store.chunks  # no text copied
    line = holdout_summary(train, held, data.specs)[0]
    assert line.startswith(f"holdout prose: {len(held[0])} of {len(data.stores[0])} documents, ")


def test_holdout_sizes_follow_eval_tokens_and_weights_within_the_cap(data):
    lengths = [s.lengths + 1 for s in data.stores]
    _, held = split_holdout(data.stores, data.specs, seed=3, eval_tokens=2000)
    for spec, ev, ln in zip(data.specs, held, lengths):
        tokens = int((ev.lengths + 1).sum())
        target = 2000 * spec.weight
        assert target <= tokens < target + ln.max()  # the shortest prefix reaching the target
    _, tiny = split_holdout(data.stores, data.specs, seed=3, eval_tokens=1)
    assert [len(s) for s in tiny] == [1, 1]  # at least one document per source
    _, huge = split_holdout(data.stores, data.specs, seed=3, eval_tokens=10**9)
    for store, ev, ln in zip(data.stores, huge, lengths):
        assert 1 <= len(ev) <= int(MAX_FRACTION * len(store))
        assert (ev.lengths + 1).sum() <= MAX_FRACTION * ln.sum()


def test_holdout_refuses_a_source_too_small_and_bad_eval_tokens(tmp_path, data):
    small = write_unique_mix(tmp_path, n_prose=300, n_notes=9)
    with pytest.raises(DataError, match=r"source 'notes': 9 document\(s\) are too few .* --eval-data"):
        split_holdout(small.stores, small.specs, seed=1, eval_tokens=100)
    for bad in (0, -5, True, 1.5):
        with pytest.raises(DataError, match="--eval-tokens"):
            split_holdout(data.stores, data.specs, seed=1, eval_tokens=bad)


def test_holdout_takes_whole_documents_before_they_are_cut_into_pieces(data):
    cut = cut_data(dataclasses.replace(data), list(data.stores), piece_len=50, world=1)
    with pytest.raises(ValueError, match="already cut into pieces"):
        split_holdout(cut.stores, cut.specs, seed=1, eval_tokens=100)


def test_streamed_sources_get_no_holdout(tmp_path):
    extra = [{"name": "stream", "path": "prose.jsonl", "weight": 0.5, "streaming": True}]
    d = write_unique_mix(tmp_path, extra=extra)
    train, held = split_holdout(d.stores, d.specs, seed=1, eval_tokens=500)
    assert d.stores[2] is None and train[2] is None and held[2] is None
    assert set(holdout_rows(held, d.specs, d.tokenizer, 128)) == {"prose", "notes"}


def test_holdout_of_a_hugging_face_tokenized_source(tmp_path, data):
    from zerotrain.dataio.sources.tokenizer import HFTokenizer, train_bpe

    tok = HFTokenizer(train_bpe(texts(data.stores[0]), 300, tmp_path / "bpe"))
    train, held = split_holdout(data.stores, data.specs, seed=4, eval_tokens=600, tokenizer=tok)  # below the cap
    for spec, ev in zip(data.specs, held):
        real = sum(len(t) + 1 for t in tok.encode_batch(texts(ev)))  # the target is in tokens, estimated
        assert 0.8 * 600 * spec.weight <= real <= 1.25 * 600 * spec.weight + 60
    rows = holdout_rows(held, data.specs, tok, seq_len=256)
    for spec, ev in zip(data.specs, held):
        r = rows[spec.name]
        assert sorted(segments(r["input_ids"], r["position_ids"], tok.decode, tok.eos_id)) == sorted(texts(ev))


def test_holdout_of_prepared_token_shards():
    from zerotrain.dataio.format.docstore import DocStore
    from zerotrain.dataio.format.mix import SourceSpec

    tokens = (np.arange(1000) % 250).astype(np.uint16)
    store = DocStore(name="s", kind="tokens", chunks=[tokens], chunk=np.zeros(100, np.int32),
                     start=np.arange(0, 1000, 10), end=np.arange(10, 1001, 10))
    spec = SourceSpec(name="s", weight=1.0, path="x")
    train, held = split_holdout([store], [spec], seed=0, eval_tokens=55)
    assert len(held[0]) == 5 and len(train[0]) == 95  # 5 documents of 10 tokens + EOS
    rows = holdout_rows(held, [spec], ByteTokenizer(), seq_len=64)["s"]
    assert int((rows["labels"] != -100).sum()) == 5 * 10  # each document's first token has no label
    assert sorted(np.concatenate([store.doc(int(d)) for d in range(100)
                                  if d * 10 in held[0].start.tolist()]).tolist()) == \
        sorted(rows["input_ids"][(rows["input_ids"] != EOS)].tolist())


def test_no_eval_document_is_in_the_training_stream_over_more_than_an_epoch(data):
    train, held = split_holdout(data.stores, data.specs, seed=11, eval_tokens=3000)
    eval_texts = {t for s in held for t in texts(s)}
    train_texts = {t for s in train for t in texts(s)}
    assert len(eval_texts) > 10 and not eval_texts & train_texts
    seen, world = [], 2
    data_train = cut_data(dataclasses.replace(data), train, default_piece_len(256), world)  # as load_data does
    for rank in range(world):
        loader = make_loader(data_train, rank, world, seed=11, seq_len=256, micro_batch=4)
        # The packer reads ahead and holds open rows (here up to ~2 epochs of a rank's documents):
        # read every source 5 times on every rank so that at least 2 epochs come out as rows.
        while min(s.epoch for s in loader.stream.sources) < 5:
            batch = loader.next_batch()
            seen += segments(batch["input_ids"], batch["position_ids"])
    seen_set = set(seen)
    assert len(seen) >= 2 * len(train_texts)  # more than an epoch of rows was checked
    assert not seen_set & eval_texts  # no held-out document, whole or as a row fragment...
    assert seen_set <= train_texts  # ...every segment is a whole training document (all fit a row)...
    assert seen_set == train_texts  # ...and every training document was read


# --------------------------------------------------------------------------------------------
# Eval rows
# --------------------------------------------------------------------------------------------

def test_holdout_rows_hold_every_eval_document_once_per_source(data):
    _, held = split_holdout(data.stores, data.specs, seed=5, eval_tokens=4000)
    rows = holdout_rows(held, data.specs, data.tokenizer, seq_len=256)  # every document fits a row
    again = holdout_rows(held, data.specs, data.tokenizer, seq_len=256)
    for spec, ev in zip(data.specs, held):
        r = rows[spec.name]
        assert all(torch.equal(r[k], again[spec.name][k]) for k in r)  # deterministic
        assert r["input_ids"].shape[1] == 256 and r["input_ids"].dtype == torch.int64
        assert sorted(segments(r["input_ids"], r["position_ids"])) == sorted(texts(ev))  # each exactly once
        starts = r["position_ids"] == 0
        assert (r["labels"][starts] == -100).all()
        real = r["labels"] != -100
        assert torch.equal(r["labels"][real], r["input_ids"][real])
        assert int(real.sum()) == int(ev.lengths.sum())  # every token but each document's first predicted
        # positions count up by one inside a segment
        step = r["position_ids"][:, 1:] - r["position_ids"][:, :-1]
        assert ((step == 1) | (r["position_ids"][:, 1:] == 0)).all()


def test_pack_rows_splits_long_documents_and_drops_rows_with_nothing_to_predict():
    docs = [np.arange(1, 16, dtype=np.int64), np.arange(20, 24, dtype=np.int64)]  # 15 + EOS = 2 rows of 8
    rows = pack_rows(docs, seq_len=8, eos_id=EOS)
    assert rows["input_ids"].shape == (3, 8)
    assert (rows["labels"] != -100).sum() == (16 - 2) + (5 - 1)  # the row cut costs one label
    only_eos_left = pack_rows([np.arange(1, 9, dtype=np.int64)], seq_len=8, eos_id=EOS)
    assert only_eos_left["input_ids"].shape == (1, 8)  # the row holding the lone EOS had no label


def test_mix_rows_take_about_eval_tokens_by_weight_in_a_fixed_order(tmp_path):
    extra = [{"name": "stream", "path": "prose.jsonl", "weight": 0.5, "streaming": True}]
    d = write_unique_mix(tmp_path, weights=(0.3, 0.2), extra=extra)
    rows = mix_rows(d, seq_len=256, eval_tokens=5000)
    again = mix_rows(d, seq_len=256, eval_tokens=5000)
    assert list(rows) == ["prose", "notes", "stream"]
    longest = max(len(t) for s in d.stores if s is not None for t in texts(s)) + 1
    for spec in d.specs:
        r = rows[spec.name]
        assert all(torch.equal(r[k], again[spec.name][k]) for k in r)
        docs = segments(r["input_ids"], r["position_ids"])
        tokens = sum(len(t.encode()) + 1 for t in docs)
        assert 5000 * spec.weight <= tokens < 5000 * spec.weight + longest
    streamed = segments(rows["stream"]["input_ids"], rows["stream"]["position_ids"])
    assert sorted(streamed) == sorted(texts(d.stores[0])[:len(streamed)])  # the stream's first documents
    with pytest.raises(DataError, match="--eval-tokens"):
        mix_rows(d, seq_len=128, eval_tokens=0)


# --------------------------------------------------------------------------------------------
# The Evaluator without a process group
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=258))


@pytest.fixture(scope="module")
def rows(data):
    _, held = split_holdout(data.stores, data.specs, seed=2, eval_tokens=2500)
    out = holdout_rows(held, data.specs, data.tokenizer, seq_len=64)
    assert [len(r["input_ids"]) for r in out.values()] != [0, 0]
    return out


def direct_loss(model, rows) -> tuple[float, dict]:
    """Sum of every predicted token's loss over all rows at once, in float64."""
    total, per = [0.0, 0], {}
    with torch.no_grad():
        for name, r in rows.items():
            logits = model(r["input_ids"], r["position_ids"])
            labels = r["labels"][:, 1:].flatten()
            s = float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels, ignore_index=-100,
                                      reduction="sum"))
            n = int((labels != -100).sum())
            per[name] = s / n
            total = [total[0] + s, total[1] + n]
    return total[0] / total[1], per


def test_evaluator_equals_a_direct_token_sum_and_restores_the_mode(small_model, rows):
    small_model.train()
    m = Evaluator(rows, rank=0, world=1, micro_batch=3).evaluate(small_model)
    assert small_model.training
    loss, per = direct_loss(small_model.eval(), rows)
    assert m["val_loss"] == pytest.approx(loss, abs=1e-5)
    assert m["val_ppl"] == pytest.approx(np.exp(loss), rel=1e-5)
    assert m["val_loss_per_source"] == pytest.approx(per, abs=1e-5)
    Evaluator(rows, rank=0, world=1, micro_batch=2).evaluate(small_model)
    assert not small_model.training  # eval mode before: eval mode after
    assert all(p.grad is None for p in small_model.parameters())  # under no_grad


@pytest.mark.parametrize("world,micro_batch", [(2, 1), (3, 2), (5, 4)])
def test_rank_shares_sum_to_the_whole_with_the_same_forward_count_everywhere(small_model, rows, world, micro_batch):
    calls = [0]
    handle = small_model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        whole = Evaluator(rows, rank=0, world=1, micro_batch=micro_batch).evaluate(small_model)
        sums, passes, own = 0, set(), []
        for rank in range(world):
            ev = Evaluator(rows, rank=rank, world=world, micro_batch=micro_batch)
            calls[0] = 0
            with torch.no_grad():
                sums = sums + ev.local_sums(small_model)
            passes.add((ev.forward_passes, calls[0]))
            own.append(sum(len(r["input_ids"][rank::world]) for r in rows.values()))
    finally:
        handle.remove()
    assert len(set(own)) > 1  # the ranks really hold uneven numbers of rows
    (n_passes, n_calls), = passes  # every rank: the same count, and it runs exactly that many
    assert n_passes == n_calls
    split = Evaluator(rows, rank=0, world=world, micro_batch=micro_batch).finish(sums)
    assert split["val_tokens"] == whole["val_tokens"]
    assert split["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    assert split["val_loss_per_source"] == pytest.approx(whole["val_loss_per_source"], abs=1e-6)


def test_evaluator_restores_train_mode_when_the_forward_fails(rows):
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **_):
            raise RuntimeError("boom")

    model = Broken().train()
    with pytest.raises(RuntimeError, match="boom"):
        Evaluator(rows, rank=0, world=1, micro_batch=1).evaluate(model)
    assert model.training


def test_evaluator_refuses_bad_arguments(rows):
    with pytest.raises(ValueError, match="micro_batch"):
        Evaluator(rows, rank=0, world=1, micro_batch=0)
    with pytest.raises(ValueError, match="no eval rows"):
        Evaluator({}, rank=0, world=1, micro_batch=1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        Evaluator(rows, rank=2, world=2, micro_batch=1)


# --------------------------------------------------------------------------------------------
# 2 real ranks, ZeRO-3
# --------------------------------------------------------------------------------------------

@pytest.mark.launches
def test_two_rank_zero3_evaluation_equals_one_process(tmp_path):
    mix = write_mix(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "helpers" / "eval_harness.py"), str(mix), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == 2 and r0["held_params"] < 869_504  # ZeRO-3: no rank holds the whole model
    assert r0["own_rows"] == {"prose": 3, "notes": 1} and r1["own_rows"] == {"prose": 2, "notes": 0}  # uneven
    assert r0["eval_forwards"] == r1["eval_forwards"] == r0["forward_passes"] == 3  # padding passes on rank 1
    # ZeRO-3 gathered every parameter in every pass, on both ranks: a skipped pass would hang
    assert r0["eval_gathers"] == r1["eval_gathers"] == 3 * r0["param_tensors"]
    assert r0["training_after"] and r1["training_after"]
    assert r0["first"] == r1["first"] and r0["second"] == r1["second"]  # every rank: the same metrics
    assert r0["first"]["val_loss"] != r0["second"]["val_loss"]  # it evaluates the current weights
    for ref in (r0["single_process"], r0["direct"]):
        assert r0["second"]["val_tokens"] == ref["val_tokens"]
        assert abs(r0["second"]["val_loss"] - ref["val_loss"]) <= 1e-5
        for name, loss in ref["val_loss_per_source"].items():
            assert abs(r0["second"]["val_loss_per_source"][name] - loss) <= 1e-5
