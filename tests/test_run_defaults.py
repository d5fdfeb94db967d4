"""Defaults that fit a real run: where each hyper-parameter comes from (flag, recipe,
profile, rule, default; launcher/hparams.py), the profile against the machine (profiles.check_devices), a
schedule that can be extended on resume (components/schedule.py), and the plan sized by the tokenizer given."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import WORDS
from zerotrain.errors import UsageError
from zerotrain.launcher import run_plan
from zerotrain.launcher.cli import main as cli
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.config_resolve import config_from, drift, identity, identity_hash, resolve_config
from zerotrain.launcher.node import Node
from zerotrain.launcher.profiles import check_devices, load_profile, resolve_ds_config
from zerotrain.modeling.sizes import count_params, default_lr, preset

A100 = ["--profile", "a100-80g-x8", "--model", "xlarge", "--seq-len", "2048"]


def profile_file(tmp_path: Path, name: str = "a100-80g-x8", **changes) -> str:
    """A shipped profile with sections replaced (a value None removes the key), as a JSON path."""
    profile = load_profile(name)[1]
    for key, value in changes.items():
        if value is None:
            profile.pop(key, None)
        else:
            profile[key] = value
    path = tmp_path / f"{name}-changed.json"
    path.write_text(json.dumps(profile))
    return str(path)


# -- where each value comes from ----------------------------------------------------------------

def test_dry_run_of_the_8_gpu_profile_uses_its_lr_and_says_so(mix_path, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        cli(["train", *A100, "--data", str(mix_path), "--out", str(tmp_path / "runs"), "--dry-run"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and not (tmp_path / "runs").exists()
    assert ("hyper-parameters: lr 0.0003 (profile a100-80g-x8: optimizer.params.lr), min-lr 3e-05 (lr / 10),"
            " warmup-steps 20 (rule: max(20, 1% of max-steps), Pythia's warmup), max-steps 100 (default),"
            " schedule cosine (default)") in out
    assert "schedule cosine: warmup 20 step(s) to lr 0.0003, cosine decay to 3e-05 at step 100" in out
    assert "vocab 320 (tokenizer bytes: 258)" in out


def test_a_flag_or_a_recipe_wins_and_is_named(tmp_path):
    cfg = resolve_config(["--data", "m.json", *A100, "--lr", "1e-3"])
    assert (cfg.schedule.lr, cfg.sources["lr"]) == (1e-3, "flag")
    # an explicit lr keeps min-lr's fixed default of before 0.2, so the run ids of such runs stay
    assert (cfg.schedule.min_lr, cfg.sources["min_lr"]) == (3e-4, "default with an explicit lr")
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"lr": 5e-4, "warmup_steps": 7}))
    cfg = resolve_config(["--data", "m.json", *A100, "--config", str(recipe), "--warmup-steps", "9"])
    assert (cfg.schedule.lr, cfg.sources["lr"], cfg.schedule.warmup_steps, cfg.sources["warmup_steps"]) == \
        (5e-4, "recipe", 9, "flag")
    assert config_from({"data": "m.json", "lr": 2e-4}).sources["lr"] == "given"  # the Python API


def test_without_a_profile_lr_the_per_size_rule_fits_the_model(tmp_path):
    no_lr = load_profile("a100-80g-x8")[1]["optimizer"]
    no_lr["params"].pop("lr")
    cfg = resolve_config(["--data", "m.json", *A100, "--profile", profile_file(tmp_path, optimizer=no_lr)])
    p = count_params(preset("xlarge"))["non_embedding"]
    lr = cfg.schedule.lr
    assert lr == pytest.approx(default_lr(p), rel=1e-2) and 1.5e-4 < lr < 3e-4  # GPT-3's 1.3B: 2e-4
    assert cfg.sources["lr"] == "per-size rule for 1,415.7M non-embedding parameters"
    debug = resolve_config(["--data", "m.json", "--profile", profile_file(tmp_path, optimizer=no_lr)])
    assert 1e-3 < debug.schedule.lr < 3e-3  # a 0.8M model: about what the demo trains with
    # another optimizer than the profile's: its own default, not the profile's AdamW lr
    muon = resolve_config(["--data", "m.json", *A100, "--optimizer", "muon"])
    assert (muon.schedule.lr, muon.sources["lr"], muon.schedule.min_lr) == (0.02, "optimizer muon's default", 2e-3)


def test_a_profile_scheduler_section_is_read_or_refused_never_dropped(tmp_path):
    cosine = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 50, "cos_min_ratio": 0.05,
                                                   "total_num_steps": 2000, "warmup_type": "linear"}}
    path = profile_file(tmp_path, scheduler=cosine)
    cfg = resolve_config(["--data", "m.json", "--model", "xlarge", "--profile", path])
    s = cfg.schedule
    assert (s.warmup_steps, s.min_lr, s.max_steps) == (50, pytest.approx(0.05 * 3e-4), 2000)
    assert cfg.sources["max_steps"] == "profile a100-80g-x8-changed: scheduler total_num_steps"
    cfg = resolve_config(["--data", "m.json", "--model", "xlarge", "--profile", path, "--max-steps", "10"])
    assert cfg.schedule.max_steps == 10 and "scheduler total_num_steps 2000 not used" in cfg.sources["max_steps"]
    assert "scheduler" not in resolve_ds_config(load_profile(path)[1], cfg, 8, "p")  # never DeepSpeed's
    for section, message in [
        ({"type": "WarmupDecayLR", "params": {}}, "scheduler 'WarmupDecayLR' is not read"),
        ({"type": "WarmupCosineLR", "params": {"warmup_max_lr": 1}}, "scheduler.params.warmup_max_lr is not read"),
        ({"type": "WarmupCosineLR", "params": {"warmup_type": "log"}}, "warmup_type 'log': zerotrain's warmup is"),
    ]:
        with pytest.raises(UsageError, match=message) as e:
            resolve_config(["--data", "m.json", "--profile", profile_file(tmp_path, scheduler=section)])
        assert "\n" not in str(e.value)


def test_run_ids_hash_the_values_trained_with():
    assert identity_hash(RunConfig.from_flat({"data": "mix.json"})) == "cea5eb6e"  # the cpu profile's lr: CPU runs' id
    assert identity_hash(config_from({"data": "mix.json", "schedule": "cosine"})) == "cea5eb6e"  # spelled out
    explicit = config_from({"data": "mix.json", "profile": "a100-80g-x8", "lr": 3e-3, "min_lr": 3e-4,
                            "warmup_steps": 20})
    assert identity(explicit)["lr"] == 3e-3  # given: the profile's 3e-4 does not replace it
    from_profile = config_from({"data": "mix.json", "profile": "a100-80g-x8"})
    assert (identity(from_profile)["lr"], identity(from_profile)["min_lr"]) == (3e-4, 3e-5)
    wsd = identity(config_from({"data": "mix.json", "schedule": "wsd"}))
    assert (wsd["schedule"], wsd["decay_fraction"]) == ("wsd", 0.2)
    auto = config_from({"data": "mix.json", "profile": "auto"})
    assert auto.schedule.lr is None  # resolved on the rank, once the profile is detected
    with pytest.raises(RuntimeError, match="--profile auto"):
        identity(auto)
    assert drift(auto, {**auto.to_dict(), "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 20}) == []
    with pytest.raises(UsageError, match="--decay-fraction 0.5: only used with --schedule wsd"):
        config_from({"data": "mix.json", "decay_fraction": 0.5})


# -- the profile against the machine ---------------------------------------------------------------

def detect_h100():
    return "h100-80g-x8", "8 x NVIDIA H100 80GB HBM3 (80 GiB), 1 node(s)"


def test_a_cpu_profile_on_a_cuda_node_is_refused_naming_the_profile_to_use():
    cpu = load_profile("cpu")[1]
    with pytest.raises(UsageError) as e:
        check_devices("cpu", cpu, 1, "cuda", 8, detect=detect_h100)
    assert "--profile cpu: a CPU profile, but this node has 8 CUDA GPU(s)" in str(e.value)
    assert "use --profile h100-80g-x8" in str(e.value) and "\n" not in str(e.value)
    assert check_devices("cpu", cpu, 2, "cpu", 0) == []


def test_a_gpu_profile_where_deepspeed_sees_no_gpu_is_refused():
    """It would end in NCCL's traceback (no NCCL in a CPU build of torch), or with gloo train on the CPU silently."""
    h100 = load_profile("h100-80g-x8")[1]
    with pytest.raises(UsageError, match=r"^--profile h100-80g-x8: a GPU profile \(hardware.accelerator cuda\), but"
                                         r" DeepSpeed sees no CUDA GPU on this node \(its nccl backend would fail\)"):
        check_devices("h100-80g-x8", h100, 1, "cpu", 0)
    gloo = {**h100, "zerotrain": {**h100["zerotrain"], "dist_backend": "gloo"}}
    with pytest.raises(UsageError, match="DeepSpeed would train on the CPU"):
        check_devices("mine.json", gloo, 1, "cpu", 0)
    assert check_devices("h100-80g-x8", h100, 8, None, 0) == []  # a dry run (not asked): the profile's hardware


