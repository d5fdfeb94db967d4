"""Exact resumption: 2 ranks, the real `deepspeed` launcher, ZeRO-2 and ZeRO-3, CPU fp32.

A run 0 -> N, and the same run stopped at k (its run directory as it was at step k: checkpoint k,
metrics up to k) then continued with `--resume auto` k -> N, see exactly the same token ids at
every step (`tokens_sha`: a digest of every rank's input_ids and position_ids for the step) and
bit-identical losses. Once at ZeRO-2 for a mix read from the source files, once at ZeRO-3 for prepared
shards read by a background DataLoader worker (whose read-ahead must not leak into the saved state); ZeRO-3
on a mix read from the source files is resumed exactly in tests/test_long_runs.py. The same launches show
that the driver trains (the loss falls, the warmup, the tokens counted, the batch DeepSpeed was given) and
saves whole checkpoints at each stage.
"""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, cpu_profile, launch, read_metrics

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

N, K = 6, 3
COMMON = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--lr", "3e-3",
          "--warmup-steps", "1", "--log-data-every-steps", "2"]


def stop_at(run, k: int, into):
    """The run directory as a run stopped after step k would have left it."""
    shutil.copytree(run, into)
    for tag in (into / "checkpoints").iterdir():
        if tag.is_dir() and tag.name != f"global_step{k}":
            shutil.rmtree(tag)
    (into / "checkpoints" / "latest").write_text(f"global_step{k}")  # DeepSpeed's own pointer
    lines = (into / "metrics.jsonl").read_text().splitlines()
    (into / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= k))


def stopped_and_resumed(launcher: str, args: list[str], tmp_path, n: int, k: int, nproc: int = 2):
    """Run A 0 -> n saving every k steps (tmp_path/a/r), then B: A's directory as it was at step k, resumed to
    n (tmp_path/b/r). Both launches must succeed; returns (A's, B's) completed processes."""
    full = launch(launcher, args + ["--out", str(tmp_path / "a"), "--run-id", "r", "--max-steps", str(n),
                                    "--save-every-steps", str(k)], nproc=nproc)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    stop_at(tmp_path / "a" / "r", k, tmp_path / "b" / "r")
    resumed = launch(launcher, args + ["--out", str(tmp_path / "b"), "--run-id", "r", "--max-steps", str(n),
                                       "--resume", "auto"], nproc=nproc)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return full, resumed


@pytest.mark.parametrize("source, stage", [("mix", 2), ("shards", 3)])
def test_stop_and_resume_sees_the_same_tokens_and_losses(source, stage, tmp_path, mix_path):
    data, workers = str(mix_path), 0
    if source == "shards":
        data, workers = str(tmp_path / "shards"), 1
        prep = subprocess.run([sys.executable, "-m", "zerotrain", "prepare", "--data", str(mix_path),
                               "--out", data, "--shard-tokens", "20000"], capture_output=True, text=True, cwd=REPO)
        assert prep.returncode == 0, prep.stderr
    args = ["--profile", cpu_profile(tmp_path, stage=stage, workers=workers), "--data", data, *COMMON]
    full, resumed = stopped_and_resumed("deepspeed", args, tmp_path, N, K)
    assert f"resumed from {tmp_path / 'b' / 'r' / 'checkpoints' / f'global_step{K}'} at step {K}" in resumed.stdout

    a, b = read_metrics(tmp_path / "a" / "r"), read_metrics(tmp_path / "b" / "r")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, N + 1))
    # it trains: finite losses that fall, the warmup of 1 step (step 1 at the peak), every token counted
    losses = [m["loss"] for m in a]
    assert all(x == x and x < 20 for x in losses) and losses[-1] < losses[0] - 0.3, losses
    assert a[0]["lr"] == pytest.approx(3e-3)
    assert a[-1]["tokens_seen"] == b[-1]["tokens_seen"] == N * 2 * 2 * 2 * 64  # steps x micro x accum x ranks x seq
    run = tmp_path / "a" / "r"
    ds_config = json.loads((run / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == stage and ds_config["train_batch_size"] == 8
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
    for tag in (run / "checkpoints" / f"global_step{K}", run / "checkpoints" / f"global_step{N}",
                tmp_path / "b" / "r" / "checkpoints" / f"global_step{N}"):
        assert (tag / "zerotrain.json").is_file() and any(tag.glob("*optim_states.pt")), tag
    assert [m["tokens_sha"] for m in a] == [m["tokens_sha"] for m in b]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # full-precision floats, compared exactly
    assert len({m["tokens_sha"] for m in a}) == N  # every step saw new data
    assert a[-1]["data_shares"] == b[-1]["data_shares"]
    assert abs(a[-1]["data_shares"]["prose"] - 0.7) < 0.05


def test_resume_on_another_world_size_with_a_streamed_source_is_refused(tmp_path, mix_path):
    """A 2-rank checkpoint resumed by 1 rank when a source is streamed (its position is one rank's
    stream state: no exact re-split): refused before anything is written."""
    streamed = tmp_path / "streamed.json"
    streamed.write_text(json.dumps({"sources": [{"name": "prose", "path": str(mix_path.parent / "prose.jsonl"),
                                                 "weight": 1, "streaming": True}]}))
    out = tmp_path / "runs"
    run = out / "r" / "checkpoints" / "global_step2"
    run.mkdir(parents=True)
    (run / "zerotrain.json").write_text(json.dumps({"step": 2, "tokens_seen": 1, "world_size": 2, "run_id": "r",
                                                    "loader_workers": 0}))
    before = sorted(p.name for p in (out / "r").rglob("*"))
    proc = launch("python", ["--data", str(streamed), "--out", str(out), "--run-id", "r", *COMMON,
                             "--max-steps", "4"])
    assert proc.returncode == 2
    assert "source 'prose' is streamed" in proc.stderr and "cannot change world size (2 -> 1)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (out / "r").rglob("*")) == before
