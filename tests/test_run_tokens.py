"""Runs sized in tokens: --total-tokens sets the length without --max-steps (the schedule spans it), --warmup-tokens
and a default warmup that scales with the run, a word when data repeats (--max-epochs refuses), and the same after
a resume on another world size (launcher/hparams.py size_in_tokens, run_plan.plan_run, run_plan.check_repeats).
The dry runs are in-process; one 2-rank launch and one 1-rank resume carry the run's own asserts."""
from __future__ import annotations

import json

import pytest

from conftest import launch, read_metrics
from test_run_defaults import A100, profile_file
from zerotrain.launcher.cli import main as cli
from zerotrain.launcher import settings
from zerotrain.launcher.config_resolve import config_from, identity, identity_hash, resolve_config
from zerotrain.launcher.profiles import load_profile
from zerotrain.launcher.hparams import RULE_MAX_STEPS, RULE_WARMUP, RULE_WARMUP_TOKENS, size_in_tokens

PLAN = [*A100, "--total-tokens", "11000000000", "--global-batch-tokens", "131072"]  # the 1.46B plan, in our flags


def dry_run(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        cli(["train", *argv, "--dry-run"])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_total_tokens_sets_the_length_the_warmup_scales_and_repeats_are_said(mix_path, tmp_path, capsys,
                                                                             monkeypatch):
    """The issue's command: 11B tokens at 131,072 per step is 83,924 steps (not 100), the cosine spans them, the
    warmup is 1% of them (not 20), and the ~150k-token mix read ~10^5 times is said with its unique tokens."""
    code, out, _ = dry_run(capsys, monkeypatch, *PLAN, "--data", str(mix_path), "--out", str(tmp_path / "runs"))
    assert code == 0 and not (tmp_path / "runs").exists()
    assert f"warmup-steps 840 ({RULE_WARMUP}), max-steps 83924 ({RULE_MAX_STEPS})" in out
    assert ("run length: --total-tokens 11,000,000,000 -> 83,924 steps of 131,072 tokens per step = 11,000,086,528"
            " tokens") in out
    assert "schedule cosine: warmup 840 step(s) to lr 0.0003, cosine decay to 3e-05 at step 83924" in out
    assert "this run reads 11,000,086,528 tokens" in out
    warning = next(line for line in out.splitlines() if "source(s) read more than 4 epochs" in line)
    assert warning.startswith("zerotrain: warning: 2 source(s) read more than 4 epochs over the run's 11,000,086,528")
    assert "'prose' ~100,691.2 epochs of 76,472 unique tokens" in warning and "Muennighoff et al. 2023" in warning

    # --warmup-tokens: that plan's 100M tokens, rounded up to whole steps
    code, out, _ = dry_run(capsys, monkeypatch, *PLAN, "--warmup-tokens", "100000000", "--data", str(mix_path),
                           "--out", str(tmp_path / "runs"))
    assert code == 0 and f"warmup-steps 763 ({RULE_WARMUP_TOKENS})" in out

    # --max-epochs refuses such a run in one line, from the flag or the profile
    code, _, err = dry_run(capsys, monkeypatch, *PLAN, "--max-epochs", "4", "--data", str(mix_path))
    assert code == 2 and err.strip().splitlines() == [
        "zerotrain: error: --max-epochs 4 (flag): this run of 11,000,086,528 tokens reads source 'prose' ~100,691.2"
        " times (2 source(s) over); more data, fewer tokens, or a larger --max-epochs"]
    profile = profile_file(tmp_path, zerotrain={**load_profile("a100-80g-x8")[1]["zerotrain"], "max_epochs": 50})
    code, _, err = dry_run(capsys, monkeypatch, *PLAN, "--profile", profile, "--data", str(mix_path))
    assert code == 2 and "--max-epochs 50 (profile a100-80g-x8-changed: zerotrain.max_epochs)" in err


def test_with_both_flags_the_start_says_which_ends_the_run(mix_path, tmp_path, capsys, monkeypatch):
    common = [*A100, "--global-batch-tokens", "131072", "--data", str(mix_path), "--out", str(tmp_path)]
    _, out, _ = dry_run(capsys, monkeypatch, *common, "--max-steps", "100", "--total-tokens", "5000000")
    assert ("run length: --total-tokens 5,000,000 ends the run at step 38 (4,980,736 tokens at 131,072 tokens per"
            " step; a budget stop, exit 5), before --max-steps 100 (flag)") in out
    _, out, _ = dry_run(capsys, monkeypatch, *common, "--max-steps", "10", "--total-tokens", "10000000000")
    assert ("run length: --max-steps 10 (flag) x 131,072 tokens per step = 1,310,720 tokens; --total-tokens"
            " 10,000,000,000 never binds (the run ends first)") in out


def test_zerotrain_plan_sizes_the_run_in_tokens_and_warns(mix_path, capsys):
    plan = cli(["plan", *PLAN, "--data", str(mix_path), "--json"]) or json.loads(capsys.readouterr().out)
    assert (plan["binding"], plan["steps"], plan["tokens"]) == ("total_tokens", 83924, 11_000_086_528)
    assert plan["tokens_per_param"] == pytest.approx(11_000_086_528 / plan["params_total"], abs=1e-3)
    assert len(plan["warnings"]) == 1 and "'notes' ~45,051.5 epochs of 73,250 unique tokens" in plan["warnings"][0]
    assert plan["data_unknown"] is None  # with the data present, nothing is said to be unknown


def test_the_run_id_does_not_follow_a_rule_derived_warmup():
    """A warmup from a rule changes with the run's length, which may grow on resume: the id must not."""
    base = {"data": "m.json"}
    assert identity_hash(config_from(base)) == "5d5a41ce"  # the id this config had before the rule (warmup 20)
    long = config_from({**base, "max_steps": 5000})
    assert (long.schedule.warmup_steps, identity_hash(long)) == (50, "5d5a41ce")
    assert identity_hash(config_from({**base, "warmup_steps": 50})) != "5d5a41ce"  # given: part of the id
    by_tokens = [config_from({**base, "warmup_tokens": n}) for n in (1000, 2000)]
    assert identity_hash(by_tokens[0]) != identity_hash(by_tokens[1])
    assert "warmup_steps" not in identity(by_tokens[0]) and identity(by_tokens[0])["warmup_tokens"] == 1000


def test_sized_again_on_resume_from_the_tokens_consumed():
    """max_steps = the checkpoint's step + what is left of --total-tokens at this world's tokens per step; a warmup
    from a rule stays what the run started with (its schedule), whatever the new length says."""
    cfg = resolve_config(["--data", "m.json", "--total-tokens", "10000", "--seq-len", "64"])
    first = size_in_tokens(cfg, 256)
    assert (first.schedule.max_steps, first.schedule.warmup_steps) == (40, 20)
    more = size_in_tokens(resolve_config(["--data", "m.json", "--total-tokens", "1000000", "--seq-len", "64"]), 128,
                          resumed=(40, 10240), started={"warmup_steps": 20})
    assert more.schedule.max_steps == 40 + -(-(1_000_000 - 10240) // 128) == 7773
    assert more.schedule.warmup_steps == 20
    assert more.sources["warmup_steps"] == RULE_WARMUP + " (kept from the run's start)"
    assert more.sources["max_steps"].startswith(RULE_MAX_STEPS + ": step 40 + 989,760 tokens left / 128")


@pytest.mark.launches
def test_length_and_warmup_from_tokens_then_extended_on_another_world(tmp_path, mix_path):
    """2 ranks, wsd, warmup 300 tokens (2 steps of 256), stopped by a 4-step token budget (checkpoint saved);
    resumed on 1 rank with only --total-tokens 5,020: 4 + 3,996 tokens left / 256 = 20 steps, the decay
    re-planned to steps 17-20 (a cosine would have kept its 10), the warmup kept; the run ends 'finished' at
    step 20, its last step whole."""
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--out", str(out), "--run-id", "w", "--model", "debug", "--seq-len", "64",
            "--micro-batch", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--warmup-tokens", "300", "--schedule", "wsd"]
    first = launch("deepspeed", args + ["--max-steps", "10", "--total-tokens", str(4 * 256)])
    assert first.returncode == 5, first.stdout[-2000:] + first.stderr[-2000:]  # budget reached, saved
    assert f"warmup-steps 2 ({RULE_WARMUP_TOKENS})" in first.stdout
    assert "run length: --total-tokens 1,024 ends the run at step 4 (1,024 tokens at 256 tokens per step" in first.stdout
    second = launch("python", args + ["--total-tokens", "5020"])
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert ("run length: --total-tokens 5,020 -> 20 steps of 256 tokens per step = 5,120 tokens"
            f" ({RULE_MAX_STEPS}: step 4 + 3,996 tokens left / 256, rounded up)") in second.stdout
    assert "resumed at step 4 in its stable phase: decay re-planned for --max-steps 20" in second.stdout
    saved = json.loads((out / "w" / "config.json").read_text())
    assert (saved["run"]["max_steps"], saved["run"]["warmup_steps"]) == (20, 2)
    sources = saved["run_sources"]
    assert sources["warmup_steps"] == RULE_WARMUP_TOKENS + " (kept from the run's start)"
    assert (sources["lr"], sources["schedule"], sources["decay_fraction"]) == ("flag", "flag", "default")
    # every resolved setting is recorded, in the table's order, with where it came from (launcher/settings.py)
    assert list(sources) == [s.name for s in settings.table() if not s.note]
    assert all(v.startswith(settings.SOURCE_WORDS) for v in sources.values()), sources
    assert (sources["seq_len"], sources["seed"], sources["attention"]) == ("flag", "default", "rule: auto on cpu, fp32")
    assert sources["comm_timeout_s"] == "rule: max(1800 s, 2 x hang_timeout)"
    metrics = read_metrics(out / "w")
    lrs = [m["lr"] for m in metrics]
    assert len(lrs) == 20 and lrs[:16] == pytest.approx([5e-4] + [1e-3] * 15)
    assert lrs[16:] == pytest.approx([1e-3 - 9e-4 * k / 4 for k in range(1, 5)])  # steps 17-20, min-lr at 20
    assert metrics[-1]["tokens_seen"] == 20 * 256


def test_a_max_epochs_below_one_says_the_epochs_it_found():
    """--max-epochs 0.001 refused a run reading a source ~0.0 times (one decimal): below one epoch, two significant
    digits."""
    from zerotrain.launcher.hparams import times

    assert [times(e) for e in (100691.23, 4.0, 0.9, 0.0123)] == ["100,691.2", "4.0", "0.9", "0.012"]
