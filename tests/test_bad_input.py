"""Bad input: exit status 2, one line naming the input, no traceback, run directory untouched.

Every case is refused by `plan_run` (what the driver runs before it builds or writes anything) with a UsageError
(a DataError is one) of one line, in-process; two of them, a flag's and a data source's, through the real
driver too, for its exit status 2, its one `zerotrain: error:` line and the absence of a traceback."""
import hashlib
import json
from pathlib import Path

import pytest

from conftest import launch
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.run_plan import plan_run


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


def argv(existing_run, tmp_path, mix_path, case) -> list[str]:
    make_args, _ = CASES[case]
    return ["--data", str(mix_path), "--out", str(existing_run.parent), "--run-id", "r1", "--max-steps", "2",
            *make_args(tmp_path, mix_path)]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line_before_anything_is_written(case, tmp_path, mix_path, existing_run):
    before = snapshot(existing_run.parent)
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv(existing_run, tmp_path, mix_path, case)), world=1)
    assert CASES[case][1] in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert snapshot(existing_run.parent) == before


@pytest.mark.launches
@pytest.mark.parametrize("case", ["unknown profile", "missing text field"])  # a flag's error, a data source's
def test_bad_input_exits_2_with_one_line(case, tmp_path, mix_path, existing_run):
    before = snapshot(existing_run.parent)
    proc = launch("python", argv(existing_run, tmp_path, mix_path, case))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("zerotrain: error:"), proc.stderr
    assert CASES[case][1] in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(existing_run.parent) == before
