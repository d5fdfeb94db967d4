"""`zerotrain launch --max-restarts`: a job that ends restartably (hung, a lost rank, a crash) is killed to the
last process and started again with --resume auto, and reproduces the uninterrupted run bit for bit; bad input,
divergence and a SIGTERM to the launcher are never restarted.

The policy, the flags, the records and the loop are tested without DeepSpeed (a fake runner that exits with
the codes a test lists); then the real `deepspeed` launcher on 2 CPU ranks (ZeRO-3, gloo): one launch in
which a rank is SIGKILLed, then (after the first restart) SIGSTOPped until the hang watchdog fires, compared
with one uninterrupted run; one launch each for a divergence and a SIGTERM to the launcher.
The launches go through the hostfile form (`--no_ssh`, one local node) with a free port, so that tests
running beside them never meet on DeepSpeed's default port; the `-n N` form differs only in its argument
parsing (tested in-process below, and by tests/test_readme_walkthrough.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, read_metrics
from zerotrain.launcher.commands import launch as launch_cmd
from zerotrain.launcher.commands import report
from zerotrain.launcher.components import manifest
from zerotrain.launcher.components.launching import jobs, launcher_watch
from zerotrain.launcher.components.launching.restarts import (
    JobEnd, RankExit, RankWatch, Restarts, rank_processes, stat_fields, take_restart_flags, with_resume_auto)
from zerotrain.launcher.ends import END_KINDS, final_exit_codes, kind_of_exit
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.rank_ends import RANK_ENDS

N, K = 16, 4  # steps of every run; the checkpoint a test waits for before it strikes
FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2",
         "--log-data-every-steps", "0", "--max-steps", str(N), "--save-every-steps", str(K)]
ENV = {"OMP_NUM_THREADS": "1"}


# -- the policy --------------------------------------------------------------------------------------------

def test_restartable_ends_are_hung_and_crash_and_every_other_code_of_a_kind_is_final():
    assert {k for k, e in END_KINDS.items() if e.restartable} == {"hung", "crash"}
    assert final_exit_codes() == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 130]
    for code, restartable in [(11, True), (1, True), (247, True), (137, True), (0, False), (2, False), (3, False),
                              (4, False), (5, False), (6, False), (7, False), (8, False), (9, False), (12, False),
                              (130, False)]:
        assert END_KINDS[kind_of_exit(code)].restartable == restartable, code
        assert JobEnd(code, True, False, None, 1.0).restartable == restartable
        assert not JobEnd(code, True, True, None, 1.0).restartable  # we were told to stop: never


def test_the_cause_in_words():
    lost = JobEnd(247, False, False, RankExit(1, "killed by SIGKILL", None), 9.0)
    assert lost.cause() == "a rank lost (rank 1 killed by SIGKILL; exit 247)" and lost.rank() == 1
    assert JobEnd(247, False, False, None, 9.0).cause() == "a rank lost (killed by SIGKILL; exit 247)"
    assert JobEnd(139, False, False, RankExit(0, "ended", None), 1).cause() == "a rank lost (rank 0 lost; exit 139)"
    hung = JobEnd(11, True, False, RankExit(0, "exit 11", 11), 30.0)
    assert hung.cause([1]) == "hung (exit 11; rank 1 behind)" and hung.rank([1]) == 1
    assert hung.cause() == "hung (exit 11, rank 0 first to exit)" and hung.rank() == 0
    assert JobEnd(1, False, False, None, 3.0).cause() == "crash (exit 1)"


def test_flags_and_the_train_flags_of_a_restart():
    assert take_restart_flags(["--max-restarts", "3", "--force", "--restart_backoff=0.5"]) == (
        Restarts(3, 0.5), ["--force"])
    assert take_restart_flags([]) == (Restarts(0, 10.0), [])
    for bad, message in [(["--max-restarts", "x"], "not an integer"), (["--max-restarts", "-1"], "0 or more"),
                         (["--restart-backoff", "soon"], "expected seconds"), (["--max-restarts"], "expected a value")]:
        with pytest.raises(UsageError, match=message):
            take_restart_flags(bad)
    local = launch_cmd.split_local_args
    none = {"port": None, "addr": None}
    assert local(["--profile", "cpu"]) == (Restarts(), none, ["--profile", "cpu"])  # today's `-n N FLAGS`
    assert local(["--", "--profile", "cpu"]) == (Restarts(), none, ["--profile", "cpu"])
    assert local(["--max-restarts", "3", "--", "--profile", "cpu"]) == (Restarts(3, 10.0), none, ["--profile", "cpu"])
    assert local(["--max-restarts=2", "--profile", "cpu"]) == (Restarts(2, 10.0), none, ["--profile", "cpu"])
    assert local(["--master_port", "29600", "--max-restarts=2", "--master-addr=127.0.0.1", "--profile", "cpu"]) == (
        Restarts(2, 10.0), {"port": 29600, "addr": "127.0.0.1"}, ["--profile", "cpu"])
    with pytest.raises(UsageError, match="--max-restarts: a launch flag, not a train flag: put it before"):
        local(["--profile", "cpu", "--max-restarts", "3"])
    with pytest.raises(UsageError, match="--master_port: a launch flag, not a train flag: put it before"):
        local(["--profile", "cpu", "--master_port", "29600"])
    with pytest.raises(UsageError, match="--master_port '1.5': not a whole number"):
        local(["--master_port", "1.5", "--profile", "cpu"])
    with pytest.raises(UsageError, match="before -- only --master_port, --master_addr, --max-restarts and"
                                         " --restart-backoff, got '--profile'"):
        local(["--profile", "cpu", "--", "--model", "debug"])
    assert with_resume_auto(["--data", "m", "--resume", "never", "--resume=x"]) == ["--data", "m", "--resume", "auto"]


# -- the loop, on a fake runner ----------------------------------------------------------------------------

FAKE_RUNNER = r'''
import json, os, sys
from pathlib import Path
log = Path(os.environ["FAKE_LOG"])
calls = json.loads(log.read_text()) if log.exists() else []
calls.append(sys.argv[1:])
log.write_text(json.dumps(calls))
code = [int(c) for c in os.environ["FAKE_CODES"].split()][len(calls) - 1]
if os.environ.get("FAKE_SEGMENT"):  # rank 0's start: this launch's segment in manifest.json
    from zerotrain.launcher.components import manifest
    manifest.write_or_extend(Path(os.environ["FAKE_SEGMENT"]), run_id="run", config_hash="h", profile="cpu", seed=1,
                             world_size=2, hosts=["a"], resumed_from=None, rank0_only=False)
if code in (0, 2, 3, 6, 11):  # ends rank 0 says itself; a lost rank (247) and a crash (1) leave no file
    Path(os.environ["ZEROTRAIN_EXIT_FILE"]).write_text(f"{code}\n")
sys.exit(1 if code in (3, 6, 11) else code)  # DeepSpeed's launcher exits 1 when a rank exits non-zero
'''


def fake_launch(tmp_path, monkeypatch, codes: str, argv: list[str], run_dir: Path | None = None):
    """launch_main's `-n N` path with DeepSpeed's runner replaced by FAKE_RUNNER: (exit code, runner calls)."""
    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE_RUNNER)
    log = tmp_path / "calls.json"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_CODES", codes)
    monkeypatch.setattr(launch_cmd, "deepspeed_command", lambda n, args, *rendezvous: [sys.executable, str(script), *args])
    monkeypatch.setattr(launch_cmd, "restart_run_dir", lambda args: run_dir)
    with pytest.raises(SystemExit) as end:
        launch_cmd.launch_main(argv)
    return end.value.code, json.loads(log.read_text())


@pytest.mark.launches  # the loop's runner is a fake launcher, started as a process
def test_a_crash_no_rank_recorded_closes_the_jobs_own_segment_only(tmp_path, monkeypatch, mix_path, capsys):
    """Without --max-restarts too: a lost rank (247, no exit file) closes the segment its job wrote, as "crash" with
    the cause (`zerotrain runs`: failed (crashed), not "no end recorded"); an older launch's open segment (this job
    died before writing its own) and a refusal (exit 2) are left as they are."""
    run = tmp_path / "run"
    flags = ["--data", str(mix_path)]
    monkeypatch.setenv("FAKE_SEGMENT", str(run))
    assert fake_launch(tmp_path, monkeypatch, "247", ["-n", "2", "--", *flags], run)[0] == 247
    segment = manifest.read_manifest(run)["segments"][-1]
    assert (segment["end_reason"], segment["end_exit_code"], segment["end_message"]) == (
        "crash", 247, "a rank lost (killed by SIGKILL; exit 247)")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 5.0, "lr": 1e-3, "tokens_seen": 256}) + "\n")
    capsys.readouterr()
    report.runs_main([str(tmp_path)])  # the table, then why each failed run ended
    out = capsys.readouterr().out
    assert "failed (crashed)" in out and "run: a rank lost (killed by SIGKILL; exit 247)" in out
    report.runs_main([str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["end_message"] == "a rank lost (killed by SIGKILL; exit 247)"
    old = tmp_path / "old"
    manifest.write_or_extend(old, run_id="old", config_hash="h", profile="cpu", seed=1, world_size=2, hosts=["a"],
                             resumed_from=None, rank0_only=False)
    m = manifest.read_manifest(old)
    m["segments"][-1]["started"] = "2026-01-01T00:00:00+00:00"
    (old / manifest.MANIFEST).write_text(json.dumps(m))
    before = (old / manifest.MANIFEST).read_bytes()
    monkeypatch.delenv("FAKE_SEGMENT")
    (tmp_path / "calls.json").unlink()
    for codes in ("1", "2"):
        assert fake_launch(tmp_path, monkeypatch, codes, ["-n", "2", "--", *flags], old)[0] == int(codes)
        (tmp_path / "calls.json").unlink()
    assert (old / manifest.MANIFEST).read_bytes() == before


@pytest.mark.launches  # the loop's runner is a fake launcher, started as a process
def test_the_loop_restarts_restartable_ends_with_resume_auto_and_records_them(tmp_path, monkeypatch, mix_path,
                                                                              capsys):
    run = tmp_path / "run"
    manifest.write_or_extend(run, run_id="run", config_hash="h", profile="cpu", seed=1, world_size=2, hosts=["a"],
                             resumed_from=None, rank0_only=False)  # a launch that never recorded its end
    flags = ["--data", str(mix_path), "--resume", "never"]
    code, calls = fake_launch(tmp_path, monkeypatch, "247 11 0", ["-n", "2", "--max-restarts", "3",
                                                                   "--restart-backoff", "0", "--", *flags], run)
    assert code == 0 and calls == [flags, flags[:2] + ["--resume", "auto"], flags[:2] + ["--resume", "auto"]]
    out = capsys.readouterr().out
    assert "zerotrain launch: job ended a rank lost (killed by SIGKILL; exit 247); restart 1 of 3 in 0 s with" \
           " --resume auto" in out
    assert "zerotrain launch: job ended hung (exit 11); restart 2 of 3 in 0 s with --resume auto" in out
    m = manifest.read_manifest(run)
    assert [(r["attempt"], r["kind"], r["exit_code"], r["rank"]) for r in m["restarts"]] == [
        (1, "crash", 247, None), (2, "hung", 11, None)]
    assert m["segments"][0]["end_reason"] == "crash" and m["segments"][0]["end_exit_code"] == 247  # closed for it
    # a new launch of the run keeps the record
    manifest.write_or_extend(run, run_id="run", config_hash="h", profile="cpu", seed=1, world_size=2, hosts=["a"],
                             resumed_from="x", rank0_only=False)
    assert len(manifest.read_manifest(run)["restarts"]) == 2
    # `zerotrain runs` and `report` show them
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_seen": 256}) + "\n")
    report.runs_main([str(tmp_path)])
    assert "after 2 restart(s)" in capsys.readouterr().out
    report.report_main([str(run), "--out", str(tmp_path / "report")])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "restart 1 of 3 after a rank lost (killed by SIGKILL; exit 247) (rank unknown)" in text
    assert "| restarts (`zerotrain launch --max-restarts`) | 2: see Launches |" in text


@pytest.mark.launches
@pytest.mark.parametrize("codes, argv, want_code, want_calls", [
    ("11 11 11", ["--max-restarts", "2", "--restart-backoff", "0", "--"], 11, 3),  # restarts used up
    ("3 0", ["--max-restarts", "2", "--restart-backoff", "0", "--"], 3, 1),  # diverged: never restarted
    ("2 0", ["--max-restarts", "2", "--restart-backoff", "0", "--"], 2, 1),  # bad input found by a rank
    ("6 0", ["--max-restarts", "2", "--restart-backoff", "0", "--"], 6, 1),  # stopped by a signal
    ("1 0", [], 1, 1),  # --max-restarts 0: today's behaviour
])
def test_the_loop_stops_at_final_ends_and_after_max_restarts(tmp_path, monkeypatch, mix_path, capsys, codes, argv,
                                                             want_code, want_calls):
    code, calls = fake_launch(tmp_path, monkeypatch, codes, ["-n", "2", *argv, "--data", str(mix_path)])
    assert (code, len(calls)) == (want_code, want_calls)
    if want_calls == 3:
        assert "job ended hung (exit 11); not restarted: 2 restart(s) used of --max-restarts 2" in \
               capsys.readouterr().out


@pytest.mark.launches
def test_a_signal_during_the_backoff_ends_it_without_a_restart(tmp_path, monkeypatch, mix_path, capsys):
    """SIGTERM to this process once the backoff's own handler is installed (not the job's, which forwards it): the
    backoff of 600 s ends at once (a backoff waited out would run past the 120 s the sender waits)."""

    def in_backoff() -> bool:
        return getattr(signal.getsignal(signal.SIGTERM), "__qualname__", "").startswith("_interrupted_within")

    def terminate_in_backoff():
        deadline = time.monotonic() + 120
        while not in_backoff() and time.monotonic() < deadline:
            time.sleep(0.01)
        if in_backoff():
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate_in_backoff, daemon=True)
    sender.start()
    code, calls = fake_launch(tmp_path, monkeypatch, "11 0", ["-n", "2", "--max-restarts", "1", "--restart-backoff",
                                                              "600", "--", "--data", str(mix_path)])
    sender.join(timeout=10)
    assert (code, len(calls)) == (11, 1)
    assert "stopped by a signal during the backoff; not restarted" in capsys.readouterr().out


@pytest.mark.launches
def test_a_bad_train_flag_is_refused_before_anything_starts(tmp_path, mix_path):
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "-n", "2", "--max-restarts", "3", "--",
                           "--data", str(mix_path), "--out", str(tmp_path), "--max-steps", "zero"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **ENV}, timeout=60)
    assert proc.returncode == 2 and "restart" not in proc.stdout + proc.stderr
    assert proc.stderr.count("zerotrain: error:") == 1 and list(tmp_path.iterdir()) == []


# -- what the launcher sees of its ranks -------------------------------------------------------------------

# The fake launchers below act in steps: before each, they wait for a file the test writes once the watch has seen
# what the step is about (every rank discovered, a rank's end read), so the outcome never depends on how fast this
# host starts a process or schedules the watch's thread. They poll their ranks as DeepSpeed's launch.py does.
STEP = r"""
import os, sys, time
def step(name):  # wait for the test's go-ahead: the file STEPS/name
    path = os.path.join(os.environ["STEPS"], name)
    while not os.path.exists(path):
        time.sleep(0.02)
