"""The packed loader: token shares, exactly-once packing, rank sharding, exact state, exhaustion."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.format.packing import PACKINGS, make_packer
from zerotrain.dataio.pipeline.loader import Batches, Data, cut_data, load_data, make_loader, open_data, plain
from zerotrain.dataio.sources.tokenizer import ByteTokenizer

ALPHABETS = {"short": "abcdefgh", "long": "0123456789", "mid": "!#$%&()*+"}


def three_source_mix(root, weights=(0.5, 0.3, 0.2), n=400, extra=None):
    """Three sources with disjoint alphabets and very different document lengths, so a byte of
    the packed stream says by itself which source it came from."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    lengths = {"short": (5, 40), "long": (300, 1500), "mid": (50, 200)}
    for name, alphabet in ALPHABETS.items():
        lo, hi = lengths[name]
        docs = ["".join(rng.choice(list(alphabet), rng.integers(lo, hi))) for _ in range(n)]
        if name == "mid":
            (root / "mid.txt").write_text("\n\n".join(docs) + "\n")
        else:
            with open(root / f"{name}.jsonl", "w") as f:
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
    sources = [{"name": "short", "path": "short.jsonl", "weight": weights[0]},
               {"name": "long", "path": "long.jsonl", "weight": weights[1]},
               {"name": "mid", "path": "mid.txt", "weight": weights[2]}]
    mix = {"sources": sources, **(extra or {})}
    (root / "mix.json").write_text(json.dumps(mix))
    return root / "mix.json"


def source_of_bytes(ids: np.ndarray, labels: np.ndarray | None = None) -> dict:
    """Tokens per source, told apart by alphabet; with labels, each document's EOS (a trained
    EOS, label != -100) counts for the source of the token before it, as the mix schedule does."""
    counts = {}
    eos = np.zeros(len(ids), bool)
    if labels is not None:
        eos[1:] = (ids[1:] == ByteTokenizer.eos_id) & (labels[1:] != -100)
    for name, alphabet in ALPHABETS.items():
        mine = np.isin(ids, np.frombuffer(alphabet.encode(), np.uint8))
        counts[name] = int(mine.sum()) + int((eos[1:] & mine[:-1]).sum())
    return counts


@pytest.mark.parametrize("packing,seq_len", [("best-fit", 512), ("best-fit", 2048), ("greedy", 512)])
def test_realised_token_shares_match_weights_after_200k_tokens(tmp_path, packing, seq_len):
    data = load_data(open_data(str(three_source_mix(tmp_path)), ByteTokenizer()))
    loader = make_loader(data, rank=0, world=1, seed=3, seq_len=seq_len, micro_batch=4, packing=packing)
    ids, labels = [], []
    while sum(len(x) for x in ids) < 200_000:
        b = loader.next_batch()
        ids.append(b["input_ids"].numpy().ravel())
        labels.append(b["labels"].numpy().ravel())
    ids, labels = np.concatenate(ids), np.concatenate(labels)
    counts = source_of_bytes(ids, labels)  # counted from the emitted rows, not from the scheduler
    assert sum(counts.values()) > 0.98 * len(ids)  # the rest: padding and row-start EOS
    total = sum(counts.values())
    for (name, want) in zip(ALPHABETS, (0.5, 0.3, 0.2)):
        assert abs(counts[name] / total - want) < 0.02, (name, counts[name] / total)
    # And the scheduler's own count (with EOS) agrees with the weights within a document.
    for name, share in loader.stream.token_shares().items():
        assert abs(share - dict(zip(ALPHABETS, (0.5, 0.3, 0.2)))[name]) < 0.01


def unique_docs(lengths):
    """next_documents(n) serving document k as 1 + 1000 k + arange(length): every token unique."""
    served = []

    def next_documents(need):
        out, got = [], 0
        while got < need:
            k = len(served)
            d = 1 + 1000 * k + np.arange(lengths[k % len(lengths)], dtype=np.int64)
            served.append(d)
            out.append(d)
            got += len(d) + 1
        return out
    return next_documents, served


def buffered_tokens(packer) -> np.ndarray:
    """Tokens the packer holds (taken from the stream, not yet emitted), padding excluded."""
    st = packer.state_dict()
    if st["packing"] == "greedy":
        return np.asarray(st["carry"], np.int64)
    parts = [np.asarray(t)[:used] for _, t, _, used in st["open"]]
    parts += [np.asarray(t)[:used] for t, _, used in st["ready"]]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@pytest.mark.parametrize("packing", PACKINGS)
