"""manifest.json: first launch, resume segments, how each launch ended, rank 0 only, atomic writes."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest

from zerotrain.launcher.components import manifest
from zerotrain.launcher.errors import StopRun

REPO = Path(__file__).resolve().parent.parent
ARGS = dict(run_id="debug-cpu-abc123", config_hash="abc123", profile="cpu", seed=1337)


def test_first_launch_then_resumes_append_segments(tmp_path):
    run = tmp_path / "run"
    m1 = manifest.write_or_extend(run, **ARGS, world_size=2, hosts=["node-a", "node-a"], resumed_from=None,
                                  rank0_only=False)
    on_disk = json.loads((run / "manifest.json").read_text())
    assert on_disk == m1
    assert {k: on_disk[k] for k in ARGS} == ARGS
    assert on_disk["world_size"] == 2 and on_disk["hosts"] == ["node-a"]
    assert on_disk["versions"]["deepspeed"] == importlib.metadata.version("deepspeed")
    assert on_disk["versions"]["torch"] == importlib.metadata.version("torch")
    assert set(manifest.PACKAGES) <= set(on_disk["versions"])
    assert on_disk["started"].endswith("+00:00") and on_disk["segments"][0]["started"] == on_disk["started"]
    manifest.record_end(run, StopRun("signal", "SIGTERM at step 40; checkpoint saved"), 40, rank0_only=False)

    # The second launch: resumed on other hosts with another world size; the top level stays.
    manifest.write_or_extend(run, **ARGS, world_size=1, hosts=["node-b"],
                             resumed_from="runs/r/checkpoints/global_step40", rank0_only=False)
    # The third launch was killed -9: it never records an end.
    manifest.write_or_extend(run, **ARGS, world_size=1, hosts=["node-b"],
                             resumed_from="runs/r/checkpoints/global_step40", rank0_only=False)
    m = manifest.read_manifest(run)
    assert m["world_size"] == 2 and m["hosts"] == ["node-a"] and m["started"] == on_disk["started"]
    first, second, third = m["segments"]
    assert first["from_checkpoint"] is None and first["hosts"] == ["node-a"] and first["world_size"] == 2
    assert (first["end_reason"], first["end_step"], first["end_exit_code"]) == ("signal", 40, 6)
    assert first["end_message"] == "SIGTERM at step 40; checkpoint saved" and "ended" in first
    assert second["from_checkpoint"] == "runs/r/checkpoints/global_step40"
    assert second["hosts"] == ["node-b"] and second["world_size"] == 1 and "ended" not in second
    # record_end closes the current (last) segment only.
    manifest.record_end(run, StopRun("finished", "reached --max-steps 100"), 100, rank0_only=False)
    m = manifest.read_manifest(run)
    assert "ended" not in m["segments"][1]
    assert (m["segments"][2]["end_reason"], m["segments"][2]["end_step"], m["segments"][2]["end_exit_code"]) == \
        ("finished", 100, 0)
    assert m["segments"][0]["end_step"] == 40
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json"]  # no temporary file left behind


@pytest.mark.launches
def test_git_commit_of_the_checkout_and_none_elsewhere(tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert manifest.git_commit()["commit"] == head.stdout.strip()
    assert manifest.git_commit(tmp_path) is None  # not a checkout: no failure, no commit
    (tmp_path / "inner").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert manifest.git_commit(tmp_path / "inner") is None  # inside some other repository: not ours


def test_only_rank0_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert manifest.write_or_extend(tmp_path, **ARGS, world_size=2, hosts=["h"], resumed_from=None) is None
    assert manifest.record_end(tmp_path, "finished", 3) is None
    assert not (tmp_path / "manifest.json").exists()
    monkeypatch.setenv("RANK", "0")
    assert manifest.write_or_extend(tmp_path, **ARGS, world_size=2, hosts=["h"], resumed_from=None) is not None


def test_unreadable_manifest_is_kept_aside_and_a_new_one_started(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text('{"run_id": "x", "segm')  # e.g. a hand edit gone wrong
    m = manifest.write_or_extend(tmp_path, **ARGS, world_size=1, hosts=["h"], resumed_from="ckpt", rank0_only=False)
    assert len(m["segments"]) == 1 and m["segments"][0]["from_checkpoint"] == "ckpt"
    assert (tmp_path / "manifest.json.unreadable").read_text() == '{"run_id": "x", "segm'
    assert "not readable JSON" in capsys.readouterr().err
    assert manifest.record_end(tmp_path / "nothing-here", "finished", 1, rank0_only=False) is None
