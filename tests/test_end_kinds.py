"""How a run can end is one table (launcher/ends.py END_KINDS), and everything reads it: docs/exit-codes.md's
table, StopRun, the manifest, `zerotrain runs`/`report`; and a run directory written before the table
(manifest segments with only `end_reason`) still reads. No process group, no torch."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zerotrain.launcher.commands import report
from zerotrain.launcher.components import manifest
from zerotrain.launcher.config_resolve import build_parser
from zerotrain.launcher.ends import END_KINDS, exit_code_table, exit_status_help, kind_of_exit, status_of
from zerotrain.launcher.errors import StopRun

REPO = Path(__file__).resolve().parent.parent


def docs_exit_codes() -> list[str]:
    """The table rows of docs/exit-codes.md, as written."""
    text = (REPO / "docs" / "exit-codes.md").read_text()
    return [line.strip() for line in text.splitlines() if line.startswith("|")]


def test_docs_exit_codes_are_the_table():
    rows = docs_exit_codes()
    assert rows == exit_code_table(), (
        "docs/exit-codes.md's table and launcher/ends.py END_KINDS differ; the table as it should read:\n"
        + "\n".join(exit_code_table()))
    kinds = [re.match(r"\| (\d+) \| `([^`]+)` \|", r).groups() for r in rows[2:]]
    assert {k: int(c) for c, k in kinds} == {k: e.exit_code for k, e in END_KINDS.items()}


def test_train_help_names_the_codes_of_the_tables_train_kinds():
    """`zerotrain train --help` says its exit codes from the table: every code a train end exits with, and
    no other command's (pre-flight's 9, export's 10)."""
    epilog = build_parser().epilog
    assert epilog.startswith(exit_status_help("train"))
    said = exit_status_help("train").split(".")[0]
    for e in END_KINDS.values():
        assert bool(re.search(rf"\b{e.exit_code} ", said)) == any(
            k.command == "train" for k in END_KINDS.values() if k.exit_code == e.exit_code), (e.kind, said)
    saved = re.search(r"saved at ([\d, ]+);", epilog).group(1)
    assert sorted(int(c) for c in saved.split(", ")) == sorted(
        {e.exit_code for e in END_KINDS.values() if e.command == "train" and e.saves})


def test_each_kind_has_one_code_and_each_nonzero_code_one_kind():
    """A scheduler tells every end apart by its code: only the finished ends share 0."""
    codes = [e.exit_code for e in END_KINDS.values() if e.exit_code != 0]
    assert len(codes) == len(set(codes))
    assert all(not e.failed for e in END_KINDS.values() if e.exit_code == 0)
    assert all(e.failed for e in END_KINDS.values() if e.exit_code in (1, 2, 3, 7, 9))


def test_stop_run_takes_its_code_and_checkpoint_from_the_table():
    for kind, end in END_KINDS.items():
        stop = StopRun(kind, "why")
        assert (stop.kind, stop.message, stop.exit_code, stop.save) == (kind, "why", end.exit_code, end.saves)
    assert StopRun("signal", "x").save and not StopRun("diverged", "x").save
    with pytest.raises(ValueError, match="unknown end kind 'stoped'"):
        StopRun("stoped", "x")
    assert [kind_of_exit(c) for c in (0, 3, 6, 9, 130, 77)] == [
        "finished", "diverged", "signal", "preflight-failed", "hard-signal", "crash"]
    assert status_of("budget") == "stopped (budget)" and status_of("save-failed") == "failed (checkpoint write failed)"
    assert status_of("some-newer-kind") == "stopped (some-newer-kind)"


