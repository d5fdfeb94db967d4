"""Local copies of hub datasets as sources. A glob, a directory or a list of data files is
ONE source; `hf` takes a local snapshot directory (README configs, split, data_dir, data_files); the
files are read through datasets' memory-mapped Arrow tables; `zerotrain prepare` takes the same
sources; token shares, exactly-once and exact resume hold over multi-file sources; bad input is one
line naming the source and the file. Offline, a hub name is read from the Hugging Face hub cache.
"""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, launch
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.pipeline.commands import describe_data
from zerotrain.dataio.pipeline.loader import Batches, load_data, make_loader, open_data
from zerotrain.dataio.sources.tokenizer import ByteTokenizer
from test_data_loader import ALPHABETS, source_of_bytes

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*.parquet
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*.parquet
---
# a dataset card, as the hub snapshot has it
"""


def docs_of(alphabet: str, n: int, lengths: tuple, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), rng.integers(*lengths))) for _ in range(n)]


def write_local_hub(root, n=120) -> tuple:
    """Three multi-file sources with disjoint alphabets, in the forms users download them:
    "short": a hub snapshot (README configs; sample/10BT/ holds 3 parquet shards) read with `hf`;
    "long": a directory of json lines shards, two gzipped and one plain, read with `path: DIR`;
    "mid": .txt files given as a list with a glob. Returns (mix, {source: [(file, docs)]})."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"short": [], "long": [], "mid": []}
    snap = root / "snap"
    (snap / "sample" / "10BT").mkdir(parents=True)
    (snap / "data" / "CC-1").mkdir(parents=True)
    (snap / "README.md").write_text(README)
    for k in (2, 0, 1):  # written out of order: the source reads them sorted
        docs = docs_of(ALPHABETS["short"], n, (5, 40), seed=k)
        f = snap / "sample" / "10BT" / f"{k:03d}_00000.parquet"
        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), f)
        files["short"].append((str(f), docs))
    pq.write_table(pa.table({"text": ["not in the sample config"] * 5}), snap / "data" / "CC-1" / "000.parquet")
    (root / "gz").mkdir()
    for k, name in enumerate(("part-0000.jsonl.gz", "part-0001.jsonl.gz", "part-0002.jsonl")):
        docs = docs_of(ALPHABETS["long"], n // 3, (300, 1500), seed=10 + k)
        body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        (root / "gz" / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
        files["long"].append((str(root / "gz" / name), docs))
    (root / "gz" / "README.md").write_text("not data: skipped")
    (root / "txt").mkdir()
    for k, name in enumerate(("a.txt", "b1.txt", "b2.txt")):
        docs = docs_of(ALPHABETS["mid"], n // 2, (50, 200), seed=20 + k)
        (root / "txt" / name).write_text("\n\n".join(docs) + "\n")
        files["mid"].append((str(root / "txt" / name), docs))
    for v in files.values():
        v.sort()
    mix = root / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "short", "weight": 0.5, "hf": "snap", "config": "sample-10BT"},
        {"name": "long", "weight": 0.3, "path": "gz"},
        {"name": "mid", "weight": 0.2, "path": ["txt/a.txt", "txt/b*.txt"]}]}))
    return mix, files


@pytest.fixture(scope="module")
def local_hub(tmp_path_factory):
    return write_local_hub(tmp_path_factory.mktemp("localhub"))


def all_docs(store) -> list[str]:
    return [store.text(d) for d in range(len(store))]


def test_globs_directories_lists_and_snapshots_are_one_source_each(local_hub):
    mix, files = local_hub
    data = load_data(open_data(str(mix), ByteTokenizer()))
    for spec, store in zip(data.specs, data.stores):
        want = files[spec.name]
        assert list(store.files) == [f for f, _ in want]  # sorted, the README.md of gz/ skipped
        assert all_docs(store) == [d for _, docs in want for d in docs]  # every document, in file order
    short = data.specs[0]
    assert short.local_hf and not short.streamed and os.path.isabs(short.hf)
    # The summary: per source its files, documents and tokens.
    lines = describe_data(data, 50_000)
    for spec, store in zip(data.specs, data.stores):
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(spec.name + " "))
        tokens = int(store.lengths.sum()) + len(store)
        assert f"{tokens:,} tokens" in lines[i] and f", 3 files" in lines[i], lines[i]
        assert lines[i + 1].strip().startswith(f"{len(store):,} documents, mean"), lines[i + 1]
    assert any(ln.strip().startswith("mid ") and ln.endswith("3 files, sample_by paragraph)") for ln in lines)


