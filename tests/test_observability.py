"""Observability: the TensorBoard and W&B sinks read back, per-step measurements, `zerotrain report`
and `zerotrain runs` on a real run directory, and their bad input (one line, exit 2).

One real 1-rank run (session fixture, ~15 s, with --log tensorboard,wandb) serves every report,
runs and end-to-end sink test; the sinks' own behaviour is unit-tested by feeding records.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launch
from zerotrain.launcher.components import manifest
from zerotrain.launcher.components.checkpoints.run_lock import RunLock
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher.errors import StopRun, UsageError
from zerotrain.launcher.components.observe.metrics import MetricsLogger, read_metrics, scalars, step_measurements
from zerotrain.launcher.config import parse_sinks

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "obs-run"


# -- readers of what the sinks wrote: the packages' own formats, not our code -----------------------

def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (its EventAccumulator, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_offline_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run directory under run_dir/wandb, oldest steps first: {"id", "history":
    {step: {key: value}}}. The .wandb file is LevelDB's log format (32 KiB blocks, 7-byte record
    headers, after a 7-byte ":W&B" file header) holding wandb_internal_pb2.Record protobufs.
    wandb-core writes it in the background: finish() can return before the file is complete, so
    wait (up to 30 s) for its closing "exit" record."""
    found = []
    for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
        deadline = time.time() + 30
        records = _wandb_records(path)
        while (not records or records[-1].WhichOneof("record_type") != "exit") and time.time() < deadline:
            time.sleep(0.2)
            records = _wandb_records(path)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        history = {}
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
        found.append({"id": run.run_id, "project": run.project, "name": run.display_name, "history": history})
    return sorted(found, key=lambda run: min(run["history"], default=0))


def _wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zeros or a record still being written
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(buf)
            records.append(rec)
            buf = b""
    return records


