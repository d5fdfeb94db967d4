"""ZeRO-Offload under the real `deepspeed` launcher on 2 CPU ranks (gloo), one module-scoped sequence of
launches serving every assertion (the debug model, 6 steps, a save every 3; 10 launches with NVMe). Each run is
killed with kill -9 after its step-3 save, with steps 4-5 logged: those logged steps are the uninterrupted
history a resume must reproduce, so no separate reference run is needed. The kill is deterministic:
ZEROTRAIN_TEST_HANG holds rank 0 on entering the step-6 save, so the run cannot finish first.

- `--offload all` (ZeRO-3: parameters and optimizer in host memory), `--offload optimizer` (ZeRO-2) and
  `--offload all --nvme-path DIR` (ZeRO-3, both swapped through files there): resumed, each reproduces its steps
  bit for bit, ends `finished` with exit 0 and its manifest says so (DeepSpeed can abort in its offload
  teardown: the run's code is decided before), and exports;
- the NVMe run's resume is SIGTERMed after a step under `zerotrain launch`: exit 6, checkpoint saved, and resumed
  again to the end, still bit for bit (without libaio the `--offload all` run takes that round instead; the other
  runs resume once, to the end). Its export is compared tensor for tensor with the once-resumed `--offload all`
  run's: resumed at another step, it must hold the same weights. Until 2026-11-28 it did not (7.5e-9 apart, with
  every loss equal): DeepSpeedCPUAdam restarts its bias correction as std::pow where the uninterrupted run
  multiplies (ds_compat.continue_cpu_adam_bias_correction, and its in-process test at every resume step);
- the killed `--offload optimizer` run, copied, resumed with `--offload none` (offload is not part of the run
  id): the same data order, losses within DeepSpeedCPUAdam's rounding of torch's AdamW;
- copies of the killed `--offload all` and `--offload optimizer` runs resumed by 1 rank (a world-size change
  with offload in host memory: DeepSpeed's universal conversion) end finished;
- the killed runs in host memory went through tests/helpers/offload_memory_harness.py: the planner's host
  memory for the offload rows is checked against the offloaded state the ranks hold (within 20%);
- NVMe: DeepSpeed 0.19.8's load skips the optimizer's own state with the optimizer on NVMe (Adam's step count
  and moments, the learning rates: the resume was not exact), and its zero_to_fp32 cannot read the checkpoint
  (the fp32 partitions are in `offloaded_tensors/`, not in the ZeRO files). zerotrain restores the one
  (checkpointer.load, ds_compat.restore_swapped_optimizer_state) and reads the other
  (ds_compat.swapped_fp32_state_dict): the NVMe run's resumes are exact, and its export equals, tensor for
  tensor, the `--offload all` run's, whose losses it reproduces bit for bit.

The settings themselves (mapping, validation, bad input) are in-process tests in test_offload.py and
test_run_bad_input.py. DeepSpeedCPUAdam and the async I/O op JIT-build once per machine (CI: .ci/run installs
libaio-dev; without libaio the NVMe tests skip).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import BIN, REPO, TRAIN_PY, cpu_profile, free_port, launch, read_metrics
from test_bf16 import remove_shm
from test_long_runs import popen, zerotrain_launch_cmd
from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.errors import UsageError

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

N, SAVE = 6, 3
FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2",
         "--log-data-every-steps", "0", "--max-steps", str(N), "--save-every-steps", str(SAVE)]
ROUNDING = 1e-4  # DeepSpeedCPUAdam against torch's AdamW: the same math, rounded differently
MODES = {"all": 3, "optimizer": 2}  # --offload value -> the ZeRO stage its runs use
HARNESS = REPO / "tests" / "helpers" / "offload_memory_harness.py"


def nvme_possible() -> bool:
    """The async I/O op is built or can be (libaio installed; CI installs it, .ci/run)."""
    try:
        offload.check_libaio({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "--nvme-path")
    except UsageError:
        return False
    return True


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def kill_after_save(args: list[str], run, measured=None) -> list[dict]:
    """Launch, hold rank 0 on entering the step-N save, and once the step-3 checkpoint is complete and steps
    4-5 are logged kill -9 the whole process group; the history it logged. `measured`: a directory, the run
    launched through tests/helpers/offload_memory_harness.py, which writes there each rank's offloaded state."""
    port = free_port()
    entry = [str(HARNESS), str(measured)] if measured else [str(TRAIN_PY)]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), *entry, *args]
    proc = popen(cmd, {"ZEROTRAIN_TEST_HANG": f"0:save:{N}"})
    marker = run / "checkpoints" / f"global_step{SAVE}" / "zerotrain.json"
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if marker.is_file() and any(m["step"] >= N - 1 for m in read_metrics(run)):
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stdout.read()[-3000:]
        assert marker.is_file(), f"no step-{SAVE} checkpoint within 400 s"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        proc.stdout.close()
        remove_shm(port)
    return read_metrics(run)