"""
STEP = f"STEP = {STEP!r}\n" + STEP  # a launcher hands the same helper to the ranks it starts

FAKE_LAUNCH_PY = STEP + r"""
import subprocess
# rank 0 exits 11 when told; rank 1 stops itself (again if continued: only SIGKILL ends it, whenever it lands
# after the watch's SIGCONT): a launch.py that waits for both would wait forever
ranks = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": str(r)})
         for r, code in enumerate([STEP + "step('rank0-exits'); raise SystemExit(11)",
                                   "import os, signal\nwhile True: os.kill(os.getpid(), signal.SIGSTOP)"])]
while any(r.poll() is None for r in ranks):  # as DeepSpeed's launch.py: a poll a second
    time.sleep(1)
print([r.returncode for r in ranks], flush=True)
"""


def start_watched(script: str, steps: Path, *args: str, **watch_kwargs) -> tuple[subprocess.Popen, RankWatch]:
    """A fake launcher (`script`, as DeepSpeed's launch.py: ranks as children with RANK set) under a RankWatch."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "STEPS": str(steps)})
    watch = RankWatch(proc.pid, **watch_kwargs)
    watch.start()
    return proc, watch


def when(condition, steps: Path, name: str, timeout: float = 60) -> None:
    """Once `condition()` holds (the watch has seen something), let the fake launcher take its step `name`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"before step {name}: not within {timeout} s"
        time.sleep(0.02)
    (steps / name).touch()


def finish(proc: subprocess.Popen, watch: RankWatch) -> str:
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        watch.stop()
    return out.strip()


@pytest.mark.launches
def test_rank_watch_names_the_first_rank_to_end_and_kills_stopped_ranks(tmp_path):
    proc, watch = start_watched(FAKE_LAUNCH_PY, tmp_path, interval_s=0.1, discover_s=0.5)
    assert sorted(rank_processes(proc.pid).values()) in ([], [0], [1], [0, 1])  # the launcher's children with RANK
    when(lambda: sorted(watch.ranks.values()) == sorted(rank_processes(proc.pid).values()) == [0, 1], tmp_path,
         "rank0-exits")
    assert finish(proc, watch) == "[11, -9]"  # rank 1 was killed for being stopped
    assert watch.first_exit == RankExit(0, "exit 11", 11) and watch.killed_stopped == [1]


@pytest.mark.launches
def test_without_restarts_a_stopped_rank_is_killed_too(tmp_path):
    """A job without --max-restarts: a rank stopped from outside (SIGSTOP, a debugger) cannot act on launch.py's
    SIGTERM; launch.py alone would SIGKILL it 30 s later (the fake launcher here: never). run_job watches the
    ranks of every job it starts and kills a stopped one once another rank has ended."""
    end, relayed = [], []
    job = threading.Thread(target=lambda: end.append(jobs.run_job(
        [sys.executable, "-c", FAKE_LAUNCH_PY], env={**os.environ, "STEPS": str(tmp_path)}, relay=relayed.append)),
        daemon=True)
    job.start()
    deadline = time.monotonic() + 60
    while sorted(rank_processes(os.getpid()).values()) != [0, 1]:
        assert time.monotonic() < deadline, "the fake launcher's two ranks did not start"
        time.sleep(0.05)
    time.sleep(3)  # the watch's discovery (every 2 s) has seen both ranks
    (tmp_path / "rank0-exits").touch()
    job.join(timeout=60)
    for pid in rank_processes(os.getpid()):  # a failure leaves no stopped rank behind
        os.kill(pid, signal.SIGKILL)
    assert not job.is_alive(), "the stopped rank was left to the launcher (it waits for it forever)"
    assert "".join(relayed).strip().endswith("[11, -9]")  # rank 0 exited 11, rank 1 was killed
    assert end[0].first_exit == RankExit(0, "exit 11", 11)  # the job's cause, named as with restarts


FAKE_LAUNCH_FINISHED_FIRST = STEP + r"""
import subprocess
# rank 1 finishes (exit 0); rank 0 fails after it, as a rank lost after the final save
ranks = [subprocess.Popen([sys.executable, "-c", STEP + f"step('{name}'); raise SystemExit({code})"],
                          env={**os.environ, "RANK": str(r)})
         for r, (name, code) in enumerate([("rank0-fails", 7), ("rank1-finishes", 0)])]
while any(r.poll() is None for r in ranks):  # as DeepSpeed's launch.py: a poll a second
    time.sleep(1)
print([r.returncode for r in ranks], flush=True)
"""


@pytest.mark.launches
def test_rank_watch_names_the_failing_rank_not_one_that_finished_before_it(tmp_path):
    proc, watch = start_watched(FAKE_LAUNCH_FINISHED_FIRST, tmp_path, interval_s=0.1, discover_s=0.5)
    when(lambda: sorted(watch.ranks.values()) == [0, 1], tmp_path, "rank1-finishes")
    rank1 = next(pid for pid, r in watch.ranks.items() if r == 1)
    when(lambda: (stat_fields(rank1) or "Z")[0] in "ZX", tmp_path, "rank0-fails")  # rank 1 has ended
    assert finish(proc, watch) == "[7, 0]"
    assert watch.first_exit == RankExit(0, "exit 7", 7)


FAKE_LAUNCH_REAPS_AT_ONCE = STEP + r"""
import signal, subprocess
# rank 0 is SIGKILLed and reaped at once (before the watch can read its status), rank 1 then fails because of it,
# as a rank lost after the final save and its peer's broken collective (a fresh-clone run of 2026-11-27); rank 2
# finished before both and left its code 0 (rank_ends.report_rank_end)
ends = sys.argv[1]
code = STEP + "step('rank2-finishes'); open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write('0')"
ranks = [subprocess.Popen([sys.executable, "-c", c, ends], env={**os.environ, "RANK": str(r)})
         for r, c in enumerate(["import time; time.sleep(300)", "import time; time.sleep(300)", code])]
ranks[2].wait()
step("rank0-killed")  # the watch has seen rank 2 gone
ranks[0].send_signal(signal.SIGKILL)
ranks[0].wait()  # reaped at once: its status is never read
step("rank1-killed")  # the watch has named rank 0
ranks[1].kill()  # then the rank that fails because of it (its status is read: it stays a zombie a while)
step("rank1-reaped")
ranks[1].wait()
print([r.returncode for r in ranks], flush=True)
"""


@pytest.mark.launches
def test_rank_watch_names_a_rank_reaped_before_it_was_read_when_it_left_no_code(tmp_path):
    """With each rank's own exit code left where the watch can read it (`zerotrain launch` sets ZEROTRAIN_RANK_ENDS),
    a rank reaped before its status was read is a failure unless it left code 0: the first to fail is named,
    not the rank that failed because of it, and not the one that finished before both."""
    ends, steps = tmp_path / "ends", tmp_path / "steps"
    ends.mkdir()
    steps.mkdir()
    proc, watch = start_watched(FAKE_LAUNCH_REAPS_AT_ONCE, steps, str(ends), interval_s=0.1, discover_s=0.3, ends=ends)
    when(lambda: sorted(watch.ranks.values()) == [0, 1, 2], steps, "rank2-finishes")
    rank2 = next(pid for pid, r in watch.ranks.items() if r == 2)
    when(lambda: stat_fields(rank2) is None, steps, "rank0-killed")  # reaped by its launcher, code 0 left
    when(lambda: watch.first_exit is not None, steps, "rank1-killed")
    rank1 = next(pid for pid, r in watch.ranks.items() if r == 1)
    when(lambda: (stat_fields(rank1) or "Z")[0] in "ZX", steps, "rank1-reaped")
    assert finish(proc, watch) == "[-9, -9, 0]"
    assert watch.first_exit == RankExit(0, "ended without leaving its exit code (killed or crashed)", None)


FAKE_LAUNCH_KILL_AND_ERROR = STEP + r"""
import subprocess
# rank 1 SIGKILLs rank 0 and exits 1 at once: both are zombies at the watch's next poll (as a rank killed after
# the final save and its peer's barrier failing, seen together in a fresh-clone run of 2026-11-27)
r0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env={**os.environ, "RANK": "0"})
# (rank 1 exits once rank 0 is a zombie: a SIGKILL is delivered asynchronously, and a poll between rank 1's exit and
# rank 0's death would rightly name rank 1 first: a loaded fresh-clone run of 2026-11-29 saw that)
r1 = subprocess.Popen([sys.executable, "-c", STEP + "step('rank1-kills'); import signal, time; "
                       "os.kill(int(sys.argv[1]), signal.SIGKILL); t = time.time()\n"
                       "while time.time() - t < 10 and open(f'/proc/{sys.argv[1]}/stat').read().rsplit(')', 1)[1]"
                       ".split()[0] != 'Z': time.sleep(0.005)\n"
                       "os._exit(1)", str(r0.pid)],
                      env={**os.environ, "RANK": "1"})
