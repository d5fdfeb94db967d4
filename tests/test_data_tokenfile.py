"""Flat token files as a mix source (zerotrain.dataio.format.tokenfile): nanoGPT's layout (uint16 ids, every
document followed by the end-of-text id), written by the tests with a tokenizer built on disk (nothing
downloads). Documents split at the end-of-text id exactly as a reference split does; packed rows restart
positions after every EOS; a mix of a token file and a jsonl source trains (the real driver) and evaluates
on a .bin; exact resume and a world-size change hold as for shards; bad input is one line, exit 2."""
import json
from collections import Counter

import numpy as np
import pytest

from conftest import launch, read_metrics
from test_bad_input import snapshot
from test_data_reshard import DOC, WORDS, run_worlds
from zerotrain.dataio.format import tokenfile
from zerotrain.dataio.format.errors import DataError, UsageError
from zerotrain.dataio.pipeline.loader import Batches, load_data, make_loader, open_data
from zerotrain.dataio.sources.tokenizer import ByteTokenizer, load_tokenizer

EOS = 1000  # the tiny tokenizer's end-of-text id: ids 0..999 are words "t0".."t999"


def write_tokenizer(root):
    """A word-level tokenizer of 1,001 ids ("t0".."t999", then <|endoftext|> = 1000), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(EOS)} | {"<|endoftext|>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tok").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tok" / "tokenizer.json"))
    return str(root / "tok")


def nanogpt_bin(path, docs, eos=EOS, dtype=np.uint16):
    """As nanoGPT's prepare.py writes it: each document's ids, then the end-of-text id, back to back."""
    np.concatenate([np.append(np.asarray(d, np.int64), eos) for d in docs]).astype(dtype).tofile(path)


def reference_split(ids, eos):
    """The documents of a flat file, the slow obvious way: the runs between end-of-text ids, empty ones dropped."""
    out, cur = [], []
    for t in ids.tolist():
        if t == eos:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    out.append(cur)
    return [d for d in out if d]


def random_docs(n, seed, lo=5, hi=120):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, EOS, rng.integers(lo, hi)) for _ in range(n)]


def token_mix(root, name="mix.json", **entry):
    """A mix of one token-file source; `entry` changes its keys (None: leaves the key out)."""
    spec = {"name": "owt", "weight": 1, "path": "train.bin", "format": "tokens", "dtype": "uint16", "eos_id": EOS}
    (root / name).write_text(json.dumps({"sources": [{k: v for k, v in {**spec, **entry}.items() if v is not None}]}))
    return str(root / name)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_documents_split_at_the_end_of_text_id_like_a_reference_split(tmp_path, cache, monkeypatch):
    """Leading, doubled and trailing-missing end-of-text ids included; the scan is cached and a changed file
    (same size) is scanned again."""
    docs = random_docs(50, 1)
    ids = np.concatenate([[EOS], np.append(docs[0], EOS), [EOS]]
                         + [np.append(d, EOS) for d in docs[1:-1]] + [docs[-1]]).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    tok = load_tokenizer(write_tokenizer(tmp_path))
    store = load_data(open_data(token_mix(tmp_path), tok)).stores[0]
    want = reference_split(ids, EOS)
    assert len(want) == 50 and store.kind == "tokens" and store.empty_records == 2  # the leading and the doubled
    assert [store.doc(d).tolist() for d in range(len(store))] == [list(map(int, d)) for d in want]
    assert isinstance(store.chunks[0].base, np.memmap)  # read in place, not loaded
    assert len(list((cache / "token-files").glob("*.npy"))) == 1

    def no_scan(*a):
        raise AssertionError("scanned again")

    monkeypatch.setattr(tokenfile, "scan", no_scan)  # the second start reads the cache
    again = load_data(open_data(token_mix(tmp_path), tok)).stores[0]
    assert np.array_equal(again.start, store.start) and np.array_equal(again.end, store.end)
    monkeypatch.undo()
    monkeypatch.setenv("ZEROTRAIN_CACHE", str(cache))
    ids[ids == EOS] = 7  # the same size, no documents boundaries left but the file's end
    ids[-1] = EOS
    ids.tofile(tmp_path / "train.bin")
    assert len(load_data(open_data(token_mix(tmp_path), tok)).stores[0]) == 1


def test_packed_rows_restart_positions_after_every_end_of_text(tmp_path, cache):
    """Every packed segment (positions from 0) is a reference document followed by its EOS (the EOS ends the
    document it closes, at position len(doc)), or padding; over an epoch every document comes once."""
    docs = random_docs(120, 2)
    nanogpt_bin(tmp_path / "train.bin", docs)
    data = load_data(open_data(token_mix(tmp_path, on_exhausted="stop"), load_tokenizer(write_tokenizer(tmp_path))))
    loader = make_loader(data, 0, 1, 5, 256, 2)
    seen = Counter()
    while (b := loader.next_batch()) is not None:
        for ids, pos, labels in zip(b["input_ids"].numpy(), b["position_ids"].numpy(), b["labels"].numpy()):
            starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
            for a, z in zip(starts[:-1], starts[1:]):
                if ids[a] == EOS:  # padding: a run of EOS with no label
                    assert (ids[a:z] == EOS).all() and (labels[a:z] == -100).all()
                    continue
                assert ids[z - 1] == EOS and EOS not in ids[a:z - 1] and pos[z - 1] == z - 1 - a
                assert labels[a] == -100 and (labels[a + 1:z] == ids[a + 1:z]).all()
                seen[tuple(ids[a:z - 1].tolist())] += 1
    packer = loader.packer.state_dict()  # "stop": what the rows not emitted hold, and what was never taken
    for tokens, starts, used in [r[1:] for r in packer["open"]] + packer["ready"]:
        seen.update(tuple(tokens[a:z - 1]) for a, z in zip(starts, list(starts[1:]) + [used]))
    while got := loader.stream.sources[0].take(1):
        seen[tuple(got[0].tolist())] += 1
    assert seen == Counter(tuple(map(int, d)) for d in docs)


@pytest.mark.launches
def test_a_token_file_mixed_with_jsonl_trains_and_evaluates_on_a_bin(tmp_path):
    """The real driver (one process): a .bin (weight 0.7) with a jsonl source (0.3), --eval-data a mix of val.bin."""
    tok = write_tokenizer(tmp_path)
    nanogpt_bin(tmp_path / "train.bin", random_docs(300, 3))
    nanogpt_bin(tmp_path / "val.bin", random_docs(40, 4))
    rng = np.random.default_rng(5)
    with open(tmp_path / "notes.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(f"t{j}" for j in rng.integers(0, EOS, rng.integers(5, 80)))}) + "\n")
    spec = {"format": "tokens", "dtype": "uint16", "eos_id": EOS}
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [
        {"name": "owt", "weight": 0.7, "path": "train.bin", **spec}, {"name": "notes", "weight": 0.3, "path": "notes.jsonl"}]}))
    (tmp_path / "eval.json").write_text(json.dumps({"sources": [{"name": "owt-val", "weight": 1, "path": "val.bin", **spec}]}))
    out = tmp_path / "runs"
    proc = launch("python", ["--data", str(tmp_path / "mix.json"), "--tokenizer", tok, "--eval-data",
                             str(tmp_path / "eval.json"), "--eval-every-steps", "2", "--eval-tokens", "2048",
                             "--out", str(out), "--run-id", "r", "--max-steps", "4", "--seq-len", "64",
                             "--micro-batch", "2", "--grad-accum", "1", "--warmup-steps", "1",
                             "--log-data-every-steps", "2"], env_extra={"ZEROTRAIN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "300 documents, mean" in proc.stdout and f"{tmp_path / 'train.bin'}, 1 file" in proc.stdout
    records = [r for r in read_metrics(out / "r") if "step" in r and "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in records)
    assert abs(records[-1]["data_shares"]["owt"] - 0.7) < 0.02  # the token file takes its weight's share
    assert set(records[-1]["val_loss_per_source"]) == {"owt-val"} and np.isfinite(records[-1]["val_loss"])


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_state_restores_the_exact_stream(tmp_path, cache, workers):
    """As for shards (test_data_loader): a state taken mid-stream, through JSON, gives the same batches."""
    nanogpt_bin(tmp_path / "train.bin", random_docs(60, 6))
    with open(tmp_path / "notes.jsonl", "w") as f:
        f.writelines(json.dumps({"text": " ".join(f"t{j}" for j in range(i % 40 + 3))}) + "\n" for i in range(50))
    spec = {"name": "owt", "weight": 0.6, "path": "train.bin", "format": "tokens", "dtype": "uint16", "eos_id": EOS}
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [spec, {"name": "notes", "weight": 0.4,
                                                                      "path": "notes.jsonl"}]}))
    data = load_data(open_data(str(tmp_path / "mix.json"), load_tokenizer(write_tokenizer(tmp_path))), 64, 2)
    settings_ = {"workers": workers, "persistent_workers": False}
    a = Batches(data, 1, 2, 7, 128, 2, settings_)
    for _ in range(30):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next()["input_ids"].clone() for _ in range(60)]
    b = Batches(data, 1, 2, 7, 128, 2, settings_)
    b.load_state_dict(state)
    assert all(np.array_equal(b.next()["input_ids"], x) for x in expected)
    assert state["parts"][0]["stream"]["sources"][0]["epoch"] >= 1  # the token file restarted within the test


@pytest.mark.parametrize("worlds", [(2, 1), (1, 3), (3, 2, 1)])
def test_a_world_size_change_re_splits_it_like_shards(tmp_path, cache, worlds):
    """test_data_reshard's oracle on a mix of a jsonl source and a token file of byte ids (ByteTokenizer,
    end-of-text 257): every document of the interrupted epoch exactly once across the change."""
    rng = np.random.default_rng(0)
    texts = {tag: [f"{tag}{i:04d}:" + " ".join(rng.choice(WORDS, rng.integers(1, 6))) + f":{tag}{i:04d}."
                   for i in range(n)] for tag, n in (("a", 70), ("b", 50))}
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["a"])
    nanogpt_bin(tmp_path / "b.bin", [np.frombuffer(t.encode(), np.uint8) for t in texts["b"]], ByteTokenizer.eos_id)
    (tmp_path / "mix.json").write_text(json.dumps({"on_exhausted": "stop", "sources": [
        {"name": "a", "path": "a.jsonl", "weight": 0.6},
        {"name": "b", "path": "b.bin", "weight": 0.4, "format": "tokens", "dtype": "uint16", "eos_id": 257}]}))
    data = load_data(open_data(str(tmp_path / "mix.json"), ByteTokenizer()))
    assert data.stores[1].kind == "tokens" and all(DOC.fullmatch(t) for t in texts["b"])
    run_worlds(data, texts["a"] + texts["b"], list(worlds), [4, 0], 0, "best-fit")


def refusals(root):
    """(what to do to the mix or the file, tokenizer, words of the one-line error)."""
    return {
        "bad dtype": ({"dtype": "int8"}, None, "source 'owt': dtype must be uint16 or uint32 (the file's token id"
                                               " type), got 'int8'"),
        "no eos_id": ({"eos_id": None}, None, "source 'owt': eos_id must be the end-of-text id"),
        "missing file": ({"path": "gone.bin"}, None, f"source 'owt': data file {root / 'gone.bin'} does not exist"),
        "odd size": ({"path": "odd.bin"}, None, f"{root / 'odd.bin'} holds 201 bytes, not a whole number of uint16 ids"),
        "small vocabulary": ({}, "bytes", f"{root / 'train.bin'} holds token id 1,000, beyond the 258 ids of"
                                          " tokenizer bytes; pass the tokenizer the file was made with"),
        "other end-of-text": ({"path": "b.bin", "eos_id": 5}, "tok", "source 'owt': eos_id 5 is not tokenizer"),
        "glob": ({"path": "*.bin"}, None, "format tokens takes one file in 'path'"),
        "text keys": ({"text_field": "x"}, None, "text_field does not go with format tokens"),
    }


@pytest.mark.parametrize("case", ["bad dtype", "no eos_id", "missing file", "odd size", "small vocabulary",
                                  "other end-of-text", "glob", "text keys"])
def test_bad_token_sources_are_one_line_errors(tmp_path, cache, case):
    write_tokenizer(tmp_path)
    nanogpt_bin(tmp_path / "train.bin", random_docs(10, 7))
    (tmp_path / "odd.bin").write_bytes(b"\0" * 201)
    nanogpt_bin(tmp_path / "b.bin", random_docs(10, 8)[:3], eos=5)
    change, tok, words = refusals(tmp_path)[case]
    mix = token_mix(tmp_path, **change)  # eos_id None: left out
    tokenizer = ByteTokenizer() if tok == "bytes" else load_tokenizer(str(tmp_path / "tok"))
    with pytest.raises(DataError) as e:
        load_data(open_data(mix, tokenizer))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.launches
@pytest.mark.parametrize("case", ["bad dtype", "small vocabulary"])
def test_the_driver_refuses_them_exit_2_and_writes_nothing(tmp_path, case):
    """One refused as the mix is parsed, one once the file is scanned: exit 2, one line, the run directory as it was."""
    write_tokenizer(tmp_path)
    nanogpt_bin(tmp_path / "train.bin", random_docs(10, 7))
    change, _, words = refusals(tmp_path)[case]
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = snapshot(run.parent)
    proc = launch("python", ["--data", token_mix(tmp_path, **change), "--out", str(run.parent), "--run-id", "r1",
                             "--max-steps", "2"], env_extra={"ZEROTRAIN_CACHE": str(tmp_path / "cache")})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("zerotrain: error:"), proc.stderr[-2000:]
    assert words in lines[0] and "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(run.parent) == before


def test_a_bin_given_as_data_says_how_to_name_it(tmp_path):
    nanogpt_bin(tmp_path / "val.bin", random_docs(3, 9))
    with pytest.raises(DataError, match=r'a flat token file is read through a mix that names its dtype and eos_id.*'
                                        r'"path": "val.bin", "format": "tokens"'):
        open_data(str(tmp_path / "val.bin"), ByteTokenizer())


def test_prepare_and_tokenizer_training_refuse_a_token_file(tmp_path):
    """Token ids already: `zerotrain prepare` is not needed, and there is no text to train a tokenizer on."""
    from zerotrain.dataio.pipeline.commands import tokenizer_main
    from zerotrain.dataio.pipeline.prepare import prepare

    nanogpt_bin(tmp_path / "train.bin", random_docs(3, 10))
    with pytest.raises(DataError, match="format tokens is token ids already: train from the mix itself"):
        prepare(token_mix(tmp_path), ByteTokenizer(), tmp_path / "shards")
    assert not (tmp_path / "shards").exists()
    with pytest.raises(UsageError, match="format tokens is token ids already; a tokenizer is trained on text"):
        tokenizer_main(["train", "--data", token_mix(tmp_path), "--vocab-size", "300", "--out", str(tmp_path / "t")])
    assert not (tmp_path / "t").exists()