@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(0, 120), min_size=1, max_size=40), seq_len=st.integers(1, 48),
       micro=st.integers(1, 4), n_batches=st.integers(1, 12))
def test_every_token_of_every_document_appears_exactly_once(packing, lengths, seq_len, micro, n_batches):
    eos = 0
    next_documents, served = unique_docs(lengths)
    packer = make_packer(packing, seq_len, eos, micro)
    ids, pos, lab, real = [], [], [], 0
    for _ in range(n_batches):
        b = packer.next_batch(next_documents)
        assert b["input_ids"].shape == b["position_ids"].shape == b["labels"].shape == (micro, seq_len)
        assert b["cu_seqlens"][0] == 0 and b["cu_seqlens"][-1] == micro * seq_len
        assert b["max_seqlen"] == int(np.diff(b["cu_seqlens"]).max())
        ids.append(b["input_ids"].ravel())
        pos.append(b["position_ids"].ravel())
        lab.append(b["labels"].ravel())
        real += b["real_tokens"]
    ids, pos, lab = np.concatenate(ids), np.concatenate(pos), np.concatenate(lab)
    held = buffered_tokens(packer)
    # Every document token taken from the stream is emitted or still held, exactly once.
    taken = np.sort(np.concatenate(served))
    out = np.concatenate([ids[ids != eos], held[held != eos]])
    assert np.array_equal(np.sort(out), taken)
    # One EOS per document; everything else is padding, counted in real_tokens.
    n_pad = len(ids) - real
    assert int((ids == eos).sum()) - n_pad + int((held == eos).sum()) == len(served)
    if packing == "greedy":
        assert n_pad == 0 and np.array_equal(np.concatenate([ids, held]),
                                             np.concatenate([np.append(d, eos) for d in served]))
    # Positions count up within a segment and restart at 0; labels are -100 exactly at segment
    # starts and on padding, the token itself elsewhere.
    seg = np.cumsum(pos == 0)
    assert all(pos[t] == pos[t - 1] + 1 for t in range(1, len(pos)) if pos[t] != 0)
    assert np.all(pos[::seq_len] == 0)
    assert np.all(lab[pos == 0] == -100)
    real_mask = lab != -100
    assert np.array_equal(lab[real_mask], ids[real_mask])
    assert int((~real_mask & (pos != 0)).sum()) <= n_pad  # the only other -100s are padding
    # Within a segment, a document's tokens are consecutive; an EOS only ends its document.
    for s_id in np.unique(seg):
        toks = ids[seg == s_id]
        body = toks[toks != eos]
        assert np.all(np.diff(body) == 1) and len(np.unique((body - 1) // 1000)) <= 1
        if len(body) and eos in toks[:len(body)]:
            raise AssertionError("EOS inside a document")
    if packing == "best-fit":  # a document that fits in a row is never cut
        seg_of = dict(zip(ids[ids != eos].tolist(), seg[ids != eos].tolist()))
        for d in served:
            if 0 < len(d) < seq_len and all(t in seg_of for t in d.tolist()):
                assert len({seg_of[t] for t in d.tolist()}) == 1


class IdTokens:
    """Token ids that are neither bytes nor text: document k is 1000 (k + 1) + arange(length)."""
    name, eos_id = "ids", 0


@pytest.mark.parametrize("packing", PACKINGS)
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=10),
       piece_len=st.one_of(st.none(), st.integers(1, 120)), world=st.integers(1, 4), seq_len=st.integers(4, 48),
       micro=st.integers(1, 3))