def step_record(step: int, loss: float, **extra) -> dict:
    record = {"step": step, "loss": loss, "lr": 1e-3 * step, "grad_norm": 2.0 / step, "tokens_sha": "ab12",
              "tokens_seen": 2048 * step, "tokens_per_s": 4000.0 + step, "elapsed_s": 0.5 * step}
    if step % 2 == 0:
        record.update(val_loss=loss - 0.1, val_loss_per_source={"prose": loss - 0.2, "notes": loss}, eval_s=0.2,
                      data_shares={"prose": 0.7, "notes": 0.3})
    return {**record, **extra}


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """No API key anywhere (env, ~/.netrc): wandb must go offline by itself."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


# -- the sinks, fed records directly -------------------------------------------------------------------

def test_tensorboard_events_equal_the_effective_metrics(tmp_path):
    run = tmp_path / RUN_ID
    run.mkdir()
    cfg = RunConfig.from_flat(dict(data="mix.json", log="tensorboard"))
    logger = MetricsLogger(run, True, cfg)
    for step in range(1, 6):
        logger.log(step_record(step, 5.0 - 0.1 * step))
    logger.event("resume", 3, checkpoint="global_step3")  # steps 4-5 are logged again, differently
    for step in range(4, 7):
        logger.log(step_record(step, 9.0 - step))
    logger.event("stop", 6, reason="finished", message="done")
    logger.close()

    history = read_metrics(run)
    expected: dict[str, list] = {}
    for record in history:
        for tag, value in scalars(record).items():
            expected.setdefault(tag, []).append((record["step"], pytest.approx(value, rel=1e-6)))
    got = tensorboard_scalars(run / "tensorboard")
    assert "data_shares/prose" in got and "val_loss_per_source/notes" in got and "tokens_sha" not in got
    assert got == expected  # the resumed timeline, not the abandoned steps 4-5
    assert got["loss"][3:] == [(4, 5.0), (5, 4.0), (6, 3.0)]


def test_wandb_offline_run_holds_the_steps_and_a_resume_continues_it(tmp_path, no_wandb_account, capsys):
    run = tmp_path / RUN_ID
    run.mkdir()
    cfg = RunConfig.from_flat(dict(data="mix.json", log="wandb", wandb_project="proj", wandb_group="g"))
    logger = MetricsLogger(run, True, cfg)
    for step in range(1, 5):
        logger.log(step_record(step, 5.0 - 0.1 * step))
    logger.event("stop", 4, reason="signal", message="stopped")
    logger.close()
    assert "logging offline" in capsys.readouterr().out  # no key: offline, said once, no prompt

    # the next launch of the same run: resumed from step 2, so steps 3-4 come again
    logger = MetricsLogger(run, True, cfg)
    logger.event("resume", 2, checkpoint="global_step2")
    for step in range(3, 7):
        logger.log(step_record(step, 7.0 - 0.5 * step))
    logger.close()
    assert "cannot rewrite" in capsys.readouterr().out

    first, second = wandb_offline_runs(run)
    assert first["id"] == second["id"] == RUN_ID  # `wandb sync` puts both into one W&B run
    assert sorted(first["history"]) == [1, 2, 3, 4]
    assert first["history"][2] == pytest.approx(scalars(step_record(2, 4.8)))
    assert sorted(second["history"]) == [5, 6]  # W&B cannot take steps 3-4 again
    assert second["history"][6]["loss"] == pytest.approx(4.0)


@pytest.mark.launches
def test_wandb_asks_nothing_with_a_terminal_attached(tmp_path, no_wandb_account):
    """Under a pseudo-terminal and no WANDB_MODE, wandb would prompt for a key; we must go offline."""
    import pty

    script = ("import sys; from pathlib import Path; from zerotrain.launcher.config import RunConfig;"
              " from zerotrain.launcher.components.observe.metrics import MetricsLogger; print('tty', sys.stdin.isatty(), flush=True);"
              f" m = MetricsLogger(Path({str(tmp_path)!r}), True, RunConfig.from_flat(dict(data='m', log='wandb')));"
              " m.log({'step': 1, 'loss': 2.5}); m.close(); print('done', flush=True)")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    os.close(slave)
    out, deadline = b"", time.time() + 120
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = out.decode(errors="replace")
    assert proc.wait(timeout=10) == 0, text
    assert "tty True" in text and "done" in text, text
    assert "API key" in text and "logging offline" in text
    assert [r["history"] for r in wandb_offline_runs(tmp_path)] == [{1: {"loss": 2.5}}]


def test_wandb_settings_users_set_in_the_environment_are_kept(tmp_path, no_wandb_account, monkeypatch):
    """WANDB_PROJECT, WANDB_NAME, WANDB_RUN_ID, WANDB_DIR, WANDB_RESUME win over our defaults; a
    --wandb-* flag wins over them. Read back from the run record wandb itself wrote (offline)."""
    from zerotrain.launcher.components.observe.metrics import wandb_init_args

    run = tmp_path / RUN_ID
    run.mkdir()
    env = {"WANDB_PROJECT": "x", "WANDB_NAME": "their-name", "WANDB_RUN_ID": "their-id",
           "WANDB_DIR": str(tmp_path / "wb"), "WANDB_RESUME": "must", "WANDB_RUN_GROUP": "g"}
    defaults = wandb_init_args(run, RunConfig.from_flat(dict(data="m", log="wandb")), {})
    assert defaults == {"project": "zerotrain", "entity": None, "group": None, "name": RUN_ID, "id": RUN_ID,
                        "dir": str(run), "resume": "allow"}
    flags = RunConfig.from_flat(dict(data="m", log="wandb", wandb_project="flag", wandb_name="flag-name",
                                     wandb_group="fg"))
    assert wandb_init_args(run, flags, env) == {"project": "flag", "entity": None, "group": "fg",
                                                "name": "flag-name", "id": "their-id", "dir": str(tmp_path / "wb"),
                                                "resume": "must"}
    for name, value in {**env, "WANDB_RESUME": "allow"}.items():  # "must" needs a run on the server
        monkeypatch.setenv(name, value)
    (tmp_path / "wb").mkdir()
    logger = MetricsLogger(run, True, RunConfig.from_flat(dict(data="m", log="wandb")))
    logger.log(step_record(1, 3.0))
    logger.close()
    (recorded,) = wandb_offline_runs(tmp_path / "wb")  # WANDB_DIR: not under the run directory
    assert (recorded["project"], recorded["name"], recorded["id"]) == ("x", "their-name", "their-id")
    assert recorded["history"] == {1: pytest.approx(scalars(step_record(1, 3.0)))}
    assert not (run / "wandb").exists()


def test_only_rank_0_writes(tmp_path, no_wandb_account):
    run = tmp_path / RUN_ID
    run.mkdir()
    logger = MetricsLogger(run, False, RunConfig.from_flat(dict(data="m", log="tensorboard,wandb")))
    logger.log(step_record(1, 3.0))
    logger.close()
    assert list(run.iterdir()) == []


def test_unknown_sink_and_bad_wandb_run_id_are_one_line_usage_errors(tmp_path):
    with pytest.raises(UsageError, match=r"--log tensorboard,wandbb: unknown sink 'wandbb' \(choose from jsonl,"):
        config_from({"data": "mix.json", "log": "tensorboard,wandbb"})
    with pytest.raises(UsageError, match="--run-id 'a:b': --log wandb uses it as the W&B run id"):
        config_from({"data": "mix.json", "log": "wandb", "run_id": "a:b"})
    with pytest.raises(UsageError, match="--log 3: expected sink names"):
        config_from({"data": "mix.json", "log": 3})  # a recipe's wrong type
    assert parse_sinks(" jsonl, tensorboard ") == parse_sinks(["tensorboard"]) == ["jsonl", "tensorboard"]


@pytest.mark.launches
def test_step_measurements_on_this_cpu():
    from deepspeed.accelerator import get_accelerator

    before = step_measurements(0.5, 0.01, get_accelerator())
    assert set(before) == {"step_s", "data_wait_s", "peak_rss_gib"}  # no accelerator memory on a CPU node
    assert (before["step_s"], before["data_wait_s"]) == (0.5, 0.01)
    # In a fresh process (this one's peak is already high from earlier tests): touched pages count
    # toward RSS, so the peak must rise by ~0.29 GiB.
    import subprocess
    import sys

    # (ru_maxrss survives fork+exec: the child starts with this process's peak, so allocate past it)
    code = ("from zerotrain.launcher.components.observe.metrics import step_measurements as m; a = m(0, 0)['peak_rss_gib'];"
            " block = b'x' * int((a + 0.3) * 2 ** 30); print(m(0, 0)['peak_rss_gib'] - a)")
    rise = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent.parent).stdout)
    assert rise > 0.25, rise


# -- one real run: the Trainer with --log tensorboard,wandb; report and runs on it ---------------------

@pytest.fixture(scope="session")
def real_run(tmp_path_factory, mix_path) -> Path:
    out = tmp_path_factory.mktemp("obs")
    result = launch("python", ["--data", str(mix_path), "--out", str(out), "--run-id", RUN_ID, "--max-steps", "6",
                               "--eval-every-steps", "2", "--eval-tokens", "3000", "--save-every-steps", "3",
                               "--log-data-every-steps", "2", "--log", "tensorboard,wandb"],
                    env_extra={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / RUN_ID


@pytest.mark.launches
def test_real_run_sinks_match_metrics_jsonl(real_run):
    history = read_metrics(real_run)
    assert [r["step"] for r in history] == list(range(1, 7))
    tb = tensorboard_scalars(real_run / "tensorboard")
    assert tb["loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in history]
    assert [s for s, _ in tb["val_loss"]] == [2, 4, 6]
    (wb,) = wandb_offline_runs(real_run)
    assert wb["id"] == RUN_ID
    assert {s: v["loss"] for s, v in wb["history"].items()} == {r["step"]: pytest.approx(r["loss"]) for r in history}


def zerotrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


@pytest.mark.launches
def test_report_writes_plots_and_summary(real_run):
    result = zerotrain("report", str(real_run))
    assert result.returncode == 0, result.stderr
    report = real_run / "report"
    for name in ("overview.png", "loss_vs_steps.png", "loss_vs_tokens.png", "throughput.png", "lr.png",
                 "grad_norm.png", "data_shares.png"):
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    text = (report / "report.md").read_text()
    history = read_metrics(real_run)
    best = json.loads((real_run / "checkpoints" / "best.json").read_text())
    assert "**Status: finished**" in text
    assert f"| best validation loss | {best['val_loss']:.4g} (step {best['step']}, checkpoint {best['tag']}) |" in text
    assert f"| final train loss | {history[-1]['loss']:.4g} " in text
    stop = read_metrics(real_run, events=True)[-1]
    assert f"| checkpoint saves | {stop['saves']}, " in text and stop["saves"] == 4  # new bests at 2, 4, 6; every 3
    assert f"| evaluations | 3, " in text
    assert "| 1 | " in text and "finished at step 6" in text  # the launch, from manifest.json
    assert "![loss_vs_steps](loss_vs_steps.png)" in text


def copy_run(src: Path, dst: Path) -> Path:
    """The run's JSON files only (the checkpoints' weights are not needed to report on it)."""
    dst.mkdir(parents=True)
    for name in ("metrics.jsonl", "config.json", "manifest.json"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.launches
def test_report_compare_overlays_runs(real_run, tmp_path):
    from zerotrain.launcher.commands.report import load_run
    from zerotrain.launcher.commands.report_plots import _loss_steps

    other = copy_run(real_run, tmp_path / "other-run")
    lines = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": r["loss"] + 1} if "loss" in r else r) + "\n"
                                                 for r in lines))
    result = zerotrain("report", str(real_run), "--compare", str(other), "--out", str(tmp_path / "cmp"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "## Compared runs" in text and f"| {RUN_ID} | finished | 6 |" in text and "| other-run | " in text
    assert (tmp_path / "cmp" / "overview.png").is_file()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert _loss_steps(ax, [load_run(real_run), load_run(other)], [RUN_ID, "other-run"])
    labels = ax.get_legend_handles_labels()[1]
    assert {f"{RUN_ID}: train", "other-run: train", f"{RUN_ID}: validation", "other-run: validation"} <= set(labels)
    plt.close(fig)


@pytest.mark.launches
def test_a_resume_whose_data_lost_documents_is_refused_before_anything_is_written(real_run, tmp_path):
    """The checkpoint's meta names how many documents its loaders split per source (run_state.py); a resume
    compares the data with it in the plan, before the run directory is written, the lock taken or a universal
    conversion made (it used to be found in the loader's load, after all three)."""
    from conftest import write_mix
    from test_bad_input import snapshot

    tag = real_run / "checkpoints" / "global_step6"
    assert all(n > 300 for n in json.loads((tag / "zerotrain.json").read_text())["documents"])
    smaller = write_mix(tmp_path / "data", n_docs=300)  # 100 documents fewer in each source
    before = snapshot(real_run)
    result = zerotrain("train", "--data", str(smaller), "--out", str(tmp_path / "runs"), "--run-id", "other",
                       "--resume", str(tag), "--max-steps", "8", "--eval-every-steps", "2", "--eval-tokens", "3000")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"zerotrain: error: checkpoint {tag}: its loaders split ") and "of source 'prose'" in line
    assert "the data now gives" in line and "changed since the checkpoint; restore it, or start a new --run-id" in line
    assert snapshot(real_run) == before and not (tmp_path / "runs").exists()