def test_world_size_against_the_profile_and_one_process_on_many_gpus():
    a100 = load_profile("a100-80g-x8")[1]
    assert check_devices("a100-80g-x8", a100, 8, "cuda", 8) == []
    one = check_devices("a100-80g-x8", a100, 1, "cuda", 8)
    assert one == ["world size 1 differs from profile a100-80g-x8's devices_per_node x nodes = 8 x 1 = 8: the batch"
                   " is resolved for 1 rank(s)",
                   "this node has 8 GPUs and this run uses one; `zerotrain launch -n 8 <the same flags>` uses them all"]
    assert check_devices("a100-80g-x8", a100, 4, "cuda", 4) == [
        "world size 4 differs from profile a100-80g-x8's devices_per_node x nodes = 8 x 1 = 8: the batch is"
        " resolved for 4 rank(s)"]


def test_plan_run_asks_the_machine(mix_path, tmp_path, monkeypatch):
    # the machine, as launcher/node.py probes it: 8 GPUs
    monkeypatch.setattr(Node, "here", staticmethod(lambda: Node("cuda", 8, "NVIDIA H100 80GB HBM3", 80 * 2**30,
                                                                True, False)))
    monkeypatch.setattr(run_plan, "detect_profile", detect_h100)
    argv = ["--data", str(mix_path), "--out", str(tmp_path / "runs")]
    with pytest.raises(UsageError, match="use --profile h100-80g-x8"):
        run_plan.plan_run(resolve_config(argv), world=1)
    assert not (tmp_path / "runs").exists()


