"""Long documents cut into pieces before the split across ranks (zerotrain.dataio.format.pieces.make_pieces):
a single-document source trains on any number of ranks, token shares and exactly-once hold over
pieces, text is cut only at UTF-8 character starts, prepared shards are cut like the mix, and
the summary before training names documents, pieces and a .txt file that gave few documents."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.pieces import cut_pieces, default_piece_len, make_pieces
from zerotrain.dataio.pipeline.commands import describe_data
from zerotrain.dataio.pipeline.loader import Batches, load_data, make_loader, open_data
from zerotrain.dataio.sources.tokenizer import ByteTokenizer

# Disjoint byte alphabets: a byte of a packed row says by itself which source it came from.
# "one" is UTF-8 with 2- and 3-byte characters: its cuts must move back to character starts.
ONE_LINE = "añb€c"  # bytes a, 0xC3 0xB1, b, 0xE2 0x82 0xAC, c (+ newline)
ALPHABETS = {"one": set(("\n" + ONE_LINE).encode()), "few": set(b"0123456789"), "many": set(b"!#$%&()*+")}
WEIGHTS = {"one": 0.5, "few": 0.3, "many": 0.2}


def write_sources(root, one_lines=6000, extra_one=None):
    """one.txt: a single document (one record per line, no blank lines: sample_by paragraph gives
    one document), few.jsonl: 3 long documents, many.jsonl: 300 short ones."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    lines = ["".join(rng.choice(list(ONE_LINE), rng.integers(5, 30))) for _ in range(one_lines)]
    (root / "one.txt").write_text("\n".join(lines) + "\n")
    with open(root / "few.jsonl", "w") as f:
        for n in (3000, 9000, 20000):
            f.write(json.dumps({"text": "".join(rng.choice(list("0123456789"), n))}) + "\n")
    with open(root / "many.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": "".join(rng.choice(list("!#$%&()*+"), rng.integers(20, 200)))}) + "\n")
    sources = [{"name": "one", "path": "one.txt", "weight": WEIGHTS["one"], **(extra_one or {})},
               {"name": "few", "path": "few.jsonl", "weight": WEIGHTS["few"]},
               {"name": "many", "path": "many.jsonl", "weight": WEIGHTS["many"]}]
    (root / "mix.json").write_text(json.dumps({"sources": sources}))
    return root / "mix.json"


def per_source(ids: np.ndarray) -> dict:
    ids = ids[ids < 256]  # EOS and padding are no source's bytes
    return {name: int(np.isin(ids, list(alphabet)).sum()) for name, alphabet in ALPHABETS.items()}


def test_single_document_source_trains_on_1_to_4_ranks(tmp_path):
    mix = write_sources(tmp_path)
    seq_len = 64
    whole = (tmp_path / "one.txt").read_bytes().rstrip(b"\n")
    for world in (1, 2, 3, 4):
        data = load_data(open_data(str(mix), ByteTokenizer()), default_piece_len(seq_len), world)
        one = data.stores[0]
        assert one.documents == 1 and len(one) >= world and one.piece_len == 8 * seq_len
        got = []
        for rank in range(world):
            loader = make_loader(data, rank, world, 5, seq_len, 4)
            src = loader.stream.sources[0]
            got.append(src.ids)  # this rank's pieces of the one document
            ids = np.concatenate([loader.next_batch()["input_ids"].numpy().ravel() for _ in range(160)])
            counts = per_source(ids)  # ~41k tokens on this rank, counted from the emitted rows
            total = sum(counts.values())
            assert total > 0.95 * len(ids)
            for name, want in WEIGHTS.items():
                assert abs(counts[name] / total - want) < 0.03, (world, rank, name, counts[name] / total)
        # The ranks hold disjoint pieces that together are the whole document, in order.
        ids = np.sort(np.concatenate(got))
        assert np.array_equal(ids, np.arange(len(one)))
        assert b"".join(bytes(one.doc(int(d))) for d in ids) == whole


def test_pieces_keep_the_exact_resume(tmp_path):
    mix = write_sources(tmp_path, one_lines=300)
    data = load_data(open_data(str(mix), ByteTokenizer()), 256, 2)
    a = Batches(data, 1, 2, 7, 64, 2)
    for _ in range(100):  # several epochs of the single document's pieces on this rank
        a.next()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next()["input_ids"].clone() for _ in range(60)]
    b = Batches(data, 1, 2, 7, 64, 2)
    b.load_state_dict(state)
    assert all(np.array_equal(b.next()["input_ids"], e) for e in expected)
    assert state["parts"][0]["stream"]["sources"][0]["epoch"] >= 1


