"""Resume on another world size (zerotrain.dataio.pipeline.reshard): every document of the interrupted epoch
exactly once.

The oracle reads documents back from what the loaders EMIT (packed rows), plus what the last
packers still hold and what the sources still had to give: each document's text carries its
own id, so a repeat or a gap shows up as a count other than 1.
"""
import json
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.pipeline.loader import Batches, load_data, make_loader, open_data, plain
from zerotrain.dataio.pipeline.reshard import check_documents, check_reshard, documents_split, reshard_loader_states
from zerotrain.dataio.sources.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_id
SEED, SEQ, MB = 11, 64, 2
DOC = re.compile(r"([ab]\d{4}):[a-z ]*:\1\.")
WORDS = "every rank reads its part and nothing twice".split()


def id_mix(root, n=(70, 50), on_exhausted="stop", weights=(0.6, 0.4)):
    """Source a (jsonl) and b (txt); every document is shorter than a row (best-fit never cuts
    it) and names itself at both ends: 'a0012:its part:a0012.'."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for tag, count in zip("ab", n):
        texts[tag] = [f"{tag}{i:04d}:" + " ".join(rng.choice(WORDS, rng.integers(1, 6))) + f":{tag}{i:04d}."
                      for i in range(count)]
    with open(root / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["a"])
    (root / "b.txt").write_text("\n\n".join(texts["b"]) + "\n")
    (root / "mix.json").write_text(json.dumps({"on_exhausted": on_exhausted, "sources": [
        {"name": "a", "path": "a.jsonl", "weight": weights[0]}, {"name": "b", "path": "b.txt", "weight": weights[1]}]}))
    data = load_data(open_data(str(root / "mix.json"), ByteTokenizer()))
    return data, [t for tag in "ab" for t in texts[tag]]


def text(tokens) -> str:
    return bytes(np.asarray(tokens, np.int64).astype(np.uint8)).decode()


class Ledger:
    """Pieces of documents read back from emitted rows, held state and the sources' rest.

    A piece is what lies between two EOS (a whole document, or with greedy packing the tail of a
    document cut at a batch end). `cut(head, tail)` records, at a world-size change, an old
    part's stream ending inside a document (`head`, emitted) whose rest (`tail`) was in its
    packer's carry: the tail must later be emitted exactly once, possibly itself cut again.
    """

    def __init__(self, expected: list, packing: str):
        self.expected, self.packing = expected, packing
        self.pieces = Counter()
        self.cuts: list[tuple[str, str]] = []

    def emitted(self, batches: list) -> str:
        """One part's batches, in order; returns the head of a document cut at the end (greedy)."""
        if self.packing == "best-fit":
            for b in batches:
                for ids, pos in zip(b["input_ids"].numpy(), b["position_ids"].numpy()):
                    starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
                    for a, z in zip(starts[:-1], starts[1:]):
                        if ids[a] != EOS:  # padding is a run of EOS
                            assert ids[z - 1] == EOS and EOS not in ids[a:z - 1]
                            assert DOC.fullmatch(text(ids[a:z - 1]))  # best-fit never cuts a short document
                            self.pieces[text(ids[a:z - 1])] += 1
            return ""
        stream = np.concatenate([b["input_ids"].numpy().ravel() for b in batches]) if batches else np.zeros(0, int)
        cuts = [-1] + list(np.flatnonzero(stream == EOS))
        for a, z in zip(cuts[:-1], cuts[1:]):
            self.pieces[text(stream[a + 1:z])] += 1
        return text(stream[cuts[-1] + 1:])

    def changed(self, heads: list[str], old_parts: list[dict]):
        for head, part in zip(heads, old_parts):
            pk = part["packer"]
            carry = pk["carry"] if pk["packing"] == "greedy" else []
            assert bool(head) <= bool(len(carry))
            if len(carry):
                self.cuts.append((head, text(carry[:-1])))

    def held(self, part: dict):
        """What a part's final state still holds: the packer's rows or carry, carried documents."""
        for d in part.get("carried", []):
            self.pieces[text(d)] += 1
        pk = part["packer"]
        if pk["packing"] == "greedy":
            if len(pk["carry"]):
                assert pk["carry"][-1] == EOS
                self.pieces[text(pk["carry"][:-1])] += 1
            return
        for tokens, starts, used in [r[1:] for r in pk["open"]] + pk["ready"]:
            bounds = list(starts) + [used]
            for a, z in zip(bounds[:-1], bounds[1:]):
                assert tokens[z - 1] == EOS
                self.pieces[text(tokens[a:z - 1])] += 1

    def drained(self, data, part: dict, p: int, parts: int):
        """Take, from a loader in the part's final state, the rest of every source's current epoch."""
        loader = make_loader(data, p, parts, SEED, SEQ, MB, self.packing)
        loader.load_state_dict(part)
        for src in loader.stream.sources:
            while True:
                epoch, got = src.epoch, src.take(1)
                if not got or src.epoch != epoch:
                    break
                self.pieces[text(got[0])] += 1

    def check(self):
        """Every document exactly once, once each cut document is joined back (latest cut first:
        a tail may have been cut again at a later change)."""
        pieces = self.pieces.copy()
        for head, tail in reversed(self.cuts):
            assert pieces[tail] > 0, f"the tail {tail!r} of {head!r} was never emitted"
            pieces[tail] -= 1
            pieces[head + tail] += 1
        pieces = +pieces
        want = Counter(self.expected)
        assert pieces == want, (f"repeated: {[k for k, c in pieces.items() if c > 1][:3]},"
                                f" missing: {list((want - pieces).elements())[:3]},"
                                f" not documents: {[k for k in pieces if k not in want][:3]}")