def test_manifest_records_kind_code_and_message(tmp_path):
    run = tmp_path / "run"
    manifest.write_or_extend(run, run_id="r", config_hash="h", profile="cpu", seed=1, world_size=1, hosts=["a"],
                             resumed_from=None, rank0_only=False)
    manifest.record_end(run, StopRun("budget", "budget reached at step 9: --total-tokens 1000"), 9, rank0_only=False)
    seg = json.loads((run / "manifest.json").read_text())["segments"][-1]
    assert (seg["end_reason"], seg["end_exit_code"], seg["end_step"]) == ("budget", 5, 9)
    assert seg["end_message"] == "budget reached at step 9: --total-tokens 1000"


# -- a run directory in the format written before the table ---------------------------------------------

def old_run_dir(root: Path) -> Path:
    """A run directory as the previous layout wrote it, by hand: manifest segments record only
    `end_reason` (no exit code, no message), a checkpoint marker without `files`, metrics with a stop event."""
    run = root / "old-run"
    tag = run / "checkpoints" / "global_step6"
    tag.mkdir(parents=True)
    segment = {"started": "2026-11-01T10:00:00+00:00", "hosts": ["node-a"], "world_size": 2, "from_checkpoint": None,
               "config_hash": "abc123", "versions": {"python": "3.11.9", "deepspeed": "0.19.8", "torch": "2.5.1"},
               "git": None, "pid": 4242}
    (run / "manifest.json").write_text(json.dumps({
        "format": 1, "run_id": "old-run", "config_hash": "abc123", "profile": "cpu", "seed": 1337,
        "versions": segment["versions"], "git": None, "hosts": ["node-a"], "world_size": 2,
        "started": segment["started"],
        "segments": [{**segment, "ended": "2026-11-01T10:05:00+00:00", "end_step": 6, "end_reason": "signal"}]},
        indent=2))
    (run / "config.json").write_text(json.dumps({"run": {"max_steps": 10, "seq_len": 64, "model": "debug"},
                                                 "run_id": "old-run", "profile": "cpu", "world_size": 2,
                                                 "model": {"n_layers": 2, "dim": 64}, "identity_hash": "abc123"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        *({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_seen": 256 * s, "tokens_per_s": 900.0, "step_s": 0.3,
           "data_wait_s": 0.01, "elapsed_s": 0.3 * s} for s in range(1, 7)),
        {"event": "stop", "step": 6, "reason": "signal", "message": "stopped by SIGTERM at step 6", "saves": 1,
         "save_blocked_s": 0.2}]))
    (tag / "zerotrain.json").write_text(json.dumps({"step": 6, "tokens_seen": 1536, "world_size": 2,
                                                    "run_id": "old-run"}))
    (run / "checkpoints" / "best.json").write_text(json.dumps({"tag": "global_step6", "step": 6, "val_loss": 4.5}))
    return run


def test_runs_and_report_read_a_run_directory_of_the_previous_format(tmp_path, capsys):
    run = old_run_dir(tmp_path)
    report.runs_main([str(tmp_path)])
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:3] == ["old-run", "stopped", "(signal)"] and "global_step6" in row
    report.report_main([str(run), "--out", str(tmp_path / "rep")])
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "**Status: stopped (signal)**" in text
    assert "| signal at step 6, exit 6 |" in text  # the code from the table: the old manifest has none


def test_a_resume_of_an_old_run_extends_its_manifest_in_the_new_format(tmp_path):
    run = old_run_dir(tmp_path)
    manifest.write_or_extend(run, run_id="old-run", config_hash="abc123", profile="cpu", seed=1337, world_size=1,
                             hosts=["node-b"], resumed_from=str(run / "checkpoints" / "global_step6"), rank0_only=False)
    manifest.record_end(run, StopRun("finished", "reached --max-steps 10"), 10, rank0_only=False)
    old, new = manifest.read_manifest(run)["segments"]
    assert old["end_reason"] == "signal" and "end_exit_code" not in old  # the old segment is kept as it was
    assert (new["end_reason"], new["end_exit_code"], new["end_message"]) == ("finished", 0, "reached --max-steps 10")
    assert report.run_status(report.load_run(run)) == "finished"