def text_store(texts: list[str]) -> DocStore:
    raw = "".join(texts).encode()
    lengths = np.array([len(t.encode()) for t in texts], np.int64)
    end = np.cumsum(lengths)
    return DocStore(name="t", kind="text", chunks=[np.frombuffer(raw, np.uint8)],
                    chunk=np.zeros(len(texts), np.int32), start=end - lengths, end=end)


def pieces_by_document(store: DocStore, pieces: DocStore) -> list[list[bytes]]:
    out = [[] for _ in range(len(store))]
    for i in range(len(pieces)):
        d = int(np.searchsorted(store.start, pieces.start[i], side="right")) - 1
        assert store.start[d] <= pieces.start[i] < pieces.end[i] <= store.end[d]
        out[d].append(bytes(pieces.doc(i)))
    return out


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.text(alphabet=st.sampled_from("ab\n é€😀"), min_size=1, max_size=60), min_size=1,
                      max_size=6),
       piece_len=st.one_of(st.none(), st.integers(1, 40)), parts=st.integers(1, 8))
def test_pieces_cover_every_document_exactly_once_at_utf8_starts(texts, piece_len, parts):
    store = text_store(texts)
    chars = sum(len(t) for t in texts)
    if chars < parts:  # fewer characters than parts: no cut can give every part a piece
        with pytest.raises(DataError, match=r"source 't': .* cannot be split across 3 ranks"):
            make_pieces(store, piece_len, parts, True, "3 ranks")
        return
    pieces = make_pieces(store, piece_len, parts, True, "3 ranks")
    assert len(pieces) >= parts and pieces.documents == len(texts)
    for text, got in zip(texts, pieces_by_document(store, pieces)):
        assert "".join(g.decode("utf-8") for g in got) == text  # every piece is valid UTF-8, in order
        if pieces.piece_len is not None and pieces.piece_len >= 4:
            assert all(len(g) <= pieces.piece_len + 3 for g in got)
    if piece_len is not None and pieces.piece_len == piece_len and piece_len >= 4:
        # Cut where asked: every cut is within 3 bytes before a multiple of the bound.
        for text, got in zip(texts, pieces_by_document(store, pieces)):
            cuts = np.cumsum([len(g) for g in got])[:-1]
            assert all(0 <= (-c) % piece_len <= 3 for c in cuts)
            assert len(got) == -(-len(text.encode()) // piece_len)


def test_token_pieces_are_exact_and_cut_finer_only_when_needed():
    tokens = np.arange(10_000, dtype=np.uint32)
    lengths = np.array([5000, 3000, 1500, 500])
    end = np.cumsum(lengths)
    store = DocStore(name="s", kind="tokens", chunks=[tokens], chunk=np.zeros(4, np.int32), start=end - lengths,
                     end=end)
    pieces = cut_pieces(store, 1024, utf8=False)
    assert pieces.lengths.tolist() == [1024] * 4 + [904] + [1024] * 2 + [952] + [1024, 476] + [500]
    assert np.array_equal(np.concatenate([pieces.doc(i) for i in range(len(pieces))]), tokens)
    assert (pieces.documents, pieces.cut_documents, pieces.longest) == (4, 3, 5000)
    assert make_pieces(store, None, 4, False, "4 ranks") is store  # enough documents: nothing cut
    finer = make_pieces(store, None, 5, False, "5 ranks")  # 4 documents, 5 parts: ceil(10000 / 5)
    assert finer.piece_len == 2000 and len(finer) == 3 + 2 + 1 + 1
    with pytest.raises(DataError, match=r"source 's': 4 document\(s\) of 10,000 tokens in all cannot be split"):
        make_pieces(store, None, 10_001, False, "10001 ranks")


def test_a_source_too_small_for_the_ranks_is_refused_in_load_data(tmp_path):
    (tmp_path / "t.txt").write_text("abc\n")
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "tiny", "path": "t.txt", "weight": 1}]}))
    data = open_data(str(tmp_path / "mix.json"), ByteTokenizer())
    with pytest.raises(DataError) as e:
        load_data(data, 512, 2, workers=2)  # 3 bytes, 2 ranks x 2 workers: before any loader exists
    assert str(e.value) == ("source 'tiny': 1 document(s) of 3 bytes in all cannot be split across 2 ranks x 2 data"
                            " worker(s); add data or use fewer ranks")
    data = load_data(data, 512, 3)  # 3 ranks: one character each
    assert [bytes(data.stores[0].doc(i)) for i in range(3)] == [b"a", b"b", b"c"]


