"""Bad input of the long-run flags: refused by `plan_run` before anything is built or
written, with one line naming the flag; the run directory stays byte-identical. In-process
(no launch): the exit status and one-line printing are test_bad_input.py's, for the same path."""
import json
from pathlib import Path

import pytest

from zerotrain.launcher.config_resolve import config_warnings, drift, identity, resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.run_plan import plan_run
from test_bad_input import snapshot


def corrupt_only_checkpoint(run: Path) -> None:
    tag = run / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    (tag / "model_states.pt").write_bytes(b"x" * 100)
    (tag / "zerotrain.json").write_text(json.dumps({
        "step": 2, "tokens_seen": 1, "world_size": 1, "run_id": "r1", "loader_workers": 0,
        "files": {"model_states.pt": {"size": 100, "sha256": "0" * 64}}}))


CASES = {
    "keep-last -1": (["--keep-last", "-1"], "--keep-last: must be a non-negative integer"),
    "keep-best 0": (["--keep-best", "0"], "--keep-best: must be a positive integer, got 0"),
    "keep-best -2": (["--keep-best", "-2"], "--keep-best: must be a positive integer, got -2"),
    "offload all at ZeRO-2": (["--profile", "cpu-zero2", "--offload", "all"], "--offload all: offloads parameters,"
                              " which only ZeRO-3 partitions; this profile is ZeRO-2"),
    "offload bogus": (["--offload", "bogus"], "--offload: must be one of none, optimizer, all, got 'bogus'"),
    "nvme-path missing": (["--offload", "all", "--nvme-path", "{run}/nope"], "/nope: no such directory"),
    "nvme-path a file": (["--offload", "all", "--nvme-path", "{run}/config.json"], "config.json: not a directory"),
    "nvme-path not writable": (["--offload", "all", "--nvme-path", "/proc"], "--nvme-path /proc: not writable"),
    "nvme-path without offload": (["--nvme-path", "{run}"], "offloads nothing without --offload optimizer or all"),
    "client optimizer under offload": (["--profile", "cpu-zero2", "--offload", "optimizer", "--optimizer",
                                        "adamw-decaying-wd"], "--optimizer adamw-decaying-wd: a client optimizer"
                                       " cannot step the offloaded optimizer state"),
    "total tokens not whole": (["--total-tokens", "1.5e0"], "argument --total-tokens: '1.5e0': not a whole number"),
    "save-every-hours 0": (["--save-every-hours", "0"], "--save-every-hours: must be a positive number"),
    "eval without data": (["--eval-every-steps", "10"], "--eval-every-steps 10: no eval data"),
    "budget without price": (["--budget-usd", "100"], "--budget-usd 100.0: needs --gpu-hour-usd"),
    "mirror inside the run": (["--mirror", "{run}/mirror"], "inside the run directory"),
    "out is a file": (["--out", "{run}/config.json"], "exists and is not a directory"),
    "model and depth": (["--model", "small", "--depth", "4"], "give one way to pick the model"),
    "checksums fail, nothing earlier": ([], "no complete checkpoint verifies"),
    "early stop without eval": (["--early-stop-patience", "2"], "needs --eval-every-steps"),
    "unknown spike policy": (["--on-spike", "ignore"], "--on-spike 'ignore'"),
    "total tokens below one step": (["--total-tokens", "10"], "less than one optimizer step"),
    "total tokens 0": (["--total-tokens", "0"], "--total-tokens: must be a positive integer, got 0"),
    "warmup tokens negative": (["--warmup-tokens", "-5"], "--warmup-tokens: must be a positive integer, got -5"),
    "warmup tokens and steps": (["--warmup-tokens", "1000"], "--warmup-tokens and --warmup-steps: give one"),
    "max epochs 0": (["--max-epochs", "0"], "--max-epochs: must be a positive number, got 0.0"),
    "max epochs passed": (["--max-epochs", "0.01"], "--max-epochs 0.01 (flag): this run of"),
    "unknown attention": (["--attention", "flash"],
                          "--attention: must be one of auto, sdpa, flex, varlen, got 'flash'"),
    "varlen in fp32 on a CPU": (["--attention", "varlen"], "--attention varlen: varlen runs PyTorch's flash kernels,"
                                " CUDA only; this run is on cpu (use sdpa or flex)"),
    "flex compiled on a CPU": (["--attention", "flex", "--compile"], "--attention flex with --compile: torch cannot"
                               " compile flex attention with a backward on a CPU"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_long_run_flags_refused_before_anything_is_written(case, tmp_path, mix_path):
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    if case.startswith("checksums"):
        corrupt_only_checkpoint(run)
    extra, expected = CASES[case]
    before = snapshot(run.parent)
    argv = ["--data", str(mix_path), "--out", str(run.parent), "--run-id", "r1", "--max-steps", "50",
            "--warmup-steps", "2"] + [a.replace("{run}", str(run)) for a in extra]
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    assert snapshot(run.parent) == before


def test_warmup_beyond_max_steps_is_a_warning():
    cfg = resolve_config(["--data", "mix.json", "--warmup-steps", "100", "--max-steps", "50"])
    assert any("--warmup-steps 100 >= --max-steps 50" in w for w in config_warnings(cfg))
    assert not config_warnings(resolve_config(["--data", "mix.json", "--warmup-steps", "10"]))



def test_eval_data_that_is_the_training_data_is_a_warning(mix_path):
    again = f"{mix_path.parent}/./{mix_path.name}"
    same = config_warnings(resolve_config(["--data", str(mix_path), "--eval-data", again, "--eval-every-steps", "5"]))
    assert same == [f"--eval-data {again} is the training data itself: val_loss measures documents the run trains"
                    " on (leave --eval-data out to hold documents out of training instead)"]


# -- hostile inputs on the offload, drift and pre-flight surfaces ------------------------------------------------

def test_a_client_optimizer_under_offload_is_refused_before_the_run_directory_exists(tmp_path, mix_path):
    out = tmp_path / "runs"
    argv = ["--data", str(mix_path), "--out", str(out), "--profile", "cpu-zero2", "--offload", "optimizer",
            "--optimizer", "adamw-decaying-wd"]
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    assert str(err.value).startswith("--optimizer adamw-decaying-wd: a client optimizer cannot step the offloaded"
                                     " optimizer state") and "\n" not in str(err.value)
    assert not out.exists()


def test_offload_none_turns_a_profiles_offload_off_nvme_included(tmp_path, mix_path):
    profile = json.loads((Path(__file__).parent.parent / "ds_configs" / "cpu-zero2.json").read_text())
    profile["zerotrain"].update(offload="optimizer", nvme_path=str(tmp_path))
    path = tmp_path / "nvme-profile.json"
    path.write_text(json.dumps(profile))
    argv = ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--profile", str(path), "--max-steps", "2"]
    zero = plan_run(resolve_config(argv + ["--offload", "none"]), world=1).ds_config["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    profile["zerotrain"].pop("offload")  # the profile's NVMe directory alone is the profile's fault, not a flag's
    path.write_text(json.dumps(profile))
    with pytest.raises(UsageError, match=f"profile nvme-profile: zerotrain.nvme_path {tmp_path}: offloads nothing"):
        plan_run(resolve_config(argv), world=1)


@pytest.mark.parametrize("spelled", [["--no-tiled-mlp"], ["--no-qk-norm"], ["--no-compile"], ["--rope-theta", "10000"],
                                     ["--no-tiled-mlp", "--no-compile", "--rope-theta=10000.0"]])
def test_a_value_equal_to_the_resolved_one_is_not_drift(spelled, tmp_path, mix_path):
    from zerotrain.launcher.run_plan import SPELLED_DEFAULTS, identify

    base = ["--data", str(mix_path), "--out", str(tmp_path)]
    bare, given = identify(resolve_config(base)), identify(resolve_config(base + spelled))
    assert given.run_dir == bare.run_dir  # the same run: the same id, resumed, no drift
    assert identity(given.cfg) == identity(bare.cfg)
    assert identify(resolve_config(base + ["--rope-theta", "20000"])).run_dir != bare.run_dir  # a change stays one
    # a run saved with the value spelled out (before this rule), resumed without it: not drift either
    saved = {**bare.cfg.to_dict(), "tiled_mlp": False, "compile": False, "qk_norm": False, "rope_theta": 10000.0}
    resolved = {"tiled_mlp": False, "compile": False, "qk_norm": False, "rope_theta": 10000.0}
    assert set(resolved) == set(SPELLED_DEFAULTS)
    assert drift(bare.cfg, saved, None, resolved) == []
    assert drift(bare.cfg, {**saved, "rope_theta": 20000.0}, None, resolved) == ["rope_theta 20000.0 -> None"]


def test_preflight_refuses_sequence_parallel_as_the_run_does_before_writing(tmp_path, mix_path, monkeypatch):
    from zerotrain.launcher.commands.preflight.harness import Preflight, parse_args

    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)  # a world of one, restored after the test (run() would set them for good)
    out = tmp_path / "runs"
    opts, rest = parse_args(["--stage", "v1", "--data", str(mix_path), "--out", str(out), "--sequence-parallel", "2"])
    with pytest.raises(UsageError) as run_err:
        plan_run(resolve_config(rest), world=1)
    with pytest.raises(UsageError) as preflight_err:
        Preflight(resolve_config(rest), opts).run()
    assert str(preflight_err.value) == str(run_err.value) and "\n" not in str(run_err.value)
    assert str(run_err.value).startswith("--sequence-parallel 2")
    assert not out.exists()


def test_the_data_behind_the_same_flags_is_drift_too(tmp_path, mix_path):
    """run_plan.data_drift: the mix file edited in place (a weight, a template, a source added) and another
    tokenizer.json at the same path are drift on resume, as another --data path is; a record from an older run
    (no sources, no sha256) compares nothing."""
    from zerotrain.dataio.pipeline.loader import open_data
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.run_plan import data_drift

    specs = [s.__dict__ for s in open_data(str(mix_path), ByteTokenizer()).specs]
    saved = {"sources": specs, "tokenizer_sha256": "ab" * 32}
    assert data_drift(saved, specs, "ab" * 32) == []
    assert data_drift({}, specs, "cd" * 32) == []
    first = specs[0]["name"]
    reweighted = [{**specs[0], "weight": specs[0]["weight"] * 3}, *specs[1:]]
    assert data_drift(saved, reweighted, "ab" * 32) == [
        f"mix source {first!r} weight {specs[0]['weight']!r} -> {specs[0]['weight'] * 3!r}"]
    added = data_drift(saved, [*specs, {**specs[0], "name": "extra"}], "ab" * 32)
    assert added == [f"mix sources {[s['name'] for s in specs]} -> {[s['name'] for s in specs] + ['extra']}"]
    assert data_drift(saved, specs, "cd" * 32) == [
        "tokenizer content (its tokenizer.json's sha256) abababababab... -> cdcdcdcdcdcd..."]
    # a source of several files (a tuple in the spec, a list once config.json holds it) is the same source
    files = [{**specs[0], "path": ("/data/a.jsonl", "/data/b.jsonl")}]
    assert data_drift({"sources": json.loads(json.dumps(files))}, files, None) == []
    # a downloaded hub source resumed on a node whose cache is elsewhere: the same commit is the same data
    hub = {**specs[0], "hub": "org/data", "hf": "/home/a/.cache/huggingface/datasets--org--data/snapshots/c0ffee"}
    moved = {**hub, "hf": "/scratch/hf/datasets--org--data/snapshots/c0ffee"}
    assert data_drift({"sources": [hub]}, [moved], None) == []
    assert data_drift({"sources": [hub]}, [{**moved, "hf": "/scratch/hf/snapshots/beef"}], None) == [
        f"mix source {first!r} hf 'c0ffee' -> 'beef'"]


PROFILE_CASES = {  # a change to the shipped cpu profile: what plan_run (a dry run too) says, before anything is written
    "a key DeepSpeed's section has not": (
        lambda p: p["zero_optimization"].update(stage3_param_persistance_threshold=0),
        "zero_optimization.stage3_param_persistance_threshold: Extra inputs are not permitted (did you mean"
        " stage3_param_persistence_threshold?), got 0 (DeepSpeed's DeepSpeedZeroConfig)"),
    "a top-level key a letter away": (lambda p: p.update(train_micro_batch_size_per_gpuu=4),
                                      "train_micro_batch_size_per_gpuu is not a DeepSpeed key (did you mean"
                                      " train_micro_batch_size_per_gpu?); DeepSpeed would ignore it"),
    "clipping as text": (lambda p: p.update(gradient_clipping="1.0"),
                         "gradient_clipping must be a non-negative number, got '1.0'"),
    "an optimizer DeepSpeed has not": (lambda p: p["optimizer"].update(type="Adamm"),
                                       "optimizer type 'Adamm' is not one DeepSpeed builds"),
    "a backend torch has not": (lambda p: p["zerotrain"].update(dist_backend="ncl"),
                                "zerotrain.dist_backend must be one of nccl, gloo, mpi, ccl, hccl, xccl, got 'ncl'"),
    "env without set or pass": (lambda p: p["zerotrain"].update(env={"FOO": 1}),
                                "zerotrain.env must be an object with 'set' and/or 'pass', got {'FOO': 1}"),
    "a nested value": (lambda p: p["zerotrain"].update(health={"window_s": -1}),
                       "zerotrain.health.window_s must be a positive number, got -1"),
    "a GPU profile on this CPU": (lambda p: p["zerotrain"]["hardware"].update(accelerator="cuda"),
                                  "a GPU profile (hardware.accelerator cuda), but DeepSpeed sees no CUDA GPU on this"
                                  " node (DeepSpeed would train on the CPU)"),
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_a_profile_deepspeed_would_refuse_or_ignore_is_refused_at_plan_time(case, tmp_path, mix_path):
    """What DeepSpeed would refuse at deepspeed.initialize with a traceback from every rank (or ignore, or fail on
    its first step), and a GPU profile where there is none, are one line from the plan, as a dry run says it."""
    from zerotrain.launcher.profiles import load_profile

    change, expected = PROFILE_CASES[case]
    profile = load_profile("cpu")[1]
    change(profile)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(profile))
    argv = ["--profile", str(path), "--data", str(mix_path), "--out", str(tmp_path / "runs"), "--max-steps", "5"]
    for dry in ([], ["--dry-run"]) if "GPU" not in case else ([],):  # a dry run plans for the profile's machine
        with pytest.raises(UsageError) as err:
            plan_run(resolve_config(argv + dry), world=1)
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "runs").exists()
