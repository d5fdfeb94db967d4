"""A corpus of a few huge documents, end to end: trains on 2 ranks, and a data error met by
one rank mid-run ends every rank with one line (real `deepspeed` launcher, 2 CPU ranks)."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import BIN, REPO, TRAIN_PY, free_port, launch, read_metrics, synthetic_docs

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

COMMON = ["--model", "debug", "--seq-len", "64", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "1"]


def test_single_document_txt_trains_on_two_ranks_and_resumes_exactly_after_kill_9(tmp_path, few_docs_mix):
    out = tmp_path / "runs"
    args = [*COMMON, "--max-steps", "12", "--log-data-every-steps", "12", "--save-every-steps", "4"]
    proc = launch("deepspeed", ["--data", str(few_docs_mix), "--out", str(out), "--run-id", "r", *args])
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

    # the same run killed -9 (whole process group) after step 6, then resumed: bit-identical history
    killed_args = ["--data", str(few_docs_mix), "--out", str(tmp_path / "k"), "--run-id", "r", *args]
    proc = subprocess.Popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                             str(TRAIN_PY), *killed_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(m["step"] >= 6 for m in read_metrics(tmp_path / "k" / "r")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = launch("deepspeed", killed_args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    again = read_metrics(tmp_path / "k" / "r")
    assert [m["tokens_sha"] for m in again] == [m["tokens_sha"] for m in metrics]
    assert [m["loss"] for m in again] == [m["loss"] for m in metrics]


def test_bad_record_met_by_one_rank_mid_run_ends_every_rank(tmp_path):
    """A streamed jsonl with one record lacking its text, read by rank 1 only, well after the start."""
    root = tmp_path / "data"
    root.mkdir()
    docs = synthetic_docs(2000, seed=7)
    # split_dataset_by_node: record i goes to rank i % 2 -> rank 1's 301st record, in its second block
    # of 256 records (zerotrain.dataio.loader.TOKEN_BLOCK): read some 20 steps into the run
    bad_index = 2 * 300 + 1
    with open(root / "stream.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"text": doc} if i != bad_index else {"body": doc}) + "\n")
    (root / "mix.json").write_text(json.dumps({"sources": [
        {"name": "stream", "path": "stream.jsonl", "weight": 1.0, "streaming": True}]}))
    out = tmp_path / "runs"
    t0 = time.time()
    proc = launch("deepspeed", ["--data", str(root / "mix.json"), "--out", str(out), "--run-id", "r", "--model",
                                "debug", "--seq-len", "256", "--micro-batch", "8", "--max-steps", "200"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "zerotrain: error:" in ln]
    assert len(errors) == 1 and "source 'stream'" in errors[0] and "'text'" in errors[0], errors
    assert "Traceback" not in proc.stderr
    steps = [m["step"] for m in read_metrics(out / "r")]
    assert steps and 1 < steps[-1] < 200  # met mid-run, not at the start
    assert time.time() - t0 < 120  # no backend timeout waited for