def test_a_dry_run_of_a_profile_naming_no_machine_plans_for_this_one(mix_path, tmp_path):
    """A profile without zerotrain.hardware: the dry run describes the run `zerotrain train` makes here (this CPU:
    the profile's ZeRO-3 kept), not one on an assumed GPU (ZeRO-2 at a world of 1 there)."""
    import json

    profile = load_profile("cpu")[1]
    profile.pop("zerotrain")
    profile["zero_optimization"]["stage"] = 3
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(profile))
    argv = ["--profile", str(path), "--data", str(mix_path), "--out", str(tmp_path / "runs"), "--max-steps", "5"]
    dry = run_plan.plan_run(resolve_config(argv + ["--dry-run"]), world=1)
    real = run_plan.plan_run(resolve_config(argv), world=1)
    assert dry.node.device == real.node.device == "cpu"
    assert dry.ds_config["zero_optimization"]["stage"] == real.ds_config["zero_optimization"]["stage"] == 3


# -- extending a run: tests/test_run_tokens.py (a wsd run extended in its stable phase, sized in tokens)


# -- the plan sized by the tokenizer given -----------------------------------------------------------------

@pytest.fixture(scope="module")
def llama3_sized_tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer with Llama 3's 128,256 entries, built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|begin_of_text|>": 1, "[UNK]": 2}
    for word in [*WORDS, "."]:  # the words of the test mixes (conftest.synthetic_docs), so data tokenizes
        vocab.setdefault(word, len(vocab))
    for i in range(len(vocab), 128256):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    return out


def test_plan_and_dry_run_use_the_tokenizer_given(llama3_sized_tokenizer, mix_path, tmp_path, monkeypatch, capsys):
    tok = str(llama3_sized_tokenizer)
    plan = cli(["plan", *A100, "--tokenizer", tok, "--json"]) or json.loads(capsys.readouterr().out)
    byte = cli(["plan", *A100, "--json"]) or json.loads(capsys.readouterr().out)
    assert plan["model"]["vocab_size"] == 128256 and plan["vocab_from"] == f"tokenizer {tok}/tokenizer.json"
    assert byte["model"]["vocab_size"] == 320 and byte["vocab_from"] == "tokenizer bytes"
    args = preset("xlarge", vocab_size=128256)
    assert plan["params_total"] == count_params(args)["total"] == 1_908_205_440
    assert plan["memory_per_gpu_gib"] > byte["memory_per_gpu_gib"]  # the embedding, the head and their states
    # at ZeRO-0 and micro-batch 32 it does not fit on 80 GB, and the plan lists what would
    cli(["plan", *A100, "--tokenizer", tok, "--zero", "0", "--micro-batch", "32"])
    text = capsys.readouterr().out
    assert text.startswith(f"profile a100-80g-x8; vocabulary 128,256 (tokenizer {tok}/tokenizer.json)")
    assert "does not fit: needs" in text and "would fit:" in text
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        cli(["train", *A100, "--tokenizer", tok, "--data", str(mix_path), "--out", str(tmp_path), "--dry-run"])
    assert f"vocab 128,256 (tokenizer {tok}/tokenizer.json: 128,256)" in capsys.readouterr().out