def run_worlds(data, expected, worlds, steps, workers, packing, use_batches=True, last_steps=10 ** 9):
    """Run world sizes worlds[0], worlds[1], ... for steps[k] steps each (the last one until the
    data runs out, or last_steps; any stops early if the data runs out), re-splitting the loader
    states at every change; check the ledger; return the final states."""
    ledger, per = Ledger(expected, packing), max(1, workers)
    settings_ = {"workers": workers, "persistent_workers": False}
    states, heads = None, []
    for phase, world in enumerate(worlds):
        limit = steps[phase] if phase < len(worlds) - 1 else last_steps
        if states is not None:
            ledger.changed(heads, [p for s in states for p in s["parts"]])
            states = reshard_loader_states(data, json.loads(json.dumps(states)), world, SEED, SEQ, MB, packing)
            assert len(states) == world and all(s["workers"] == workers for s in states)
        new_states, heads = [], []
        for rank in range(world):
            if use_batches:  # the real thing: Batches, with a background worker when workers == 1
                b = Batches(data, rank, world, SEED, SEQ, MB, settings_, packing)
                if states is not None:
                    b.load_state_dict(states[rank])
                got = []
                while len(got) < limit and (x := b.next()) is not None:
                    got.append(x)
                new_states.append(b.state_dict())
                b.close()
                heads.append(ledger.emitted(got))  # one part per rank here (workers 0 or 1)
            else:  # workers simulated: part rank * per + w of world * per, as Batches' workers build them
                parts = []
                for w in range(per):
                    loader = make_loader(data, rank * per + w, world * per, SEED, SEQ, MB, packing)
                    if states is not None:
                        loader.load_state_dict(states[rank]["parts"][w])
                    got = []
                    while len(got) < limit and (x := loader.next_batch()) is not None:
                        got.append(x)
                    heads.append(ledger.emitted(got))
                    parts.append(loader.state_dict())
                new_states.append(plain({"workers": workers, "parts": parts}))
        states = new_states
    parts = [p for s in states for p in s["parts"]]
    ledger.changed(heads, parts)  # greedy: the rest of a document cut at the very end is in the final carry
    for p, part in enumerate(parts):
        ledger.held(part)
        ledger.drained(data, part, p, len(parts))
    ledger.check()
    return states


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2), (3, 2), (2, 3), (3, 2, 1)])
@pytest.mark.parametrize("workers", [0, 1])
def test_every_document_once_across_a_world_size_change(tmp_path, worlds, workers):
    """"stop" sources: the last world runs until the data runs out; then nothing is left but what
    the packers hold and what could not fill a batch. 3 -> 2 -> 1 changes twice before any step
    of the middle world: what the first change carried must survive the second."""
    data, expected = id_mix(tmp_path)
    run_worlds(data, expected, list(worlds), [4, 0], workers, "best-fit")