@pytest.mark.launches
def test_runs_lists_status_of_each_run(real_run, tmp_path):
    out = tmp_path / "runs"
    def weights(directory, names):  # checkpoints are copied with their markers, without their weights
        return [n for n in names if Path(directory).name.startswith("global_step") and n != "zerotrain.json"]

    shutil.copytree(real_run, out / RUN_ID, ignore=weights)
    # a run stopped by its budget, one killed mid-launch (its segment never ended), one running now
    args = dict(config_hash="h", profile="cpu", seed=1, world_size=1, hosts=["vm"], rank0_only=False)
    budget = copy_run(real_run, out / "budget-run")
    manifest.write_or_extend(budget, run_id="budget-run", resumed_from="x/global_step6", **args)
    manifest.record_end(budget, StopRun("budget", "budget reached"), 6, rank0_only=False)
    killed = copy_run(real_run, out / "killed-run")
    manifest.write_or_extend(killed, run_id="killed-run", resumed_from="x/global_step6", **args)
    live = copy_run(real_run, out / "live-run")
    (out / "not-a-run").mkdir()
    with RunLock(live, say=lambda *a: None):
        result = zerotrain("runs", str(out))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {RUN_ID, "budget-run", "killed-run", "live-run"}
    history = read_metrics(real_run)
    best = json.loads((real_run / "checkpoints" / "best.json").read_text())
    finished = rows[RUN_ID].split()
    assert finished[1:5] == ["finished", "6/6", f"{history[-1]['loss']:.4g}", f"{best['val_loss']:.4g}"]
    assert finished[-3:] == ["12.3k", "global_step6", "-"]  # tokens, last checkpoint, health (no window closed)
    assert "stopped (budget)" in rows["budget-run"]
    assert "failed (killed or crashed" in rows["killed-run"]
    assert f"running (pid {os.getpid()}" in rows["live-run"]
    result = zerotrain("runs", str(out), "--json")
    summaries = {s["run"]: s for s in map(json.loads, result.stdout.splitlines())}
    assert summaries[RUN_ID]["tokens"] == history[-1]["tokens_seen"]
    assert summaries["live-run"]["status"].startswith("finished")  # the lock was released