def test_cut_documents_every_token_exactly_once_across_ranks(packing, lengths, piece_len, world, seq_len, micro):
    """Documents cut into pieces (load_data's cut), split across `world` ranks, each rank read to
    its end (on_exhausted stop): every token of every document is emitted, held by the packer
    or left untaken, exactly once over all ranks, and every piece is a document of its own."""
    lengths = np.asarray(lengths, np.int64)
    tokens = np.concatenate([1000 * (k + 1) + np.arange(n) for k, n in enumerate(lengths)])
    end = np.cumsum(lengths)
    store = DocStore(name="s", kind="tokens", chunks=[tokens], chunk=np.zeros(len(lengths), np.int32),
                     start=end - lengths, end=end)
    data = Data(kind="shards", path="(memory)", specs=(SourceSpec(name="s", weight=1.0, on_exhausted="stop"),),
                tokenizer=IdTokens(), stores=[])
    if int(lengths.sum()) < world:
        with pytest.raises(DataError, match="cannot be split across"):
            cut_data(data, [store], piece_len, world)
        return
    pieces = cut_data(data, [store], piece_len, world).stores[0]
    piece_of = np.repeat(np.arange(len(pieces)), pieces.lengths)  # token (in document order) -> its piece
    assert np.array_equal(np.concatenate([pieces.doc(i) for i in range(len(pieces))]), tokens)
    seen = []
    for rank in range(world):
        loader = make_loader(data, rank, world, 1, seq_len, micro, packing)
        rows = []
        while (b := loader.next_batch()) is not None:
            rows.append((b["input_ids"].ravel(), b["position_ids"].ravel(), b["labels"].ravel()))
        src = loader.stream.sources[0]
        assert src.n >= 1 and src.epoch == 0  # every rank had work; no piece was served twice
        ids, pos, lab = (np.concatenate([r[i].numpy() for r in rows]) if rows else np.zeros(0, np.int64)
                         for i in range(3))
        held = buffered_tokens(loader.packer)
        untaken = [pieces.doc(int(d)) for d in src.ids[src.order(0)[src.pos:]]]
        mine = np.concatenate([ids[ids != 0], held[held != 0], *untaken])
        rank_tokens = np.concatenate([pieces.doc(int(d)) for d in src.ids])
        assert np.array_equal(np.sort(mine), np.sort(rank_tokens))  # this rank's pieces, exactly once
        seen.append(mine)
        # A piece is a document: its first token opens a segment (position 0, no label), and a
        # segment's tokens are consecutive tokens of one piece.
        body = ids != 0
        piece_ids = piece_of[np.searchsorted(tokens, ids[body])]
        first = ids[body] == tokens[pieces.start[piece_ids]]
        assert np.all(pos[body][first] == 0) and np.all(lab[body][first] == -100)
        seg = np.cumsum(pos == 0)[body]
        for s_id in np.unique(seg):
            assert len(np.unique(piece_ids[seg == s_id])) == 1 and np.all(np.diff(ids[body][seg == s_id]) == 1)
    assert np.array_equal(np.sort(np.concatenate(seen)), tokens)  # ranks: disjoint, together everything


@pytest.mark.parametrize("packing", PACKINGS)
def test_packer_state_round_trip(packing):
    lengths = [i % 23 + 1 for i in range(1, 60)]
    a_next, a_served = unique_docs(lengths)
    a = make_packer(packing, 7, 0, 3)
    for _ in range(5):
        a.next_batch(a_next)
    state, n = json.loads(json.dumps(plain(a.state_dict()))), len(a_served)
    expected = [a.next_batch(a_next)["input_ids"] for _ in range(8)]
    b = make_packer(packing, 7, 0, 3)
    b.load_state_dict(state)
    b_next, b_served = unique_docs(lengths)
    for _ in range(n):  # the documents a took before its state: b's stream continues after them
        b_next(1)
    assert all(np.array_equal(b.next_batch(b_next)["input_ids"], e) for e in expected)


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_state_restores_the_exact_stream(tmp_path, workers):
    mix = three_source_mix(tmp_path, n=60)  # small: several epochs (restarts) within the test
    data = load_data(open_data(str(mix), ByteTokenizer()))
    settings_ = {"workers": workers, "persistent_workers": False}
    a = Batches(data, 0, 2, 7, 128, 2, settings_)
    for _ in range(40):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))  # what travels in client_state is plain data
    expected = [a.next()["input_ids"].clone() for _ in range(80)]
    b = Batches(data, 0, 2, 7, 128, 2, settings_)
    b.load_state_dict(state)
    got = [b.next()["input_ids"] for _ in range(80)]
    assert all(np.array_equal(x, y) for x, y in zip(got, expected))
    assert max(s["epoch"] for p in state["parts"] for s in p["stream"]["sources"]) >= 1  # crossed an epoch