@pytest.mark.parametrize("worlds", [(2, 1), (1, 2), (3, 2)])
def test_every_document_once_with_restart_sources_and_full_packers(tmp_path, worlds):
    """"restart" sources: the packer pulls OPEN_TOKENS at a time, so at the change it holds many
    finished rows as well as open ones. The new world stops after a few steps; the rest of the
    epoch is then drained from the sources (until each starts its next epoch)."""
    data, expected = id_mix(tmp_path, n=(1500, 1000), on_exhausted="restart")
    states = run_worlds(data, expected, list(worlds), [3], 0, "best-fit", last_steps=3)
    assert all(len(p["packer"]["ready"]) > 10 for s in states for p in s["parts"])


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (3, 2), (2, 3)])
def test_greedy_carry_is_emitted_once_across_a_world_size_change(tmp_path, old, new):
    data, expected = id_mix(tmp_path)
    run_worlds(data, expected, [old, new], [3, None], 0, "greedy")


def test_state_after_the_change_is_exact_plain_and_keeps_the_totals(tmp_path):
    data, _ = id_mix(tmp_path)
    old = []
    for rank in range(2):
        loader = make_loader(data, rank, 2, SEED, SEQ, MB)
        for _ in range(3):
            loader.next_batch()
        old.append(plain({"workers": 0, "parts": [loader.state_dict()]}))
    # The old packers hold open rows: that is the carry-over the change must hand on.
    assert all(p["parts"][0]["packer"]["open"] for p in old)
    new = reshard_loader_states(data, old, 3, SEED, SEQ, MB, "best-fit")
    assert json.loads(json.dumps(new)) == new  # plain data, as the checkpoint's client_state holds it
    for key in ("tokens", "documents"):
        for i in range(2):
            counts = [s["parts"][0]["stream"][key][i] for s in new]
            assert sum(counts) == sum(s["parts"][0]["stream"][key][i] for s in old)
            assert max(counts) - min(counts) <= 1  # split evenly: every new part keeps the mix's shares
    # 2 -> 3: old part j's packer goes to new part j unchanged; new part 2 starts empty.
    assert [s["parts"][0]["packer"] for s in new[:2]] == [s["parts"][0]["packer"] for s in old]
    assert not new[2]["parts"][0]["packer"]["open"]
    # 2 -> 1: one part takes both packers: rows closed ones stay rows, open rows become carried documents.
    one = reshard_loader_states(data, old, 1, SEED, SEQ, MB, "best-fit")[0]["parts"][0]
    n_open = sum(len(s["parts"][0]["packer"]["open"]) for s in old)
    assert len(one["carried"]) >= n_open and not one["packer"]["open"]