def test_snapshot_configs_data_dir_data_files_and_save_to_disk(local_hub, tmp_path):
    from datasets import Dataset, DatasetDict

    mix, files = local_hub
    snap = mix.parent / "snap"

    def load(source: dict):
        p = tmp_path / "m.json"
        p.write_text(json.dumps({"sources": [{"name": "s", "weight": 1, **source}]}))
        return load_data(open_data(str(p), ByteTokenizer())).stores[0]

    sample = [d for _, docs in files["short"] for d in docs]
    assert all_docs(load({"hf": str(snap)})) == ["not in the sample config"] * 5  # the default config
    assert all_docs(load({"hf": str(snap), "data_dir": "sample/10BT"})) == sample
    by_files = load({"hf": str(snap), "data_files": {"validation": "sample/10BT/00[12]*"}, "split": "validation"})
    assert all_docs(by_files) == [d for _, docs in files["short"][1:] for d in docs] and len(by_files.files) == 2
    # save_to_disk directories still work, under path (as before) and under hf.
    Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_dict({"text": ["a"]}),
                 "test": Dataset.from_dict({"text": ["b", "c"]})}).save_to_disk(str(tmp_path / "saved_dict"))
    assert all_docs(load({"path": str(tmp_path / "saved")})) == ["one", "two"]
    assert all_docs(load({"hf": str(tmp_path / "saved_dict"), "split": "test"})) == ["b", "c"]
    # A directory whose file names carry splits: the split's files only, as load_dataset(DIR) does.
    (tmp_path / "splits").mkdir()
    for split, text in (("train", "t"), ("test", "x")):
        pq.write_table(pa.table({"text": [text] * 3}), tmp_path / "splits" / f"{split}-00000-of-00001.parquet")
    assert all_docs(load({"path": str(tmp_path / "splits")})) == ["t"] * 3
    assert all_docs(load({"path": str(tmp_path / "splits"), "split": "test"})) == ["x"] * 3


def mapped_file(address: int) -> str | None:
    """The file backing the memory mapping that holds `address` in this process, if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_documents_are_views_of_memory_mapped_files(local_hub):
    """Nothing of a local source's text is copied into memory: every chunk of every store lies in a
    file mapping (datasets' Arrow cache files; the .txt files themselves)."""
    mix, _ = local_hub
    data = load_data(open_data(str(mix), ByteTokenizer()))
    for spec, store in zip(data.specs, data.stores):
        backing = {mapped_file(c.__array_interface__["data"][0]) for c in store.chunks if len(c)}
        if spec.name == "mid":
            assert backing == {f for f in store.files}, backing
        else:
            assert backing and all(b and b.endswith(".arrow") for b in backing), (spec.name, backing)


def test_token_shares_and_exactly_once_over_multi_file_sources(local_hub):
    mix, files = local_hub
    data = load_data(open_data(str(mix), ByteTokenizer()))
    loader = make_loader(data, rank=0, world=1, seed=3, seq_len=2048, micro_batch=4)
    ids, labels = [], []
    while sum(len(x) for x in ids) < 200_000:
        b = loader.next_batch()
        ids.append(b["input_ids"].numpy().ravel())
        labels.append(b["labels"].numpy().ravel())
    counts = source_of_bytes(np.concatenate(ids), np.concatenate(labels))
    total = sum(counts.values())
    for name, want in zip(ALPHABETS, (0.5, 0.3, 0.2)):
        assert abs(counts[name] / total - want) < 0.02, (name, counts[name] / total)  # counted in the rows
        assert abs(loader.stream.token_shares()[name] - want) < 0.01  # the schedule: within a document
    # Documents are split across ranks over the whole source (not per file): disjoint, together all.
    for i, name in enumerate(ALPHABETS):
        seen = []
        for rank in range(3):
            src = make_loader(data, rank, 3, 1, 64, 1).stream.sources[i]
            seen.append([bytes(d).decode() for d in src.take(src.n)])  # one epoch of this rank's part
        assert sorted(sum(seen, [])) == sorted(d for _, docs in files[name] for d in docs)
        assert len({len(s) for s in seen}) <= 2  # within one document of each other


def test_exact_resume_over_multi_file_sources_read_and_streamed(local_hub):
    mix, files = local_hub
    raw = json.loads(mix.read_text())
    raw["sources"].append({"name": "stream", "weight": 0.2, "path": str(mix.parent / "gz" / "*.jsonl*"),
                           "streaming": True})  # 3 shards through datasets' IterableDataset
    p = mix.parent / "mix-streamed.json"  # next to the mix: its paths are relative to it
    p.write_text(json.dumps(raw))
    data = load_data(open_data(str(p), ByteTokenizer()), 512, 2)
    assert data.stores[3] is None
    a = Batches(data, 1, 2, 7, 128, 2)
    for _ in range(40):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))  # what travels in client_state
    expected = [a.next()["input_ids"].clone() for _ in range(80)]
    b = Batches(data, 1, 2, 7, 128, 2)
    b.load_state_dict(state)
    assert all(np.array_equal(b.next()["input_ids"], e) for e in expected)
    assert a.tokens_per_source()[3] > 0  # the streamed source took part
    # The streamed glob is the same files in the same sorted order as the directory.
    from zerotrain.dataio.sources.readers import find_files

    assert find_files(data.specs[3]).files == data.stores[1].files


