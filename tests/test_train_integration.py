"""The real driver under the real launchers: 2 CPU ranks with gloo, ZeRO-2 and ZeRO-3."""
import json
import re

import pytest

from conftest import REPO, cpu_profile, launch, read_metrics

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

COMMON = ["--model", "debug", "--seq-len", "128", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "1"]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_two_ranks_train_save_and_resume(stage, tmp_path, mix_path):
    out = tmp_path / "runs"
    args = ["--profile", cpu_profile(tmp_path, stage=stage), "--data", str(mix_path), "--out", str(out),
            "--run-id", "r", *COMMON, "--save-every-steps", "3"]
    first = launch("deepspeed", args + ["--max-steps", "6"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run = out / "r"
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    losses = [m["loss"] for m in metrics]
    assert all(map(lambda x: x == x and x < 20, losses))  # finite
    assert losses[-1] < losses[0] - 0.3, losses
    assert metrics[0]["lr"] == pytest.approx(3e-3)  # warmup of 1 step: step 1 already at peak
    assert metrics[-1]["tokens_seen"] == 6 * 4 * 2 * 128
    ds_config = json.loads((run / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == stage and ds_config["train_batch_size"] == 8
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
    for step in (3, 6):
        tag = run / "checkpoints" / f"global_step{step}"
        assert (tag / "zerotrain.json").is_file() and any(tag.glob("*optim_states.pt"))

    second = launch("deepspeed", args + ["--max-steps", "8", "--resume", "auto"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(r"resumed from .*global_step6 at step 6", second.stdout)
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["tokens_seen"] == 8 * 4 * 2 * 128
    assert (run / "checkpoints" / "global_step8" / "zerotrain.json").is_file()


def test_resume_with_changed_config_is_refused(tmp_path, mix_path):
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *COMMON, "--max-steps", "2"]
    assert launch("python", args).returncode == 0
    before = (out / "r" / "metrics.jsonl").read_text()
    proc = launch("python", args + ["--max-steps", "4", "--lr", "1e-3"])
    assert proc.returncode == 2 and "config drift" in proc.stderr and "lr 0.003 -> 0.001" in proc.stderr
    assert (out / "r" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_other_launchers_start_the_same_driver(launcher, tmp_path, mix_path):
    """Module form (`torchrun -m`, `accelerate launch -m`: what a wheel install has), started from a user's
    project directory whose own `modeling/` and `launcher/` packages must not shadow ours."""
    out = tmp_path / "runs"
    project = tmp_path / "userproj"
    for pkg in ("modeling", "launcher", "dataio"):
        (project / pkg).mkdir(parents=True)
        (project / pkg / "__init__.py").write_text("raise ImportError('the user\'s own package was imported')\n")
    (project / "modeling" / "model.py").write_text("class Unrelated: pass\n")
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", *COMMON, "--max-steps", "2"]
    if launcher == "accelerate":
        import subprocess
        import sys
        from pathlib import Path

        from conftest import TRAIN_MODULE

        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(REPO / "launcher" / "accelerate" / "cpu-2proc.yaml"), "-m", TRAIN_MODULE, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=project,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    else:
        proc = launch(launcher, args, module=True, cwd=project)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 2" in proc.stdout
    assert [m["step"] for m in read_metrics(out / "r")] == [1, 2]
    assert (out / "r" / "checkpoints" / "global_step2" / "zerotrain.json").is_file()


def test_two_nodes_from_a_hostfile_on_loopback(tmp_path, mix_path):
    """DeepSpeed's multi-node launcher: a 2-node hostfile, each node started with --no_ssh --node_rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import TRAIN_PY, free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out, port = tmp_path / "runs", str(free_port())
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "mn", *COMMON, "--max-steps", "2"]
    nodes = [subprocess.Popen([str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
                               "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port,
                               str(TRAIN_PY), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert json.loads((out / "mn" / "config.json").read_text())["world_size"] == 2
    assert [m["step"] for m in read_metrics(out / "mn")] == [1, 2]
    assert (out / "mn" / "checkpoints" / "global_step2" / "zerotrain.json").is_file()


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, mix_path):
    out = tmp_path / "runs"
    # An absurd learning rate blows the weights up after the first update, so step 2's loss is NaN.
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "r", "--seq-len", "64", "--micro-batch", "2",
            "--lr", "1e12", "--min-lr", "0", "--warmup-steps", "0", "--max-steps", "6", "--save-every-steps", "1"]
    proc = launch("python", args)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"step 2: loss is (nan|inf); stopping\. Last checkpoint: .*global_step1", proc.stderr)
    assert [m["step"] for m in read_metrics(out / "r")] == [1]
    tags = sorted(p.name for p in (out / "r" / "checkpoints").glob("global_step*"))
    assert tags == ["global_step1"]