step("reap")  # both stay zombies until the watch has named one (DeepSpeed's launch.py polls each second)
print([r0.wait(), r1.wait()], flush=True)
"""


@pytest.mark.launches
def test_rank_watch_names_the_killed_rank_when_its_peer_fails_in_the_same_interval(tmp_path):
    proc, watch = start_watched(FAKE_LAUNCH_KILL_AND_ERROR, tmp_path, interval_s=0.2, discover_s=0.3)
    when(lambda: sorted(watch.ranks.values()) == [0, 1], tmp_path, "rank1-kills")
    when(lambda: watch.first_exit is not None, tmp_path, "reap")
    assert finish(proc, watch) == "[-9, 1]"
    assert watch.first_exit == RankExit(0, "killed by SIGKILL", None)


def zombie(status: int) -> list[str]:
    """/proc/PID/stat's fields after the name for a zombie whose wait status is `status` (index 49)."""
    return ["Z"] + ["0"] * 48 + [str(status)]


def polled(ends: Path, ranks: dict[int, int]) -> RankWatch:
    """A watch that knows `ranks` (pid -> rank; no /proc walk), after one poll."""
    watch = RankWatch(root=1, ends=ends)
    watch._discovered_at = float("inf")
    watch.ranks = ranks
    watch.poll()
    return watch


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_rank_watch_names_the_reaped_rank_before_a_peer_its_launcher_killed_in_the_same_interval(
        tmp_path, monkeypatch, order):
    """No process: one poll that finds rank 1 already reaped by its launcher without leaving its exit code (it was
    SIGKILLed) and rank 0 a zombie of a SIGTERM (DeepSpeed's launch.py tears the job down only after reaping a
    failed rank). Rank 1 is named whatever the order the watch knows them in; before the fix rank 0 was (the tie
    went to the lower rank: a fresh-clone run recorded the first restart as rank 0's)."""
    from zerotrain.launcher.components.launching import restarts

    stats = {100: zombie(signal.SIGTERM), 101: None}  # pid 100 rank 0 (a zombie), pid 101 rank 1 (reaped)
    monkeypatch.setattr(restarts, "stat_fields", stats.get)
    # nothing left under ends/: rank 1 ended without its code
    watch = polled(tmp_path, {pid: pid - 100 for pid in (100 + order[0], 100 + order[1])})
    assert watch.first_exit == RankExit(1, "ended without leaving its exit code (killed or crashed)", None)
    # a rank that left its code is still named after one killed by a signal
    (tmp_path / "1").write_text("1")
    assert polled(tmp_path, {100: 0, 101: 1}).first_exit == RankExit(0, "killed by SIGTERM", None)


