"""Bad data: exit status 2 and one line naming the source/shard and record, run directory untouched.

Every case goes through `zerotrain train`'s own error path in this process (the CLI's main: exit 2, one line on
stderr); two of them also as a launched `python launcher/train.py`, for the process's exit status and the absence
of a traceback (a launch costs ~2.5 CPU-s of imports; the message is the same code's either way).

Bad records inside a healthy source follow the mix's `bad_records` policy: "stop" (the default)
is the error above; "skip" drops and counts them.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import REPO, launch
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.pipeline.loader import load_data, open_data
from zerotrain.dataio.sources.tokenizer import ByteTokenizer
from zerotrain.launcher.cli import main as zerotrain_cli
from test_bad_input import snapshot


def mix_of(tmp_path, source: dict, extra=None) -> str:
    p = tmp_path / "mix.json"
    p.write_text(json.dumps({"sources": [{"name": "bad", "weight": 1, **source}], **(extra or {})}))
    return str(p)


def write(p, data: bytes):
    p.write_bytes(data)
    return p.name


def in_process(argv: list[str]) -> None:
    """`zerotrain ARGV` in this process; the variables a train sets for its world of 1 (RANK, WORLD_SIZE, ...)
    are taken back after."""
    with mock.patch.dict(os.environ):
        zerotrain_cli(argv)


def prepared(tmp_path, mix_path) -> str:
    out = tmp_path / "shards"
    in_process(["prepare", "--data", str(mix_path), "--out", str(out), "--shard-tokens", "20000"])
    assert (out / "manifest.json").is_file()
    return str(out)


def tamper_bytes(tmp_path, mix_path):
    d = prepared(tmp_path, mix_path)
    f = sorted((tmp_path / "shards").glob("notes-*.tokens.npy"))[1]
    raw = bytearray(f.read_bytes())
    raw[-5] = (raw[-5] + 1) % 100  # same size, valid header, one token changed
    f.write_bytes(bytes(raw))
    return ["--data", d], f"shard {f}: sha256 mismatch"


def truncate_shard(tmp_path, mix_path):
    d = prepared(tmp_path, mix_path)
    f = sorted((tmp_path / "shards").glob("prose-*.tokens.npy"))[0]
    f.write_bytes(f.read_bytes()[:1000])
    return ["--data", d], f"shard {f}: corrupt or truncated"


def manifest_count(tmp_path, mix_path):
    d = prepared(tmp_path, mix_path)
    m = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    m["shards"][0]["tokens"] += 1
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps(m))
    return ["--data", d], f"shard {tmp_path / 'shards' / m['shards'][0]['file']}: holds"


def wrong_tokenizer(tmp_path, mix_path):
    d = prepared(tmp_path, mix_path)
    tok = tmp_path / "tok"
    in_process(["tokenizer", "train", "--data", str(mix_path), "--vocab-size", "300", "--out", str(tok)])
    return ["--data", d, "--tokenizer", str(tok)], "tokenized with 'bytes'"


CASES = {
    "empty source": (lambda t, m: ["--data", mix_of(t, {"path": write(t / "e.jsonl", b"")})],
                     "e.jsonl is empty: holds no documents"),
    "only blank lines": (lambda t, m: ["--data", mix_of(t, {"path": write(t / "e.txt", b"\n\n\n  \n")})],
                         "holds no documents"),
    "missing path": (lambda t, m: ["--data", mix_of(t, {"path": "nowhere.jsonl"})], "nowhere.jsonl does not exist"),
    "non-UTF-8 text file": (lambda t, m: ["--data", mix_of(t, {"path": write(
        t / "n.txt", b"first paragraph\n\nsecond \xff\xfe paragraph\nline two\n\nthird")})],
        "n.txt paragraph 2 (line 3): not valid UTF-8"),
    "non-UTF-8 jsonl": (lambda t, m: ["--data", mix_of(t, {"path": write(
        t / "n.jsonl", b'{"text": "ok"}\n{"text": "bad \xff"}\n')})], "n.jsonl line 2: not valid UTF-8"),
    "record without text field": (lambda t, m: ["--data", mix_of(t, {"path": write(
        t / "r.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')})], "r.jsonl record 3: no 'text' value"),
    "invalid JSON line": (lambda t, m: ["--data", mix_of(t, {"path": write(
        t / "j.jsonl", b'{"text": "a"}\n{"text": "b" "c"}\n')})], "j.jsonl: line 2: invalid JSON"),
    "non-numeric weight": (lambda t, m: ["--data", str(_json(t / "w.json", {"sources": [
        {"name": "x", "path": str(m.parent / "prose.jsonl"), "weight": "0.5"}]}))],
        "source 'x': weight must be a positive number, got '0.5'"),
    "unknown policy": (lambda t, m: ["--data", mix_of(t, {"path": str(m.parent / "prose.jsonl")},
                                                      {"on_exhausted": "loop"})],
                       "on_exhausted must be restart or stop, got 'loop'"),
    "manifest hash mismatch": tamper_bytes,
    "corrupt shard file": truncate_shard,
    "manifest count wrong": manifest_count,
    "shards from another tokenizer": wrong_tokenizer,
    "bad dataloader settings": (lambda t, m: ["--profile", str(_json(t / "p.json", {
        **json.loads((REPO / "ds_configs" / "cpu.json").read_text()),
        "zerotrain": {"dataloader": {"workers": -1}}}))], "zerotrain.dataloader.workers must be an integer"),
}


def _json(p, obj):
    p.write_text(json.dumps(obj))
    return p


def bad_case(case, tmp_path, mix_path) -> tuple[list[str], str, Path, dict]:
    """(train arguments, the expected message, the lived-in run directory's parent, its snapshot)."""
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = snapshot(run.parent)
    if isinstance(CASES[case], tuple):
        extra, expected = CASES[case][0](tmp_path, mix_path), CASES[case][1]
    else:  # builds prepared shards, then breaks them
        extra, expected = CASES[case](tmp_path, mix_path)
    args = ["--data", str(mix_path), "--out", str(run.parent), "--run-id", "r1", "--max-steps", "2", *extra]
    return args, expected, run.parent, before


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_is_one_line_and_exit_2_from_the_train_command(case, tmp_path, mix_path, capsys):
    args, expected, runs, before = bad_case(case, tmp_path, mix_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as end:
        in_process(["train", *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert end.value.code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("zerotrain: error:"), err[-2000:]
    assert expected in lines[0], lines[0]
    assert snapshot(runs) == before


@pytest.mark.launches
@pytest.mark.parametrize("case", ["empty source", "invalid JSON line", "manifest hash mismatch"])
def test_bad_data_ends_a_launched_train_with_exit_2_and_no_traceback(case, tmp_path, mix_path):
    args, expected, runs, before = bad_case(case, tmp_path, mix_path)
    proc = launch("python", args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("zerotrain: error:"), proc.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(runs) == before


def test_skip_policy_drops_and_counts_bad_records(tmp_path):
    (tmp_path / "n.txt").write_bytes(b"first paragraph\n\nsecond \xff paragraph\n\nthird one\n")
    (tmp_path / "r.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n{"text": ""}\n{"text": "d"}\n')
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"bad_records": "skip", "sources": [
        {"name": "txt", "path": "n.txt", "weight": 1}, {"name": "js", "path": "r.jsonl", "weight": 1}]}))
    data = load_data(open_data(str(mix), ByteTokenizer()))
    txt, js = data.stores
    assert [txt.text(i) for i in range(len(txt))] == ["first paragraph", "third one"] and txt.bad_records == 1
    assert "paragraph 2" in txt.first_bad
    assert [js.text(i) for i in range(len(js))] == ["a", "d"] and js.bad_records == 1 and js.empty_records == 1
    from zerotrain.dataio.pipeline.commands import describe_data

    lines = describe_data(data, 10_000)
    assert any("skipped 1 bad record(s)" in ln and "'txt'" in ln for ln in lines)


def test_whitespace_only_records_are_no_documents_and_crlf_paragraphs_end_before_their_cr(tmp_path):
    """A record, line or paragraph of whitespace alone (a jsonl "text": "   \\n", a line of spaces) is no
    document: it is counted as empty, as "" is, streamed or not. A CRLF file's paragraphs end before the \\r of
    their last line (it used to be kept: a stray token at the end of every document)."""
    from zerotrain.dataio.pipeline.cursors import StreamedSource

    (tmp_path / "crlf.txt").write_bytes(b"first\r\nparagraph\r\n\r\nsecond one\r\n \r\n\r\nthird\r\n")
    (tmp_path / "lines.txt").write_bytes(b"one\n            \n\ttwo \n \t \r\nthree\n")
    (tmp_path / "r.jsonl").write_text('{"text": "a"}\n{"text": "   \\n  \\t"}\n{"text": " b "}\n{"text": "\\n"}\n')
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "crlf", "path": "crlf.txt", "weight": 1},
        {"name": "lines", "path": "lines.txt", "weight": 1, "sample_by": "line"},
        {"name": "js", "path": "r.jsonl", "weight": 1}]}))
    data = load_data(open_data(str(mix), ByteTokenizer()))
    crlf, lines, js = data.stores
    assert [crlf.text(i) for i in range(len(crlf))] == ["first\r\nparagraph", "second one", "third"]
    assert [lines.text(i) for i in range(len(lines))] == ["one", "\ttwo ", "three"]
    assert [js.text(i) for i in range(len(js))] == ["a", " b "] and js.empty_records == 2
    streamed = json.loads(mix.read_text())
    streamed["sources"] = [{**streamed["sources"][2], "streaming": True}]
    mix.write_text(json.dumps(streamed))
    tok = ByteTokenizer()
    source = StreamedSource(open_data(str(mix), tok).specs[0], tok, rank=0, world=1)
    assert [bytes(t.astype(np.uint8)).decode() for t in source.take(2)] == ["a", " b "]


