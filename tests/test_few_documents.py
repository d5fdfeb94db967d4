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
    """Killed -9 (whole process group) once its step-8 checkpoint is complete and step 11 is logged (rank 0 held
    on entering the step-12 save, so it cannot finish first), then resumed: the steps logged before the kill are
    the uninterrupted history, reproduced bit for bit; the resumed run trains to step 12 on every source."""
    out = tmp_path / "runs"
    run = out / "r"
    args = ["--data", str(few_docs_mix), "--out", str(out), "--run-id", "r", *COMMON, "--max-steps", "12",
            "--log-data-every-steps", "12", "--save-every-steps", "4"]
    proc = subprocess.Popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                             str(TRAIN_PY), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRAIN_TEST_HANG": "0:save:12"},
                            start_new_session=True)
    marker = run / "checkpoints" / "global_step8" / "zerotrain.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if marker.is_file() and any(m["step"] >= 11 for m in read_metrics(run)):
            break
        time.sleep(0.05)
    assert proc.poll() is None and marker.is_file(), "the run ended, or saved no step-8 checkpoint, before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_metrics(run)
    resumed = launch("deepspeed", args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'global_step8'} at step 8" in resumed.stdout
    # the pre-flight summary: documents, lengths, pieces and the one-document warning
    assert "one.txt: 1 document (sample_by paragraph: no blank lines found); use sample_by line?" in resumed.stdout
    assert "1 document" in resumed.stdout and "pieces" in resumed.stdout
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 13)) and len(before) >= 11
    assert [m["tokens_sha"] for m in metrics[:len(before)]] == [m["tokens_sha"] for m in before]
    assert [m["loss"] for m in metrics[:len(before)]] == [m["loss"] for m in before]  # full-precision floats
    shares = metrics[-1]["data_shares"]
    for name, weight in (("one", 0.5), ("few", 0.3), ("table", 0.2)):
        assert abs(shares[name] - weight) < 0.05, shares
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_bad_record_met_by_one_rank_mid_run_ends_every_rank(tmp_path):
    """A streamed jsonl with one record lacking its text, read by rank 1 only, well after the start."""
    root = tmp_path / "data"
    root.mkdir()
    docs = synthetic_docs(2000, seed=7)
    # split_dataset_by_node: record i goes to rank i % 2 -> rank 1's 301st record, in its second block
    # of 256 records (zerotrain.dataio.pipeline.cursors.TOKEN_BLOCK): read some 20 steps into the run
    bad_index = 2 * 300 + 1
    with open(root / "stream.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"text": doc} if i != bad_index else {"body": doc}) + "\n")
    (root / "mix.json").write_text(json.dumps({"sources": [
        {"name": "stream", "path": "stream.jsonl", "weight": 1.0, "streaming": True}]}))
    out = tmp_path / "runs"
    # a rank left waiting for the failed one until the backend's timeout (30 min) would run past the 300 s here
    proc = launch("deepspeed", ["--data", str(root / "mix.json"), "--out", str(out), "--run-id", "r", "--model",
                                "debug", "--seq-len", "256", "--micro-batch", "8", "--max-steps", "200"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "zerotrain: error:" in ln]
    assert len(errors) == 1 and "source 'stream'" in errors[0] and "'text'" in errors[0], errors
    assert "Traceback" not in proc.stderr
    steps = [m["step"] for m in read_metrics(out / "r")]
    assert steps and 1 < steps[-1] < 200  # met mid-run, not at the start