# -- real ranks: the deepspeed launcher, 2 CPU ranks -------------------------------------------------------

def start(tmp_path, launched, launch_flags, train_flags, env_extra=None) -> subprocess.Popen:
    """`zerotrain launch --hostfile H --no_ssh` on this node (2 slots, a free port)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = free_port()
    cmd = [sys.executable, "-m", "zerotrain", "launch", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0",
           "--master_addr", "127.0.0.1", "--master_port", str(port), *launch_flags, "--", *train_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env={**os.environ, **ENV, **(env_extra or {})})
    launched.append((proc, port))
    return proc


def wait_for(condition, proc, timeout: float, what: str) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the launch ended ({proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def read_until(proc, needle: str, lines: list[str]) -> float:
    """Read the launch's output into `lines` until a line holds `needle`; the time it came."""
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return time.time()
    raise AssertionError(f"{needle!r} never printed:\n{''.join(lines)[-3000:]}")


def rank_pid(proc, rank: int) -> int:
    return next(pid for pid, r in rank_processes(proc.pid).items() if r == rank)


def same_history(run: Path, reference: list[dict]) -> None:
    history = read_metrics(run)
    assert [m["step"] for m in history] == list(range(1, N + 1))
    assert [m["tokens_sha"] for m in history] == [m["tokens_sha"] for m in reference]
    assert [m["loss"] for m in history] == [m["loss"] for m in reference]  # full-precision floats, compared exactly