def test_ranks_get_disjoint_documents_and_together_all(tmp_path):
    mix = three_source_mix(tmp_path, n=50)
    data = load_data(open_data(str(mix), ByteTokenizer()))
    seen = []
    for rank in range(3):
        stream = make_loader(data, rank, 3, 1, 64, 1).stream
        src = stream.sources[1]  # "long"
        docs = src.take(src.n)  # one epoch of this rank's part
        seen.append({bytes(d) for d in docs})
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])
    store = data.stores[1]
    assert set().union(*seen) == {bytes(store.doc(d)) for d in range(len(store))}


def test_stop_policy_ends_the_stream_without_repeating(tmp_path):
    mix = three_source_mix(tmp_path, n=30, extra={"on_exhausted": "stop"})
    data = load_data(open_data(str(mix), ByteTokenizer()))
    loader = make_loader(data, 0, 1, 1, 64, 2)
    batches = []
    while (b := loader.next_batch()) is not None:
        batches.append(b["input_ids"].numpy().ravel())
    assert loader.exhausted in ALPHABETS and loader.next_batch() is None
    # No document was served twice: each source's epoch counter never advanced.
    assert all(s.epoch == 0 for s in loader.stream.sources)
    # The run ends at the last batch the data could fill. What the unfinished batch took went
    # back to the stream; every document taken before it was emitted or is held in the packer's
    # open rows, exactly once; the rest of the source is what that batch could not fill.
    for i, name in enumerate(ALPHABETS):
        src, store = loader.stream.sources[i], data.stores[i]
        taken = int(store.lengths[src.ids[src.order(0)[:src.pos]]].sum())
        emitted = source_of_bytes(np.concatenate(batches))[name]
        held = source_of_bytes(buffered_tokens(loader.packer))[name]
        assert emitted + held == taken <= int(store.lengths.sum())


def test_streamed_source_resumes_exactly(tmp_path):
    """The hub path (datasets streaming + split_dataset_by_node + state_dict), run on a local file."""
    mix = three_source_mix(tmp_path, n=700)
    raw = json.loads(mix.read_text())
    raw["sources"][1]["streaming"] = True  # "long" through datasets' IterableDataset
    mix.write_text(json.dumps(raw))
    data = load_data(open_data(str(mix), ByteTokenizer()))
    assert data.stores[1] is None
    a = make_loader(data, 1, 2, 5, 256, 2)
    for _ in range(30):
        a.next_batch()
    state = json.loads(json.dumps(plain(a.state_dict())))
    expected = [a.next_batch()["input_ids"] for _ in range(60)]
    b = make_loader(data, 1, 2, 5, 256, 2)
    b.load_state_dict(state)
    assert all(np.array_equal(b.next_batch()["input_ids"], e) for e in expected)
    # Rank 1 of 2 streams only its half of the records.
    docs = {d["text"] for d in map(json.loads, (tmp_path / "long.jsonl").read_text().splitlines())}
    ids = np.concatenate([e.numpy().ravel() for e in expected])
    assert source_of_bytes(ids)["long"] > 0 and len(docs) == 700


def test_summary_before_training_estimates_epochs_and_warns(tmp_path):
    from zerotrain.dataio.pipeline.commands import describe_data

    mix = three_source_mix(tmp_path, n=100, extra={"warn_epochs": 3})
    raw = json.loads(mix.read_text())
    raw["sources"][2]["on_exhausted"] = "stop"
    mix.write_text(json.dumps(raw))
    data = load_data(open_data(str(mix), ByteTokenizer()))
    sizes = [int(s.lengths.sum()) + len(s) for s in data.stores]
    run_tokens = 4 * sizes[0] * 2  # "short" (weight 0.5) would be read 4 times
    lines = describe_data(data, run_tokens)
    short = next(ln for ln in lines if ln.strip().startswith("short"))
    assert f"{sizes[0]:,} tokens" in short and "~4.00 epochs" in short
    assert any("WARNING: source 'short' will repeat ~4.0 times (more than warn_epochs 3)" in ln for ln in lines)
    assert not any("source 'long'" in ln and "WARNING" in ln for ln in lines)
    assert not any("source 'mid'" in ln and "WARNING" in ln for ln in lines)  # < 1 epoch
    lines = describe_data(data, int(2 * sizes[2] / 0.2))  # "mid" (weight 0.2, on_exhausted stop): 2 epochs
    assert any("WARNING: source 'mid' runs out after ~50% of the run" in ln and "training will stop there" in ln
               for ln in lines)
