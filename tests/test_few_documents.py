"""Issue 8 end to end: a corpus of a few huge documents trains on 2 ranks, and a data error met by
one rank mid-run ends every rank with one line (real `deepspeed` launcher, 2 CPU ranks)."""
import json
import time

from conftest import launch, read_metrics, synthetic_docs

COMMON = ["--model", "debug", "--seq-len", "64", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "1"]


def test_single_document_txt_trains_on_two_ranks(tmp_path, few_docs_mix):
    out = tmp_path / "runs"
    proc = launch("deepspeed", ["--data", str(few_docs_mix), "--out", str(out), "--run-id", "r", *COMMON,
                                "--max-steps", "12", "--log-data-every-steps", "12"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the pre-flight summary: documents, lengths, pieces and the one-document warning
    assert "one.txt: 1 document (sample_by paragraph: no blank lines found); use sample_by line?" in proc.stdout
    assert "1 document" in proc.stdout and "pieces" in proc.stdout
    metrics = read_metrics(out / "r")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    shares = metrics[-1]["data_shares"]
    for name, weight in (("one", 0.5), ("few", 0.3), ("table", 0.2)):
        assert abs(shares[name] - weight) < 0.05, shares
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_bad_record_met_by_one_rank_mid_run_ends_every_rank(tmp_path):
    """A streamed jsonl with one record lacking its text, read by rank 1 only, well after the start."""
    root = tmp_path / "data"
    root.mkdir()
    docs = synthetic_docs(2000, seed=7)
    bad_index = 2 * 700 + 1  # split_dataset_by_node: record i goes to rank i % 2 -> rank 1's 701st record
    with open(root / "stream.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"text": doc} if i != bad_index else {"body": doc}) + "\n")
    (root / "mix.json").write_text(json.dumps({"sources": [
        {"name": "stream", "path": "stream.jsonl", "weight": 1.0, "streaming": True}]}))
    out = tmp_path / "runs"
    t0 = time.time()
    proc = launch("deepspeed", ["--data", str(root / "mix.json"), "--out", str(out), "--run-id", "r", *COMMON,
                                "--max-steps", "200"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "zerotrain: error:" in ln]
    assert len(errors) == 1 and "source 'stream'" in errors[0] and "'text'" in errors[0], errors
    assert "Traceback" not in proc.stderr
    steps = [m["step"] for m in read_metrics(out / "r")]
    assert steps and 1 < steps[-1] < 200  # met mid-run, not at the start
    assert time.time() - t0 < 120  # no backend timeout waited for