@pytest.mark.parametrize("workers", [0, 1])
def test_same_world_size_is_unchanged_and_exact_resume_holds_after_a_change(tmp_path, workers):
    data, _ = id_mix(tmp_path, n=(400, 300), on_exhausted="restart")
    settings_ = {"workers": workers, "persistent_workers": False}
    a = Batches(data, 0, 2, SEED, SEQ, MB, settings_)
    for _ in range(5):
        a.next()
    saved = [a.state_dict(), Batches(data, 1, 2, SEED, SEQ, MB, settings_).state_dict()]
    a.close()
    assert reshard_loader_states(data, saved, 2, SEED, SEQ, MB, "best-fit") == saved  # nothing to re-split
    # After a change, the new state format (pending documents, carried documents) resumes bit for bit.
    new = reshard_loader_states(data, saved, 1, SEED, SEQ, MB, "best-fit")[0]
    b = Batches(data, 0, 1, SEED, SEQ, MB, settings_)
    b.load_state_dict(new)
    for _ in range(3):
        b.next()
    mid = json.loads(json.dumps(b.state_dict()))
    assert mid["parts"][0]["stream"]["sources"][0]["pending"]  # still inside the re-split epoch
    expected = [b.next()["input_ids"].clone() for _ in range(6)]
    b.close()
    c = Batches(data, 0, 1, SEED, SEQ, MB, settings_)
    c.load_state_dict(mid)
    assert all(np.array_equal(c.next()["input_ids"], e) for e in expected)
    c.close()


def test_restart_sources_start_the_next_epoch_on_the_new_split(tmp_path):
    data, expected = id_mix(tmp_path, on_exhausted="restart")
    old = []
    for rank in range(2):
        loader = make_loader(data, rank, 2, SEED, SEQ, MB)
        for _ in range(4):
            loader.next_batch()
        old.append(plain({"workers": 0, "parts": [loader.state_dict()]}))
    new = reshard_loader_states(data, old, 3, SEED, SEQ, MB, "best-fit")
    for q, state in enumerate(new):
        loader = make_loader(data, q, 3, SEED, SEQ, MB)
        loader.load_state_dict(state["parts"][0])
        for i, src in enumerate(loader.stream.sources):
            pending = len(state["parts"][0]["stream"]["sources"][i]["pending"])
            src.take(pending)
            # Then a whole epoch of exactly this new part's documents (i, i + 3, ...), each once.
            epoch = [bytes(d) for d in src.take(src.n)]
            store = data.stores[i]
            assert sorted(epoch) == sorted(bytes(store.doc(d)) for d in range(q, len(store), 3))


@settings(max_examples=40, deadline=None)
@given(worlds=st.lists(st.integers(1, 4), min_size=2, max_size=3), steps=st.lists(st.integers(0, 6), min_size=2,
       max_size=2), workers=st.integers(0, 2), packing=st.sampled_from(["best-fit", "greedy"]),
       n=st.tuples(st.integers(12, 40), st.integers(12, 40)))
def test_property_every_document_once_over_any_sequence_of_world_sizes(tmp_path_factory, worlds, steps, workers,
                                                                        packing, n):
    data, expected = id_mix(tmp_path_factory.mktemp("mix"), n=n)
    run_worlds(data, expected, worlds, steps + [None], workers, packing, use_batches=False)