# -- bad input: one line, exit 2 --------------------------------------------------------------------------

@pytest.mark.launches
def test_bad_input_is_one_line_exit_2(tmp_path, mix_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a run")
    for args, expected in [
        (["report", str(tmp_path / "plain")], "not a zerotrain run directory"),
        (["report", str(tmp_path / "missing")], "no such run directory"),
        (["runs", str(tmp_path / "missing")], "no such directory"),
        (["train", "--data", str(mix_path), "--out", str(tmp_path / "out"), "--log", "tensorbord"],
         "--log tensorbord: unknown sink 'tensorbord'"),
    ]:
        result = zerotrain(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_metrics_jsonl_ends_a_torn_line_before_appending_and_survives_a_full_disk(tmp_path, capsys):
    """A kill or a full disk mid-record leaves a last line without its newline: the next launch's first record
    must not be glued to it (read_metrics would drop both). A disk that refuses a write (/dev/full: ENOSPC)
    costs that record and one warning line, not the run."""
    from zerotrain.launcher.components.observe.metrics import JsonlSink, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"event": "stop", "step": 1, "re')
    sink = JsonlSink(path)
    sink.write({"event": "resume", "step": 1})
    sink.write({"step": 2, "loss": 1.5})
    sink.close()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    assert [e["event"] for e in read_metrics(tmp_path, events=True)] == ["resume"]  # not lost to the torn line
    full = JsonlSink(Path("/dev/full"))
    full.write({"step": 1})
    full.write({"step": 2})
    full.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/dev/full: a record could not be written (No space left on device)" in err[0]


def test_a_launch_without_a_checkpoint_supersedes_the_steps_a_dead_launch_logged(tmp_path):
    """A launch that ended before its first save (a hang, a kill) left steps 1-6 in metrics.jsonl; the next one has
    nothing to resume from and starts at step 1: its "restart" event makes read_metrics (and `zerotrain runs`,
    the report, TensorBoard) show its steps only. A first launch writes no such event."""
    first = MetricsLogger(tmp_path, True)
    first.fresh_start()
    for step in range(1, 7):
        first.log({"step": step, "loss": 9.0})
    first.close()
    assert read_metrics(tmp_path, events=True) == []
    again = MetricsLogger(tmp_path, True)
    again.fresh_start()
    for step in range(1, 5):
        again.log({"step": step, "loss": 5.0})
    again.close()
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(s, 5.0) for s in range(1, 5)]
    assert [e["event"] for e in read_metrics(tmp_path, events=True)] == ["restart"]