@pytest.mark.launches
def test_prepare_takes_the_same_sources_and_gives_the_same_stream(local_hub, tmp_path):
    mix, files = local_hub
    out = tmp_path / "shards"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "prepare", "--data", str(mix), "--out", str(out),
                           "--shard-tokens", "30000"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "long: 120 documents" in proc.stdout and "from 3 file(s)" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(s["name"], s["files"], s["documents"]) for s in manifest["sources"]] == [
        (name, 3, sum(len(docs) for _, docs in files[name])) for name in ("short", "long", "mid")]
    a = make_loader(load_data(open_data(str(mix), ByteTokenizer()), 512, 2), 1, 2, 9, 96, 3)
    b = make_loader(load_data(open_data(str(out), ByteTokenizer()), 512, 2), 1, 2, 9, 96, 3)
    for _ in range(30):
        assert np.array_equal(a.next_batch()["input_ids"], b.next_batch()["input_ids"])
    lines = describe_data(load_data(open_data(str(out), ByteTokenizer())), 10_000)
    assert any(ln.strip().startswith("long ") and "shard file" in ln for ln in lines)


@pytest.mark.launches
def test_driver_trains_from_multi_file_sources_and_records_them(local_hub, tmp_path):
    """The real driver (one process): the summary before training names each source's files,
    documents and tokens, and config.json records the sources as the mix gave them."""
    mix, files = local_hub
    out = tmp_path / "runs"
    proc = launch("python", ["--data", str(mix), "--out", str(out), "--run-id", "r", "--max-steps", "2",
                             "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "1", "--warmup-steps", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, want in files.items():
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(name + " "))
        assert "tokens" in line and "3 files" in line, line
        n_docs = sum(len(docs) for _, docs in want)
        assert f"{n_docs} documents, mean" in proc.stdout
    sources = json.loads((out / "r" / "config.json").read_text())["sources"]
    assert [s["hf"] or s["path"] for s in sources] == [str(mix.parent / "snap"), str(mix.parent / "gz"),
                                                      [str(mix.parent / "txt" / "a.txt"),
                                                       str(mix.parent / "txt" / "b*.txt")]]
    assert sources[0]["config"] == "sample-10BT"


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the source and the file
# --------------------------------------------------------------------------------------------

def bad_cases(root, local):
    """(source entry, words the one-line error must hold) per case, files written under root."""
    (root / "mixed").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), root / "mixed" / "a.parquet")
    (root / "mixed" / "b.jsonl").write_text('{"text": "b"}\n')
    (root / "corrupt").mkdir()
    pq.write_table(pa.table({"text": ["fine"]}), root / "corrupt" / "0.parquet")
    (root / "corrupt" / "1.parquet").write_bytes(b"PAR1 this is not a parquet file")
    (root / "nofield").mkdir()
    pq.write_table(pa.table({"text": ["fine"]}), root / "nofield" / "0.parquet")
    pq.write_table(pa.table({"body": ["no text here"]}), root / "nofield" / "1.parquet")
    (root / "gzbad").mkdir()
    (root / "gzbad" / "0.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": broken\n'))
    snap = str(local.parent / "snap")
    return {
        "glob matching nothing": ({"path": str(root / "nowhere" / "*.parquet")},
                                  ["source 's'", "*.parquet matches no data file"]),
        "mixed formats": ({"path": str(root / "mixed")}, ["source 's'", "more than one format", "1 parquet",
                                                           "1 json", "mixed/a.parquet"]),
        "unreadable shard": ({"path": str(root / "corrupt" / "*.parquet")},
                             ["source 's'", "cannot read", "corrupt/1.parquet"]),
        "shard without text field": ({"path": str(root / "nofield")},
                                     ["source 's'", "nofield/1.parquet has no field 'text' (fields: body)"]),
        "broken compressed json lines": ({"path": str(root / "gzbad")},
                                         ["source 's'", "gzbad/0.jsonl.gz", "line 2: invalid JSON"]),
        "data_files not matching the split": ({"hf": snap, "data_files": {"train": "sample/10BT/*"},
                                               "split": "validation"},
                                              ["source 's'", "has no split 'validation'", "(splits: train)"]),
        "unknown config": ({"hf": snap, "config": "nope"}, ["source 's'", "cannot open", "'nope' not found"]),
        "missing snapshot directory": ({"hf": "./not-here"}, ["source 's'", "no such directory"]),
        "data_dir with path": ({"path": snap, "data_dir": "sample"}, ["data_dir goes with 'hf'"]),
        "compressed txt": ({"path": str(root / "x.txt.gz")}, ["unsupported file type"]),
    }


def test_bad_local_sources_are_one_line_naming_source_and_file(tmp_path, local_hub):
    (tmp_path / "x.txt.gz").write_bytes(gzip.compress(b"text"))
    for case, (source, words) in bad_cases(tmp_path, local_hub[0]).items():
        p = tmp_path / f"{case.replace(' ', '_')}.json"
        p.write_text(json.dumps({"sources": [{"name": "s", "weight": 1, **source}]}))
        with pytest.raises(DataError) as e:
            load_data(open_data(str(p), ByteTokenizer()))
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), (case, msg)