def test_streamed_source_refuses_a_world_size_change(tmp_path):
    data, _ = id_mix(tmp_path)
    raw = json.loads((tmp_path / "mix.json").read_text())
    raw["sources"][0]["streaming"] = True  # "a", the jsonl one
    (tmp_path / "mix.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="source 'a' is streamed"):  # from the mix alone, before loading
        check_reshard(open_data(str(tmp_path / "mix.json"), ByteTokenizer()), 2, 1)
    data = load_data(open_data(str(tmp_path / "mix.json"), ByteTokenizer()))
    check_reshard(data, 2, 2)  # the same world size: nothing to re-split
    with pytest.raises(DataError) as e:
        reshard_loader_states(data, [{"workers": 0, "parts": []}] * 2, 1, SEED, SEQ, MB, "best-fit")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("source 'a' is streamed:") and "cannot change world size (2 -> 1)" in msg


def test_bad_loader_states_are_one_line_errors(tmp_path):
    data, _ = id_mix(tmp_path)
    good = [plain({"workers": 0, "parts": [make_loader(data, r, 2, SEED, SEQ, MB).state_dict()]}) for r in range(2)]
    damaged = json.loads(json.dumps(good))
    del damaged[1]["parts"][0]["stream"]["sources"][0]["pos"]
    other = json.loads(json.dumps(good))
    other[1]["workers"] = 1
    smaller, _ = id_mix(tmp_path / "smaller", n=(60, 50))  # source 'a' lost 10 documents since the save
    for states, d, want in [(damaged, data, "not in the format"), (other, data, "disagree on the number of workers"),
                            (good, smaller, "source 'a': the checkpoint's loaders saw 70 documents, the data now has 60"),
                            (good, data, "with 'best-fit' packing, this run packs 'greedy'")]:
        with pytest.raises(DataError) as e:
            reshard_loader_states(d, states, 1, SEED, SEQ, MB, "greedy" if "greedy" in want else "best-fit")
        assert want in str(e.value) and "\n" not in str(e.value)


def test_a_checkpoint_names_the_documents_its_loaders_split_and_other_data_is_refused(tmp_path):
    """documents_split goes into the checkpoint's meta (run_state.py); check_documents compares it with the data
    before a resume writes or converts anything (run_plan.py). Workers' parts and a re-split's pending lists
    count too; a streamed source is not counted."""
    data, _ = id_mix(tmp_path)
    states = [Batches(data, r, 2, SEED, SEQ, MB, {"workers": 2, "prefetch_factor": 2}).state_dict() for r in range(2)]
    assert documents_split(states) == [70, 50]
    check_documents(data, [70, 50], "checkpoint c")
    check_documents(data, [70, None], "checkpoint c")  # streamed: its position is the stream's own
    resplit = reshard_loader_states(data, states, 1, SEED, SEQ, MB, "best-fit")
    assert documents_split(resplit) == [70, 50]
    smaller, _ = id_mix(tmp_path / "smaller", n=(70, 44))
    for counts, want in [([70, 50], "checkpoint c: its loaders split 50 documents of source 'b' (held-out ones not counted, long"
                                     " ones cut into pieces), the data now gives 44: the source changed"),
                         ([70], "checkpoint c: its loaders read 1 source(s), the data has 2")]:
        with pytest.raises(DataError) as e:
            check_documents(smaller, counts, "checkpoint c")
        assert str(e.value).startswith(want) and "\n" not in str(e.value)


def test_pending_documents_are_tokenized_like_any_other(tmp_path):
    """A Hugging Face tokenizer: documents are tokenized in blocks (not read as bytes), pending ones too."""
    from zerotrain.dataio.sources.tokenizer import HFTokenizer, train_bpe

    data, texts = id_mix(tmp_path, on_exhausted="restart")
    tok = HFTokenizer(train_bpe(texts, 300, tmp_path / "bpe"))
    data = load_data(open_data(str(tmp_path / "mix.json"), tok))
    old = []
    for rank in range(2):
        loader = make_loader(data, rank, 2, SEED, SEQ, MB)
        for _ in range(3):
            loader.next_batch()
        old.append(plain({"workers": 0, "parts": [loader.state_dict()]}))
    new = reshard_loader_states(data, old, 1, SEED, SEQ, MB, "best-fit")[0]["parts"][0]
    loader = make_loader(data, 0, 1, SEED, SEQ, MB)
    loader.load_state_dict(new)
    for i, src in enumerate(loader.stream.sources):
        pending = new["stream"]["sources"][i]["pending"]
        want = [tok.encode(data.stores[i].text(d)) for d in pending]
        assert len(pending) > 10 and [len(t) for t in want] == src.peek_lengths(len(want)).tolist()
        assert [list(t) for t in src.take(len(pending))] == want
    assert loader.next_batch()["input_ids"].shape == (MB, SEQ)
