"""The real driver under the real launchers: 2 CPU ranks with gloo. Training, saving and resuming at ZeRO-2 and
ZeRO-3 under `deepspeed` are in tests/test_resume_exact.py (whose launches also check that the driver trains); two
loopback nodes (DeepSpeed's multi-node launcher from a hostfile, and accelerate's 2-node configs) are in
tests/test_sequence_parallel_surfaces.py."""
import re

import pytest

from conftest import REPO, launch, read_metrics

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

COMMON = ["--model", "debug", "--seq-len", "128", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "1"]


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