def raw_records(run: Path) -> list[dict]:
    """metrics.jsonl as written, every launch's lines in order (read_metrics gives the effective history)."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


@pytest.mark.launches
def test_a_killed_rank_then_a_frozen_rank_are_restarted_and_the_run_is_exact(tmp_path, launched, reference_history,
                                                                             mix_path):
    """One launch, --max-restarts 3: rank 1 SIGKILLed after checkpoint K (a lost rank), then, once the restarted
    job is stepping, rank 1 SIGSTOPped (the other rank blocks in a real collective until its watchdog fires,
    --hang-timeout 8), then rank 0 killed after the final save. Three restarts, each announced and recorded, the
    losses of the uninterrupted run, and the last restart finds the run finished: exit 0."""
    run = tmp_path / "runs" / "r"
    t0 = time.time()
    proc = start(tmp_path, launched, ["--max-restarts", "3", "--restart-backoff", "1"],
                 ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "r", *FLAGS,
                  "--eval-tokens", "3000", "--hang-timeout", "8"],  # the shared reference run's held-out slice
                 env_extra={"ZEROTRAIN_TEST_DIE_AFTER_END": "0"})
    wait_for(lambda: (run / "checkpoints" / f"global_step{K}" / "zerotrain.json").is_file(), proc, 180,
             f"checkpoint {K}")
    os.kill(rank_pid(proc, 1), signal.SIGKILL)
    t_kill, lines = time.time(), []
    t_restart1 = read_until(proc, "restart 1 of 3 in 1 s with --resume auto", lines)

    def stepping_again():  # the restarted job has resumed and finished a step: past its start-up
        records = raw_records(run)
        resumed = [i for i, r in enumerate(records) if r.get("event") == "resume"]
        return bool(resumed) and any("loss" in r for r in records[resumed[-1]:])

    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))  # keep the pipe drained meanwhile
    reader.start()
    wait_for(stepping_again, proc, 180, "a step of the restarted job")
    os.kill(rank_pid(proc, 1), signal.SIGSTOP)
    t_stop = time.time()
    wait_for(lambda: "restart 2 of 3" in "".join(lines), proc, 120, "the second restart")
    t_restart2 = time.time()
    proc.wait(timeout=240)
    reader.join(timeout=30)
    text = "".join(lines)
    assert proc.returncode == 0, text[-4000:]
    assert text.count(f"resumed from {run / 'checkpoints'}") == 2
    same_history(run, reference_history)
    # rank 0 SIGKILLed once the last checkpoint was complete (ZEROTRAIN_TEST_DIE_AFTER_END): a lost rank, restarted;
    # the job started again finds the run finished, says so, trains nothing and exits 0 (not 2, bad input)
    assert f"run r is finished: checkpoint {run / 'checkpoints' / f'global_step{N}'} is at --max-steps {N}" in text
    m = manifest.read_manifest(run)
    first, second, third = m["restarts"]
    assert (third["attempt"], third["kind"], third["rank"]) == (3, "crash", 0), third
    assert (m["segments"][-1]["end_reason"], m["segments"][-1]["end_step"]) == ("finished", N)
    assert m["segments"][-1]["from_checkpoint"] == str(run / "checkpoints" / f"global_step{N}")
    assert (first["attempt"], first["kind"], first["rank"]) == (1, "crash", 1)
    # DeepSpeed's launch.py exits with the first failed rank it polls: the killed one (247), or rank 0 if its
    # collective had already failed (1); the launcher saw which rank went first, and how
    assert first["cause"] == f"a rank lost (rank 1 killed by SIGKILL; exit {first['exit_code']})"
    assert (second["attempt"], second["kind"], second["exit_code"], second["rank"]) == (2, "hung", 11, 1)
    assert second["cause"] == "hung (exit 11; rank 1 behind)"
    # the watchdog's report of the freeze: rank 0, blocked in C++ inside a gloo collective, fired; the stopped
    # rank could not dump, and its heartbeat went stale
    (summary_path,) = (run / "hangs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["fired_by"] == 0 and summary["stacks"] == ["rank-0.txt"], summary
    # where rank 0 waits depends on where the SIGSTOP caught rank 1: the step's collective (step_runner.py) or a ZeRO-3
    # gather inside the forward or backward (model.py); either way a frame of ours inside a real collective
    assert summary["where"]["0"]["in_collective"] and \
        summary["where"]["0"]["ours"].split(":")[0] in ("step_runner.py", "model.py"), summary["where"]["0"]
    (late,) = summary["behind"]
    assert late["rank"] == 1 and "stale heartbeat" in late["why"] and late["heartbeat_age_s"] >= 7
    stacks = (summary_path.parent / "rank-0.txt").read_text()
    # a collective call, or (SIGSTOP caught rank 1 inside a ZeRO-3 gather) the wait on the gather's handle
    assert re.search(r"distributed_c10d\.py\", line \d+ in (all_gather|all_reduce|reduce_scatter|broadcast)"
                     r"|partition_parameters\.py\", line \d+ in wait", stacks), stacks
    assert "in _loop" in stacks
    line = next((x for x in text.splitlines() if "zerotrain: error: rank 0 hung in" in x), text[-3000:])
    assert f"behind: rank 1 (step {late['step']}, {late['phase']}" in line and str(summary_path.parent) in line
    # the timeout, a tick, the report, the stopped rank killed 2 s later: ~15 s; a minute more for a loaded host
    # (a watchdog that never fired is caught by the wait for "restart 2 of 3" above)
    assert t_restart2 - t_stop < 8 + 75
    print(f"\nSIGKILL -> restart announced {t_restart1 - t_kill:.1f} s; SIGSTOP (--hang-timeout 8) -> restart"
          f" announced {t_restart2 - t_stop:.1f} s; launch to finish {time.time() - t0:.1f} s")


@pytest.mark.launches
def test_divergence_is_not_restarted(tmp_path, launched, mix_path):
    # the spike detector judges from step 26 (half its window of 50) and wants 3 steps in a row
    proc = start(tmp_path, launched, ["--max-restarts", "1"],
                 ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "r", *FLAGS, "--max-steps",
                  "30", "--on-spike", "stop"], env_extra={"ZEROTRAIN_TEST_SPIKE": "1:27-29:50"})
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == END_KINDS["diverged"].exit_code, out[-3000:]
    assert "zerotrain launch: job ended diverged" in out and "not restarted (diverged: a fresh start would end the" \
        " same way)" in out  # why, said once
    assert "restarts" not in manifest.read_manifest(tmp_path / "runs" / "r")
    # a test hook is never silently active: said at start-up, recorded in the launch's segment
    assert "zerotrain: warning: test hooks active: ZEROTRAIN_TEST_SPIKE=1:27-29:50 (faults" in out
    assert manifest.read_manifest(tmp_path / "runs" / "r")["segments"][-1]["test_hooks"] == {
        "ZEROTRAIN_TEST_SPIKE": "1:27-29:50"}


@pytest.mark.launches
def test_a_sigterm_to_the_launcher_stops_the_job_and_is_not_restarted(tmp_path, launched, mix_path):
    run = tmp_path / "runs" / "r"
    proc = start(tmp_path, launched, ["--max-restarts", "1", "--restart-backoff", "0"],
                 ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "r", *FLAGS, "--max-steps",
                  "400"])
    wait_for(lambda: any(m["step"] >= 2 for m in read_metrics(run)), proc, 180, "step 2")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == END_KINDS["signal"].exit_code, out[-3000:]
    assert "zerotrain launch: job ended" not in out and "restarts" not in manifest.read_manifest(run)
    assert manifest.read_manifest(run)["segments"][-1]["end_reason"] == "signal"


# -- the job dies with its launcher ------------------------------------------------------------------------

@pytest.mark.launches
def test_the_launcher_watch_fires_once_the_launcher_is_gone_or_a_zombie():
    child = subprocess.Popen(["sleep", "60"])
    token = launcher_watch.launcher_token(child.pid)
    assert launcher_watch.alive(token) and not launcher_watch.alive(token[:token.rindex(":")] + ":1")  # pid reused
    assert launcher_watch.watch_launcher(0, {}) is None  # not started by zerotrain launch
    assert launcher_watch.watch_launcher(0, {"ZEROTRAIN_LAUNCHER": "elsewhere:1:1"}) is None  # another node's
    exits = []
    thread = launcher_watch.watch_launcher(1, {"ZEROTRAIN_LAUNCHER": token}, interval_s=0.05,
                                           exit_fn=exits.append)
    time.sleep(0.3)
    assert exits == [] and thread.is_alive()
    child.kill()  # not reaped yet: a zombie is gone too
    thread.join(timeout=5)
    assert exits == [END_KINDS["hard-signal"].exit_code]
    child.wait()


@pytest.mark.launches
def test_a_rank_failing_after_its_launcher_died_leaves_as_the_watch_does(tmp_path, capsys):
    """The CI race: rank 1's watch saw the launcher gone first and left; rank 0 was then SIGTERMed by launch.py
    in its start-up, or its collective lost its peer before its own watch looked. So the first rank of the host
    to see the launcher gone says the one line, whichever it is, and the driver's failure path asks too:
    launcher gone -> leave as the watch does, not with a gloo traceback; launcher alive -> nothing."""
    child = subprocess.Popen(["sleep", "60"])
    env = {"ZEROTRAIN_LAUNCHER": launcher_watch.launcher_token(child.pid), RANK_ENDS: str(tmp_path)}
    exits = []
    launcher_watch.leave_if_launcher_gone(0, env, exit_fn=exits.append)
    launcher_watch.leave_if_launcher_gone(0, {}, exit_fn=exits.append)  # not started by zerotrain launch
    assert exits == [] and capsys.readouterr().err == ""
    child.kill()
    child.wait()
    gone = f"the launcher of this job (pid {child.pid}) is gone"
    launcher_watch.leave_if_launcher_gone(1, env, exit_fn=exits.append)  # rank 1 first: it says it
    assert exits == [END_KINDS["hard-signal"].exit_code] and gone in capsys.readouterr().err
    launcher_watch.leave_if_launcher_gone(0, env, exit_fn=exits.append)  # then rank 0: said already
    assert exits == [END_KINDS["hard-signal"].exit_code] * 2 and capsys.readouterr().err == ""
    no_dir = {"ZEROTRAIN_LAUNCHER": env["ZEROTRAIN_LAUNCHER"]}  # no rank-ends directory: rank 0 says it
    launcher_watch.leave_if_launcher_gone(1, no_dir, exit_fn=exits.append)
    assert capsys.readouterr().err == ""
    launcher_watch.leave_if_launcher_gone(0, no_dir, exit_fn=exits.append)
    assert gone in capsys.readouterr().err and len(exits) == 4


@pytest.mark.launches
def test_a_sigkilled_launcher_takes_its_job_with_it(tmp_path, launched, mix_path):
    """kill -9 of `zerotrain launch` alone (an OOM killer, a cluster agent): the runner, launch.py and the ranks,
    in a session of their own, end within seconds (each rank watches the launcher), not at --max-steps."""
    run = tmp_path / "runs" / "r"
    proc = start(tmp_path, launched, [], ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "r",
                                          *FLAGS, "--max-steps", "400"])
    # both ranks past their start-up (the run directory's manifest is written after the run lock is taken)
    wait_for(lambda: (run / "manifest.json").is_file() and len(rank_processes(proc.pid)) == 2, proc, 180,
             "the ranks' start-up")
    job = os.getpgid(rank_pid(proc, 0))  # the runner's own session: not the launcher's group
    assert job != proc.pid
    os.kill(proc.pid, signal.SIGKILL)  # the launcher only, and left unreaped (a zombie) while its job ends
    t_kill = time.time()

    def job_left() -> list[int]:
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
        return [pid for pid in pids if (f := stat_fields(pid)) is not None and f[0] != "Z" and int(f[2]) == job]

    while job_left() and time.time() - t_kill < 30:
        time.sleep(0.2)
    assert not job_left(), "the job outlived its launcher by 30 s"
    took = time.time() - t_kill
    proc.wait(timeout=10)
    out = proc.stdout.read()
    assert "the launcher of this job (pid" in out and "is gone; every rank exits now" in out, out[-3000:]
    assert "ended" not in manifest.read_manifest(run)["segments"][-1]  # killed, not run to its end
    print(f"\nlauncher SIGKILLed -> its whole job gone in {took:.1f} s")


@pytest.mark.launches
def test_a_rank_out_of_memory_ends_the_job_once_with_its_own_code_and_line(tmp_path, mix_path, launched):
    """Rank 1 runs out of memory (ZEROTRAIN_TEST_OOM: torch.OutOfMemoryError from its loader as it fetches step 3's
    batches) under `zerotrain launch --max-restarts 2`: the job ends once, exit 12 (`oom`), never restarted, with
    one line naming the planned and measured peak and what to change."""
    run_dir = tmp_path / "r"
    proc = start(tmp_path, launched, ["--max-restarts", "2", "--restart-backoff", "0"],
                 ["--data", str(mix_path), "--out", str(tmp_path), "--run-id", "r", *FLAGS],
                 {"ZEROTRAIN_TEST_OOM": "1:3"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == END_KINDS["oom"].exit_code == 12, out[-4000:]
    assert "ZEROTRAIN_TEST_OOM=1:3" in out  # the hook is said at start-up
    # rank 1's stderr line may follow rank 0's progress bar on the same terminal line
    line = next(x for x in out.splitlines() if "zerotrain: error: out of host memory on rank 1" in x)
    assert re.search(r"on rank 1 after step 1: planned peak [\d.]+ GiB of [\d.]+ GiB \(.*\); measured peak [\d.]+ GiB \(peak"
                     r" resident memory of this rank\); change --micro-batch 1 \(the global batch kept with"
                     r" --global-batch-tokens\), or --activation-checkpointing, or --offload all; `zerotrain plan`"
                     r" lists what fits", line), line
    assert "OutOfMemoryError" in line
    assert "restart 1 of 2" not in out and out.count("zerotrain: error: out of host memory") == 1
    assert "zerotrain launch: job ended oom (exit 12" in out and "not restarted (oom: a fresh start would end the same way)" in out
    record = manifest.read_manifest(run_dir)
    assert not record.get("restarts") and len(record["segments"]) == 1  # one attempt
    assert (record["segments"][0]["end_reason"], record["segments"][0]["end_exit_code"]) == ("oom", 12)
    assert max(m["step"] for m in read_metrics(run_dir)) < 3


@pytest.mark.launches
def test_out_of_memory_in_a_world_of_one_records_the_oom_end(tmp_path, mix_path):
    """One process (plain python, as the notebook runs): the end is recorded like any other (manifest.json's kind and
    code), the line is the last on stderr, exit 12."""
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "train", "--data", str(mix_path), "--out", str(tmp_path),
                           "--run-id", "r", *FLAGS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENV, "ZEROTRAIN_TEST_OOM": "0:3"})
    assert proc.returncode == 12, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("zerotrain: error: out of host memory on rank 0 after step")
    segment = manifest.read_manifest(tmp_path / "r")["segments"][-1]
    assert (segment["end_reason"], segment["end_exit_code"]) == ("oom", 12), segment
    assert segment["end_message"].startswith("out of host memory on rank 0 after step")