def run_cli(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True,
                          cwd=REPO, env=env)


@pytest.mark.launches
def test_bad_source_exits_2_with_one_line(tmp_path):
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "mixed" / "a.parquet")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "b"}\n')
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "s", "weight": 1, "path": "mixed"}]}))
    proc = run_cli(["prepare", "--data", str(mix), "--out", str(tmp_path / "out")])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "source 's'" in lines[0] and "more than one format" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def fake_hub_cache(root, repo="owner/name"):
    """The layout `hf download --repo-type dataset owner/name` leaves in HF_HUB_CACHE."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    top = root / f"datasets--{repo.replace('/', '--')}"
    snap = top / "snapshots" / sha
    (snap / "sample" / "10BT").mkdir(parents=True)
    (top / "refs").mkdir(parents=True)
    (top / "refs" / "main").write_text(sha)
    (snap / "README.md").write_text(README)
    for k in range(2):
        pq.write_table(pa.table({"text": docs_of(ALPHABETS["short"], 200, (5, 40), seed=k)}),
                       snap / "sample" / "10BT" / f"{k:03d}_00000.parquet")
    return snap


OFFLINE_READ = """
import sys
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.sources.streamed import open_streamed, records
edu, other = parse_mix(sys.argv[1]).sources
print("edu records", sum(1 for _ in records(open_streamed(edu, 0, 1))))
try:
    open_streamed(other, 0, 1)
except DataError as e:
    print("other:", e)
"""


@pytest.mark.launches
def test_offline_a_hub_name_is_read_from_the_local_hub_cache(tmp_path):
    """HF_HUB_OFFLINE=1 as a user sets it (a fresh process): `hf: owner/name` streams from the hub
    cache's snapshot (only the chosen config's files downloaded); a name not there is one line."""
    fake_hub_cache(tmp_path / "hub")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "edu", "weight": 1, "hf": "owner/name", "config": "sample-10BT"},
        {"name": "other", "weight": 1, "hf": "owner/absent"}]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_READ, str(mix)], capture_output=True, text=True,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "edu records 400" in proc.stdout  # 2 parquet shards x 200 records, read without network
    other = next(ln for ln in proc.stdout.splitlines() if ln.startswith("other:"))
    assert "source 'other': cannot open hub dataset 'owner/absent'" in other
    assert "hf download --repo-type dataset owner/absent" in other


HALF_READ = """
import sys
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.sources.streamed import open_streamed, records
it = records(open_streamed(parse_mix(sys.argv[1]).sources[0], 0, 1))
print("first", len(next(it)["text"]) > 0)
"""


@pytest.mark.launches
def test_a_parquet_stream_left_half_read_is_closed_before_the_interpreter_exits(tmp_path):
    """A run stops mid-stream: the parquet reader left open is closed by our exit hook while pyarrow still
    stands. Left to the interpreter's teardown it is finalised after pyarrow is gone: an ignored exception
    on stderr at best, an abort (exit -6, "terminate called without an active exception") at worst."""
    fake_hub_cache(tmp_path / "hub")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "edu", "weight": 1, "hf": "owner/name",
                                            "config": "sample-10BT"}]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    proc = subprocess.run([sys.executable, "-c", HALF_READ, str(mix)], capture_output=True, text=True,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "first True" in proc.stdout
    assert "Exception ignored" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