def sigterm_after_a_step(args: list[str], run) -> tuple[str, dict]:
    """The killed run resumed under `zerotrain launch` (which signals the whole process group, as a scheduler's
    SIGTERM does), SIGTERMed once it logs its first step (step SAVE + 1; the killed run's own lines for steps
    4-5 are in metrics.jsonl before it, so only lines written after the launch count): (its output,
    {"code", "stopped" step})."""
    log = run / "metrics.jsonl"
    before = len(log.read_text().splitlines())
    # each micro-batch's data held 0.5 s (a sleep, the same rows): at ZeRO-2 a step takes tens of ms, and the run
    # would reach --max-steps before the signal is agreed on (seen: stopped at step 6 of 6)
    proc = popen(zerotrain_launch_cmd(args), {"ZEROTRAIN_TEST_SLOW_DATA": "0.5"})
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if any('"loss"' in line and '"event"' not in line for line in log.read_text().splitlines()[before:]):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=300)[0]
    return text, {"code": proc.returncode, "stopped": read_metrics(run)[-1]["step"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mix_path):
    tmp = tmp_path_factory.mktemp("offload")
    nvme = tmp / "nvme"
    nvme.mkdir()
    out, seconds = {"nvme_dir": nvme}, {}
    sequences = [("all", 3, ()), ("optimizer", 2, ())]
    if nvme_possible():
        sequences.append(("nvme", 3, ("--nvme-path", str(nvme))))
    # the SIGTERM round: NVMe's (its export, resumed at another step than --offload all's, is compared with it)
    out["sigterm_on"] = "nvme" if len(sequences) == 3 else "all"
    # DeepSpeed JIT-builds CPU Adam (~2 min) and the async I/O op (~3-5 min on 2 cores) on first use, once per
    # machine and install: built here, before any launch, so the kill below never lands inside a build (a
    # build killed holds torch's extension lock file, and every later launch waits on it)
    ops = ["CPUAdamBuilder", *(["AsyncIOBuilder"] if len(sequences) == 3 else [])]
    built = subprocess.run([sys.executable, "-c", "from deepspeed.ops import op_builder as b; "
                            + "; ".join(f"b.{op}().load()" for op in ops)], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    for name, stage, extra in sequences:
        t0 = time.time()
        mode = "optimizer" if name == "optimizer" else "all"
        profile = cpu_profile(tmp, stage=stage)

        def args(where, *more, profile=profile, mode=mode, extra=extra):
            return ["--profile", profile, "--data", str(mix_path), "--out", str(tmp / where), "--run-id", "r", *FLAGS,
                    "--offload", mode, *extra, *more]

        r = out[name] = {"run": tmp / name / "r"}
        measured = tmp / "measured" / name if name != "nvme" else None  # each rank's offloaded state, step 1
        if measured:
            measured.mkdir(parents=True)
            r["measured"] = measured
        r["before_kill"] = kill_after_save(args(name), r["run"], measured)
        if name == "optimizer":  # the killed run copied, to be resumed without offload too
            shutil.copytree(tmp / name, tmp / "plain")
        copy = {"all": "one-rank", "optimizer": "one-rank-z2"}.get(name)  # the killed run, to resume on 1 rank
        if copy:
            shutil.copytree(tmp / name, tmp / copy)
        if name == out["sigterm_on"]:  # resumed with SIGTERM after a step, then again to the end
            r["stdout"], r["sigterm"] = sigterm_after_a_step(args(name), r["run"])
            r["final_stdout"] = ok(launch("deepspeed", args(name))).stdout
        else:  # resumed to the end
            r["stdout"] = r["final_stdout"] = ok(launch("deepspeed", args(name))).stdout
        if copy:
            out[copy] = {"run": tmp / copy / "r", "proc": launch("deepspeed", args(copy), nproc=1)}
        if name == "optimizer":  # the copy, with --offload none (the last --offload wins)
            out["plain"] = {"run": tmp / "plain" / "r", "before_kill": r["before_kill"],
                            "stdout": ok(launch("deepspeed", args("plain", "--offload", "none"))).stdout}
        seconds[name] = round(time.time() - t0)
    out["seconds"] = seconds
    print(f"offload launches (s): {seconds}")
    return out


def resumed_same(r) -> None:
    """Resumed at step 3, steps 1..6 logged, and the steps logged before the kill reproduced bit for bit."""
    assert f"resumed from {r['run'] / 'checkpoints' / f'global_step{SAVE}'} at step {SAVE}" in r["stdout"]
    history, before = read_metrics(r["run"]), r["before_kill"]
    assert [m["step"] for m in history] == list(range(1, N + 1)) and len(before) >= N - 1
    assert [m["tokens_sha"] for m in history[:len(before)]] == [m["tokens_sha"] for m in before]
    assert [m["loss"] for m in history[:len(before)]] == [m["loss"] for m in before]  # full-precision floats


def zero_section(run) -> dict:
    return json.loads((run / "ds_config.json").read_text())["zero_optimization"]


def test_offloaded_runs_end_finished_with_exit_0_and_their_manifest_says_so(runs):
    for name in ("all", "optimizer"):
        r = runs[name]
        manifest = json.loads((r["run"] / "manifest.json").read_text())
        assert manifest["segments"][-1]["end_reason"] == "finished", name
        assert manifest["segments"][-1]["end_exit_code"] == 0, name
        assert "return code = -6" not in r["final_stdout"]  # no rank aborted on the way out
        history = read_metrics(r["run"])
        assert history[-1]["loss"] < history[0]["loss"]
    assert zero_section(runs["all"]["run"])["offload_param"]["device"] == "cpu"
    assert zero_section(runs["all"]["run"])["offload_optimizer"]["device"] == "cpu"
    assert zero_section(runs["optimizer"]["run"])["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in zero_section(runs["optimizer"]["run"])
    assert "offload (ZeRO-Offload): optimizer states and fp32 master weights -> host memory; parameters -> host" \
           " memory" in runs["all"]["stdout"]


def test_kill_9_after_a_save_resumes_bit_identically_with_offload_all_and_optimizer(runs):
    for name in ("all", "optimizer"):
        resumed_same(runs[name])


def test_a_resume_without_offload_keeps_the_data_order_and_the_losses_within_rounding(runs):
    r = runs["plain"]
    assert f"at step {SAVE}" in r["stdout"]
    assert "offload_optimizer" not in zero_section(r["run"])
    history, before = read_metrics(r["run"]), r["before_kill"]
    assert [m["step"] for m in history] == list(range(1, N + 1))
    assert [m["tokens_sha"] for m in history[:len(before)]] == [m["tokens_sha"] for m in before]  # the same data
    assert [m["loss"] for m in history[:SAVE]] == [m["loss"] for m in before[:SAVE]]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(history[SAVE:], before[SAVE:])]
    assert diffs and max(diffs) < ROUNDING, diffs


def nvme_run(runs) -> dict:
    if "nvme" not in runs:
        pytest.skip("libaio is not installed (apt-get install libaio-dev): DeepSpeed's async_io op cannot build")
    return runs["nvme"]


def test_offload_all_to_nvme_trains_swaps_saves_and_resumes(runs):
    r = nvme_run(runs)
    assert f"resumed from {r['run'] / 'checkpoints' / f'global_step{SAVE}'} at step {SAVE}" in r["stdout"]
    assert "parameters -> nvme" in r["stdout"] and "warning: resuming" not in r["stdout"]
    assert any(runs["nvme_dir"].rglob("*.swp")), "nothing was swapped to --nvme-path"
    assert (r["run"] / "checkpoints" / f"global_step{SAVE}" / "offloaded_tensors").is_dir()
    zero = zero_section(r["run"])
    for section in ("offload_param", "offload_optimizer"):
        assert zero[section]["device"] == "nvme" and zero[section]["nvme_path"] == str(runs["nvme_dir"])
    manifest = json.loads((r["run"] / "manifest.json").read_text())
    assert (manifest["segments"][-1]["end_reason"], manifest["segments"][-1]["end_exit_code"]) == ("finished", 0)
    history = read_metrics(r["run"])
    assert [m["step"] for m in history] == list(range(1, N + 1))
    assert history[SAVE]["loss"] == r["before_kill"][SAVE]["loss"]  # the first step after the resume: exact


def test_offload_all_to_nvme_kill_9_resumes_bit_identically(runs):
    """DeepSpeed 0.19.8's load skips the optimizer's own state with the optimizer on NVMe (Adam's step count and
    moments restarted: the second step after the resume was off, loss 4.23 against 3.91); checkpointer.load
    restores it (ds_compat.restore_swapped_optimizer_state), and the resume is exact."""
    resumed_same(nvme_run(runs))


def test_export_reads_offloaded_checkpoints(runs, tmp_path):
    from zerotrain.launcher.cli import main as cli

    for name in ("all", "optimizer"):  # ZeRO-3 with parameters offloaded, ZeRO-2 with the optimizer offloaded
        cli(["export", str(runs[name]["run"]), "--to", str(tmp_path / name)])
        assert (tmp_path / name / "model.safetensors").is_file(), name


def test_export_of_an_nvme_offloaded_checkpoint_is_the_weights_the_run_trained(runs, tmp_path, capsys):
    """DeepSpeed 0.19.8's zero_to_fp32 cannot read an NVMe checkpoint: its ZeRO files hold empty fp32 partitions
    (it raised "consumed 869504 numels out of 0"), the values being in offloaded_tensors/. zerotrain export reads
    them from there (ds_compat.swapped_fp32_state_dict), and its own check against the model passes. The weights
    are those the run trained: the NVMe run and the --offload all run (host memory, the same ZeRO-3 partitions,
    seed, data and CPU Adam; both resumed exactly, the NVMe run once more after its SIGTERM, at another step) log
    the same losses bit for bit, and their last checkpoints export to equal tensors. A partition read from the
    wrong file, offset or rank would differ, and so would CPU Adam's bias correction restarted at the second
    resume without ds_compat.continue_cpu_adam_bias_correction (7.5e-9 apart, 2026-11-28)."""
    from safetensors.torch import load_file

    from zerotrain.launcher.cli import main as cli

    nvme, host = nvme_run(runs)["run"], runs["all"]["run"]
    assert [m["loss"] for m in read_metrics(nvme)] == [m["loss"] for m in read_metrics(host)]
    for name, run in (("nvme", nvme), ("host", host)):
        cli(["export", str(run), "--to", str(tmp_path / name)])
        said = capsys.readouterr().out
        assert f"exported {run / 'checkpoints' / f'global_step{N}'}" in said
        assert "(within the float32 tolerance" in said  # the export's own check against the model
    exported, expected = (load_file(tmp_path / name / "model.safetensors") for name in ("nvme", "host"))
    assert exported.keys() == expected.keys() and len(exported) > 2
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


def test_export_of_an_nvme_checkpoint_without_its_swap_file_is_refused_in_one_line(runs, tmp_path, capsys):
    """A swapped fp32 partition whose file is gone: exit 2, one line naming the file, nothing written. (A
    checkpoint's marker lists every file under it, offloaded_tensors/ included, so `verify` refuses such a
    checkpoint first; here the marker is one written before files were recorded, which verify accepts.)"""
    from zerotrain.launcher.cli import main as cli

    run = tmp_path / "r"
    shutil.copytree(nvme_run(runs)["run"], run)
    tag = run / "checkpoints" / f"global_step{SAVE}"
    marker = json.loads((tag / "zerotrain.json").read_text())
    marker.pop("files")
    (tag / "zerotrain.json").write_text(json.dumps(marker))
    swapped = sorted((tag / "offloaded_tensors" / "rank01").glob("*_*.tensor.swp"))
    swapped = [f for f in swapped if "-" not in f.name]  # the fp32 partition's file, not its moments'
    assert len(swapped) == 1
    swapped[0].unlink()
    with pytest.raises(SystemExit) as ended:
        cli(["export", str(tag), "--to", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert f"rank 1's fp32 partition 0" in err[0] and f"{swapped[0]} is missing or shorter" in err[0]
    assert not (tmp_path / "out").exists()


def test_sigterm_with_offload_stops_saves_and_resumes_exactly(runs):
    """The resumed --offload all --nvme-path run (parameters and optimizer swapped through files; without libaio
    the --offload all run, in host memory), SIGTERMed after a step under `zerotrain launch`: exit 6 with a
    checkpoint at the step it stopped at; resumed, its history is the killed run's bit for bit (resumed_same)
    and it ends finished."""
    r = runs[runs["sigterm_on"]]
    stopped = r["sigterm"]["stopped"]
    assert r["sigterm"]["code"] == 6, r["stdout"][-3000:]  # stopped by a signal, checkpoint saved
    assert SAVE < stopped < N and "Traceback" not in r["stdout"]
    assert (r["run"] / "checkpoints" / f"global_step{stopped}" / "zerotrain.json").is_file()
    assert f"resumed from {r['run'] / 'checkpoints' / f'global_step{stopped}'} at step {stopped}" in r["final_stdout"]
    resumed_same(r)
    manifest = json.loads((r["run"] / "manifest.json").read_text())
    assert [(s.get("end_reason"), s.get("end_exit_code")) for s in manifest["segments"]][-2:] == [("signal", 6),
                                                                                                  ("finished", 0)]


def test_the_planners_host_memory_is_the_offloaded_state_measured_within_20_percent(runs):
    """The planner's host memory per node for the offload rows (launcher/planning `host_memory`, its
    offloaded state: without the ranks' own memory) against what the 2-rank runs hold: the bytes of the tensors
    DeepSpeed's offloaded ZeRO optimizer keeps on the host after the first step, summed over both ranks
    (tests/helpers/offload_memory_harness.py, ds_compat.offloaded_state_bytes: fp32 master partitions, Adam's
    moments, gradient buffers, offloaded parameter partitions, staging buffers). On the CPU accelerator these
    live in the same RAM as everything else: this checks the planner's accounting of DeepSpeed's offload
    structures, not memory saved on a device."""
    from zerotrain.dataio.sources.tokenizer import load_tokenizer
    from zerotrain.launcher import planning as planner
    from zerotrain.modeling.sizes import count_params, preset

    args = preset("debug", vocab_size=load_tokenizer("bytes").vocab_size)
    for name, row in (("all", "zero3_offload"), ("optimizer", "zero2_offload")):
        ranks = [json.loads((runs[name]["measured"] / f"offload-rank{r}.json").read_text()) for r in (0, 1)]
        assert {m["params"] for m in ranks} == {count_params(args)["total"]}  # the planner's model is the run's
        ds = json.loads((runs[name]["run"] / "ds_config.json").read_text())
        setup = planner.setup_from(ds, {"hardware": {"accelerator": "cpu"}}, world=2, nodes=1, device_bytes=2**30)
        assert planner.stage_key(ds) == row
        predicted = planner.host_memory(args, setup, row, ds["gradient_accumulation_steps"])
        measured = sum(sum(m["bytes"].values()) for m in ranks)
        print(f"{name}: measured {measured:,} B over 2 ranks {[m['bytes'] for m in ranks]}, planned"
              f" {predicted.state:,.0f} B")
        assert predicted.state == pytest.approx(measured, rel=0.20), name
        for part in ("optimizer", "gradients", "parameters"):  # and component by component
            assert getattr(predicted, part) == pytest.approx(sum(m["bytes"][part] for m in ranks), rel=0.20, abs=1), part


@pytest.mark.parametrize("copy,moved", [("one-rank", "parameters -> host memory"),
                                        ("one-rank-z2", "optimizer states and fp32 master weights -> host memory")])
def test_a_world_size_change_with_offload_in_host_memory_resumes(runs, copy, moved):
    """The killed --offload all run's (ZeRO-3) and --offload optimizer run's (ZeRO-2) step-3 checkpoints (saved by
    2 ranks), copied, resumed by 1 rank, offload kept: DeepSpeed's universal conversion carries the offloaded
    ZeRO state (host memory; NVMe is refused in one line, launcher/resize/universal.py check_supported),
    and each run ends finished at step N."""
    r = runs[copy]
    out = r["proc"].stdout
    assert r["proc"].returncode == 0, out[-3000:] + r["proc"].stderr[-3000:]
    tag = r["run"] / "checkpoints" / f"global_step{SAVE}"
    assert f"converted {tag} (saved by 2 rank(s)) to a universal checkpoint for 1 rank(s)" in out
    assert moved in out
    history = read_metrics(r["run"])
    assert [m["step"] for m in history] == list(range(1, N + 1))
    assert history[-1]["loss"] < history[0]["loss"]
    manifest = json.loads((r["run"] / "manifest.json").read_text())
    assert (manifest["segments"][-1]["end_reason"], manifest["segments"][-1]["end_exit_code"]) == ("finished", 0)
    assert manifest["segments"][-1]["world_size"] == 1


def test_a_resumed_cpu_adam_continues_the_uninterrupted_runs_bias_correction():
    """DeepSpeedCPUAdam's C++ optimizer multiplies beta1**t and beta2**t by beta once a step, and a new one (a
    resume) takes std::pow(beta, t) at its first step: in the last bit apart at some steps (after 5 steps here;
    seen as the 6-step runs' exports 7.5e-9 apart with every loss equal). checkpointer.load brings the C++ state
    to the uninterrupted run's (ds_compat.continue_cpu_adam_bias_correction): the resumed updates are that run's
    bit for bit, at every step a run can resume from."""
    import copy

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from zerotrain.launcher.components import ds_compat

    torch.manual_seed(0)
    start, grads = torch.randn(4096), [torch.randn(4096) for _ in range(8)]
    hp = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def adam(weights):
        p = torch.nn.Parameter(weights.clone())
        return p, DeepSpeedCPUAdam([p], **hp)

    def steps(p, opt, gs):
        for g in gs:
            p.grad = g.clone()
            opt.step()

    whole, opt = adam(start)
    steps(whole, opt, grads)
    differed = []
    for s in range(1, len(grads)):
        p, opt = adam(start)
        steps(p, opt, grads[:s])
        saved, weights = opt.state_dict(), p.detach().clone()
        for fix in (False, True):
            q, resumed = adam(weights)
            resumed.load_state_dict(copy.deepcopy(saved))  # its moments are stepped in place
            if fix:
                assert ds_compat.continue_cpu_adam_bias_correction(resumed) == s
            steps(q, resumed, grads[s:])
            if fix:
                assert torch.equal(q, whole), s
            else:
                differed.append(not torch.equal(q, whole))
    assert any(differed), "no resume step where DeepSpeed's own restart differs: the test shows nothing here"
    assert ds_compat.continue_cpu_adam_bias_correction(torch.optim.AdamW([torch.nn.Parameter(start)])) == 0
