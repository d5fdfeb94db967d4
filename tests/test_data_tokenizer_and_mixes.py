"""`zerotrain tokenizer train` (byte-level BPE in the Hugging Face format), HF-tokenized mixes and
prepared shards, and the mixes shipped in dataio/mixes/."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.pipeline.loader import load_data, make_loader, open_data
from zerotrain.dataio.sources.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mix_path):
    out = tmp_path_factory.mktemp("tok") / "bpe"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "tokenizer", "train", "--data", str(mix_path),
                           "--vocab-size", "400", "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.launches
def test_trained_tokenizer_loads_in_transformers_and_round_trips(trained, mix_path):
    from transformers import AutoTokenizer

    ours = HFTokenizer(trained)
    theirs = AutoTokenizer.from_pretrained(str(trained))
    text = "the model reads every token of the packed row, ünïcödé too"
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == text  # byte-level: lossless
    assert theirs.eos_token == "<|endoftext|>" and ours.eos_id == theirs.eos_token_id
    assert 258 < ours.vocab_size <= 400  # a tiny corpus can saturate below the asked-for size
    assert len(ours.encode("the model reads")) < len("the model reads")  # merges were learnt


@pytest.mark.launches
def test_a_vocabulary_smaller_than_asked_is_said_and_recorded(tmp_path, mix_path):
    """~150k bytes of text cannot fill 32,000 entries: BPE runs out of pairs to merge; said, and recorded."""
    out = tmp_path / "bpe"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "tokenizer", "train", "--data", str(mix_path),
                           "--vocab-size", "32000", "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "tokenizer_training.json").read_text())
    obtained = HFTokenizer(out).vocab_size
    assert record["vocab_size_asked"] == 32000 and record["vocab_size_obtained"] == obtained < 32000
    assert record["documents"] == 800 and record["bytes"] > 100_000
    warning = proc.stdout.strip().splitlines()[-1]
    assert warning.startswith(f"warning: the vocabulary came out smaller than --vocab-size 32,000: {obtained:,} tokens."
                              " Too little text: 800 document(s),")
    assert f"vocab {obtained:,} of the 32,000 asked" in proc.stdout


@pytest.mark.launches
def test_hf_tokenized_mix_and_shards_give_the_same_stream(trained, mix_path, tmp_path):
    tok = HFTokenizer(trained)
    shards = tmp_path / "shards"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "prepare", "--data", str(mix_path), "--tokenizer",
                           str(trained), "--out", str(shards)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["sha256"] == tok.sha256
    assert all(sh["tokenizer_sha256"] == tok.sha256 and len(sh["sha256"]) == 64 for sh in manifest["shards"])
    a = make_loader(load_data(open_data(str(mix_path), tok)), 0, 2, 9, 96, 3)
    b = make_loader(load_data(open_data(str(shards), tok)), 0, 2, 9, 96, 3)
    for _ in range(30):  # same documents, same order, same packing: tokenizing on the fly == prepared
        x, y = a.next_batch(), b.next_batch()
        assert np.array_equal(x["input_ids"], y["input_ids"])
    assert x["input_ids"].max() < tok.vocab_size


def test_shipped_mixes_validate():
    mix = parse_mix(REPO / "dataio" / "mixes" / "web-edu-pdf-med.json")
    shares = {s.name: round(s.weight, 6) for s in mix.sources}
    assert shares == {"fineweb-edu": 0.45, "cosmopedia": 0.25, "finepdfs": 0.20, "medqa-usmle": 0.10}
    assert all(s.hf and s.streamed for s in mix.sources)
    qa = mix.sources[-1]
    from zerotrain.dataio.sources.streamed import record_text

    record = {"question": "Q?", "options": {"A": "a", "B": "b", "C": "c", "D": "d"}, "answer_idx": "B",
              "answer": "b"}
    assert record_text(qa, record, pytest.fail) == "Question: Q?\nA. a\nB. b\nC. c\nD. d\nAnswer: B. b"
    problems = []
    assert record_text(qa, {"question": "Q?"}, problems.append) is None and "options" in problems[0]
    demo = json.loads((REPO / "dataio" / "mixes" / "demo.json").read_text())
    assert [(s["name"], s["weight"]) for s in demo["sources"]] == [("docs", 0.7), ("code", 0.3)]


@pytest.mark.launches
def test_hf_tokenized_text_is_cut_in_bytes_before_tokenizing(trained, tmp_path):
    """With a Hugging Face tokenizer a text source is cut in bytes of its UTF-8 text (at character
    starts) before tokenizing; the summary labels its lengths as bytes."""
    from zerotrain.dataio.pipeline.commands import describe_data

    tok = HFTokenizer(trained)
    text = "\n".join(f"line {i}: the model reads ünïcödé, €uro and 😀 too" for i in range(400))
    (tmp_path / "one.txt").write_text(text + "\n")
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "one", "path": "one.txt", "weight": 1}]}))
    data = load_data(open_data(str(tmp_path / "mix.json"), tok), 1000, 2)
    one = data.stores[0]
    assert one.documents == 1 and len(one) == -(-len(text.encode()) // 1000) and one.lengths.max() <= 1003
    assert "".join(one.text(i) for i in range(len(one))) == text  # every piece decodes: cut at character starts
    lines = describe_data(data, 10_000)
    assert any(ln.strip().startswith(f"1 document of {len(text.encode()):,} bytes (before tokenizing), cut into"
                                     f" {len(one)} pieces of 1,000") for ln in lines)
    for rank in range(2):
        loader = make_loader(data, rank, 2, 3, 64, 2)
        ids = np.concatenate([loader.next_batch()["input_ids"].numpy().ravel() for _ in range(20)])
        assert ids.max() < tok.vocab_size
        assert len(loader.stream.sources[0].ids) == len(range(rank, len(one), 2))  # every rank has pieces


def test_compressed_json_lines_give_the_documents_of_the_plain_file(tmp_path):
    """.jsonl.gz / .bz2 / .xz / .zst (docs/data.md): datasets decompresses them (zstandard for .zst, a dependency),
    the same documents as the plain file, in order."""
    import bz2
    import gzip
    import lzma

    import zstandard

    from zerotrain.dataio.pipeline.prepare import iter_documents
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    raw = "".join(json.dumps({"text": f"document {i}: " + "héllo wörld " * (i % 7 + 1)}) + "\n"
                  for i in range(50)).encode()
    (tmp_path / "plain.jsonl").write_bytes(raw)
    for suffix, pack in ((".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress),
                         (".zst", zstandard.ZstdCompressor().compress)):
        (tmp_path / f"c{suffix[1:]}.jsonl{suffix}").write_bytes(pack(raw))
    names = ["plain.jsonl", "cgz.jsonl.gz", "cbz2.jsonl.bz2", "cxz.jsonl.xz", "czst.jsonl.zst"]
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": n.split(".")[0], "weight": 1, "path": n} for n in names]}))
    specs = open_data(str(mix), ByteTokenizer()).specs
    docs = [[bytes(np.asarray(d[0] if isinstance(d, tuple) else d).astype(np.uint8)) for d in
             iter_documents(spec, ByteTokenizer())] for spec in specs]
    assert len(docs[0]) == 50 and docs[0][3].decode() == "document 3: " + "héllo wörld " * 4
    assert all(d == docs[0] for d in docs[1:])