@pytest.mark.launches
def test_verify_command_checks_and_measures(tmp_path, mix_path):
    d = prepared(tmp_path, mix_path)
    ok = subprocess.run([sys.executable, "-m", "zerotrain", "verify", d, "--seconds", "0.2"],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "sha256 all match" in ok.stdout and "tokens/s" in ok.stdout
    f = sorted((tmp_path / "shards").glob("*.offsets.npy"))[0]
    arr = np.load(f)
    arr[1] = arr[2]  # a zero-length document: offsets no longer strictly increasing
    np.save(f, arr)
    bad = subprocess.run([sys.executable, "-m", "zerotrain", "verify", d], capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and f"shard {f}" in lines[0], bad.stderr


@pytest.mark.launches
def test_a_source_too_small_for_the_ranks_is_one_line_before_the_loader(tmp_path):
    """load_data refuses a source that cannot give every rank (x data worker) a piece; the
    data-bench command (which pretends to be one of --world ranks) shows the line the driver prints."""
    mix = mix_of(tmp_path, {"path": write(tmp_path / "t.txt", b"abc\n")})
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "data-bench", "--data", mix, "--world", "4",
                           "--seconds", "0.1"], capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].endswith("source 'bad': 1 document(s) of 3 bytes in all cannot be split across 4 ranks;"
                             " add data or use fewer ranks"), lines[0]
    ok = subprocess.run([sys.executable, "-m", "zerotrain", "data-bench", "--data", mix, "--world", "3",
                         "--seconds", "0.1"], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr[-2000:]  # 3 characters, 3 ranks: one piece each


def test_a_bad_streamed_record_is_named_by_its_content(tmp_path):
    """A stream has no line numbers to give: a bad streamed record is named by its first 80 characters of JSON (one
    line, enough to grep for), in training and in --eval-data's rows alike."""
    from zerotrain.dataio.pipeline.cursors import StreamedSource
    from zerotrain.dataio.sources.holdout import mix_rows

    body = "x" * 200
    (tmp_path / "r.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": body}) + "\n")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "s", "path": "r.jsonl", "weight": 1, "streaming": True}]}))
    tok = ByteTokenizer()
    data = open_data(str(mix), tok)
    seen = '{"text": null, "body": "' + "x" * 77  # as datasets gives it: the file's columns, null where missing
    want = f"source 's': streamed record {seen[:77]}...: no 'text' value"
    with pytest.raises(DataError) as e:
        StreamedSource(data.specs[0], tok, rank=0, world=1).take(2)
    assert str(e.value).startswith(want) and "\n" not in str(e.value)
    with pytest.raises(DataError) as e:
        mix_rows(load_data(data), 64, 100)
    assert str(e.value).startswith("eval data: " + want)