def test_prepared_shards_are_cut_like_the_mix(tmp_path):
    from zerotrain.dataio.format.shards import read_manifest
    from zerotrain.dataio.pipeline.prepare import prepare

    mix = write_sources(tmp_path / "data", one_lines=2000)
    out = prepare(str(mix), ByteTokenizer(), tmp_path / "shards", shard_tokens=20_000, log=lambda *a: None)
    manifest = read_manifest(out)
    assert [s["documents"] for s in manifest["sources"]] == [1, 3, 300]  # shards hold whole documents
    a = load_data(open_data(str(mix), ByteTokenizer()), 500, 2)
    b = load_data(open_data(str(out), ByteTokenizer()), 500, 2)
    assert all(np.array_equal(x.lengths, y.lengths) for x, y in zip(a.stores, b.stores))  # the same pieces
    assert [(s.documents, s.cut_documents) for s in b.stores] == [(1, 1), (3, 3), (300, 0)]
    one = b.stores[0]
    for i in range(len(one)):  # the byte-tokenizer shard was cut at character starts too
        bytes(one.doc(i).astype(np.uint8)).decode("utf-8")
    la, lb = make_loader(a, 1, 2, 9, 96, 3), make_loader(b, 1, 2, 9, 96, 3)
    for _ in range(40):
        assert np.array_equal(la.next_batch()["input_ids"], lb.next_batch()["input_ids"])


def test_summary_names_documents_pieces_and_a_txt_file_with_one_document(tmp_path):
    mix = write_sources(tmp_path, one_lines=3000)
    data = load_data(open_data(str(mix), ByteTokenizer()), 2048, 2)
    lines = describe_data(data, 100_000)
    text = "\n".join(lines)
    assert "tokenizer bytes, pieces of 2,048;" in lines[0]
    one_bytes = len((tmp_path / "one.txt").read_bytes().rstrip(b"\n"))
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("one "))
    assert "sample_by paragraph)" in lines[i]
    n_pieces = len(data.stores[0])
    assert lines[i + 1].strip() == f"1 document of {one_bytes:,} tokens, cut into {n_pieces:,} pieces of 2,048"
    assert lines[i + 2] == ("  WARNING: source 'one': one.txt: 1 document (sample_by paragraph: no blank lines found);"
                            " use sample_by line? (3,000 lines)")
    assert "3 documents, mean 10,667 / max 20,000 tokens, 3 cut into 17 pieces of 2,048" in text
    assert "300 documents, mean " in text and "none longer than 2,048, none cut" in text
    assert text.count("WARNING") == 1  # only the one-document file

    # sample_by line: 3,000 documents, no warning; the summary shows the choice.
    mix = write_sources(tmp_path / "by_line", one_lines=3000, extra_one={"sample_by": "line"})
    lines = describe_data(load_data(open_data(str(mix), ByteTokenizer()), 2048, 2), 100_000)
    assert any("sample_by line)" in ln for ln in lines) and not any("WARNING" in ln for ln in lines)
    assert any(ln.strip().startswith("3,000 documents, mean ") for ln in lines)


def test_summary_says_when_a_source_was_cut_finer_for_the_ranks(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 1000)
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "t", "path": "t.txt", "weight": 1}]}))
    data = load_data(open_data(str(tmp_path / "mix.json"), ByteTokenizer()), 512, 2, workers=2)
    assert data.stores[0].lengths.tolist() == [250] * 4
    lines = describe_data(data, 10_000)
    assert lines[2].strip() == ("1 document of 1,000 tokens, cut into 4 pieces of 250 (the bound 512 leaves fewer"
                                " pieces than 2 rank(s) x 2 data worker(s): cut finer so each gets one)")
    assert "  WARNING: source 't': t.txt: 1 document (sample_by paragraph: no blank lines found)" in lines
