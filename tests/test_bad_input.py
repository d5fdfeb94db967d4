"""Bad input: exit status 2, one line naming the input, no traceback, run directory untouched."""
import hashlib
import json
from pathlib import Path

import pytest

from conftest import launch

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def existing_run(tmp_path, mix_path):
    """A run directory that looks lived in; bad invocations must leave it byte-identical."""
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return run


def bad_mix(tmp_path, sources):
    p = tmp_path / "bad_mix.json"
    p.write_text(json.dumps({"sources": sources}))
    return str(p)


CASES = {
    "unknown profile": (lambda t, m: ["--profile", "tpu-v9"], "--profile tpu-v9: unknown profile"),
    "unknown preset": (lambda t, m: ["--model", "enormous"], "--model enormous: unknown model preset"),
    "seq-len 0": (lambda t, m: ["--seq-len", "0"], "--seq-len: must be a positive integer"),
    "malformed profile": (lambda t, m: ["--profile", str(_write(t / "p.json", '{"zero_optimization": '))],
                          "invalid JSON"),
    "malformed mix": (lambda t, m: ["--data", str(_write(t / "m.json", "{sources: ["))], "invalid JSON"),
    "malformed recipe": (lambda t, m: ["--config", str(_write(t / "r.json", '{"lr": }'))], "recipe"),
    "unknown recipe key": (lambda t, m: ["--config", str(_write(t / "r.json", '{"learning_rate": 1}'))],
                           "unknown key 'learning_rate'"),
    "missing data file": (lambda t, m: ["--data", bad_mix(t, [{"name": "x", "path": "nope.jsonl", "weight": 1}])],
                          "does not exist"),
    "zero weight": (lambda t, m: ["--data", bad_mix(t, [{"name": "x", "path": str(m.parent / "prose.jsonl"),
                                                         "weight": 0}])], "weight must be a positive number"),
    "negative weight": (lambda t, m: ["--data", bad_mix(t, [{"name": "x", "path": str(m.parent / "prose.jsonl"),
                                                             "weight": -0.5}])], "weight must be a positive number"),
    "missing text field": (lambda t, m: ["--data", bad_mix(t, [{"name": "x", "path": str(m.parent / "prose.jsonl"),
                                                                "weight": 1, "text_field": "body"}])],
                           "has no field 'body'"),
    "inconsistent batch": (lambda t, m: ["--profile", str(_write(t / "b.json", json.dumps(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 7})))],
        "inconsistent batch"),
    "warmup tokens and steps": (lambda t, m: ["--warmup-tokens", "1000", "--warmup-steps", "2"],
                                "--warmup-tokens and --warmup-steps: give one, the other is derived"),
    # the flash kernel needs CUDA; refused before the model is built or anything written
    "varlen on a CPU": (lambda t, m: ["--attention", "varlen"],
                        "--attention varlen: varlen runs PyTorch's flash kernels, CUDA only; this run is on cpu"),
}


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line(case, tmp_path, mix_path, existing_run):
    make_args, expected = CASES[case]
    before = snapshot(existing_run.parent)
    args = ["--data", str(mix_path), "--out", str(existing_run.parent), "--run-id", "r1", "--max-steps", "2"]
    proc = launch("python", args + make_args(tmp_path, mix_path))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("zerotrain: error:"), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(existing_run.parent) == before
