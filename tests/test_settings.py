"""The declared settings table (launcher/settings.py): every flag and every profile key has exactly one
entry, every resolved value is recorded with its source (config.json's run_sources: checked on a real run by
tests/test_run_defaults.py's wsd run), and pre-flight's process group gets the run's comm timeout.
Policy only: no process group, no launch."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from zerotrain.launcher import settings
from zerotrain.launcher.config import BY_PATH, LEAVES, SETTINGS, RunConfig, with_values
from zerotrain.launcher.config_resolve import config_from, identity, resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import PROFILE_DIR, list_profiles, load_profile, validate_profile
from zerotrain.launcher.node import Node
from zerotrain.launcher.run_plan import describe, plan_run
from zerotrain.launcher.trainer import dry_run

SOURCE_WORDS = settings.SOURCE_WORDS


def test_every_flag_and_every_profile_key_has_exactly_one_entry():
    entries = settings.table()
    names = [s.name for s in entries]
    assert len(names) == len(set(names))
    flags = [s.name for s in entries if s.flag]
    assert sorted(flags) == sorted(SETTINGS)  # every flag (a RunConfig field) is one entry, and nothing else is
    keys = [s.profile_key for s in entries if s.profile_key]
    assert len(keys) == len(set(keys))
    for name in list_profiles():
        zt = json.loads((PROFILE_DIR / f"{name}.json").read_text()).get("zerotrain", {})
        for key in zt:
            assert [s.name for s in entries if s.profile_key == f"zerotrain.{key}"], f"{name}: zerotrain.{key}"
    # each declared entry says whether it is part of the run id and whether it may change on resume, as the run id
    # itself has it: what identity(RunConfig) hashes for a config of defaults (identity-when-set: once set only)
    hashed = set(identity(resolve_config(["--data", "m.json"])))
    for s in entries:
        assert s.resumable == (not s.identity), s.name
        if not s.flag:  # a profile-only setting (how the run is run, watched or described): never in the run id
            assert not s.identity and s.name not in hashed, s.name
            continue
        assert s.identity == (LEAVES[s.name].kind != "run"), s.name
        assert (s.name in hashed) == (LEAVES[s.name].kind == "identity"), s.name


def test_a_declared_flag_names_a_typed_field_of_the_tree_and_every_field_is_one_entry():
    """Nothing generated: every TABLE flag entry names, by dotted path, a field written in launcher/config.py whose
    flat name is the entry's and whose type, default, kind and choices are the entry's; and every field of the
    tree (each group's dataclass) is a flag entry of settings.table(), the declared one where the table has it."""
    groups = {f.name: f.default_factory for f in fields(RunConfig) if f.name != "sources"}
    for s in settings.FLAGS:
        group, attr = s.field.split(".")
        f = {f.name: f for f in fields(groups[group])}[attr]  # a KeyError: the path names no field
        assert (f.metadata["flat"] or f.name) == s.name, s.field
        assert (str(f.type), f.default, f.metadata["kind"], f.metadata["choices"]) == \
               (s.type, s.field_default, s.kind, s.choices), s.name
        assert BY_PATH[s.field] is LEAVES[s.name]
    tree = {f"{g}.{f.name}" for g, cls in groups.items() for f in fields(cls)}
    entries = settings.table()
    assert sorted(s.field for s in entries if s.flag) == sorted(tree)
    assert all(settings.BY_NAME[s.name] is s for s in entries if s.name in settings.BY_NAME)
    assert "hang_timeout" not in identity(resolve_config(["--data", "m.json", "--hang-timeout", "30"]))
    with pytest.raises(UsageError, match=r"^--attention: must be one of auto, sdpa, flex, varlen, got 'x'$"):
        config_from({"data": "m.json", "attention": "x"})
    with pytest.raises(UsageError, match=r"^--schedule: must be cosine or wsd, got 'x'$"):
        config_from({"data": "m.json", "schedule": "x"})
    with pytest.raises(UsageError, match=r"^p: zerotrain.comm_timeout_s must be a positive number of seconds"):
        validate_profile({"zerotrain": {"comm_timeout_s": 0}}, "p")


def test_flag_beats_profile_beats_rule_beats_default_and_each_says_so():
    cpu = load_profile("cpu")[1]
    zt = {**cpu["zerotrain"], "hang_timeout": 50, "attention": "flex"}
    cfg = resolve_config(["--data", "m.json", "--profile", "cpu", "--activation-checkpointing"])
    s = settings.resolve(cfg, "cpu", {**cpu, "zerotrain": zt})
    assert (s.activation_checkpointing, s.sources["activation_checkpointing"]) == (True, "flag")
    assert (s.hang_timeout, s.sources["hang_timeout"]) == (50, "profile cpu: zerotrain.hang_timeout")
    assert (s.comm_timeout_s, s.sources["comm_timeout_s"]) == (1800.0, "rule: max(1800 s, 2 x hang_timeout)")
    assert (s.attention, s.sources["attention"]) == ("flex", "profile cpu: zerotrain.attention")
    assert (s.compile, s.sources["compile"]) == (False, "default")
    assert (s.seq_len, s.sources["seq_len"]) == (256, "default")
    assert s.sources["lr"] == "profile cpu: optimizer.params.lr"
    assert s.sources["min_lr"] == "rule: lr / 10"
    assert s.health == settings.HEALTH_DEFAULTS and s.sources["health"] == "default"
    assert s.mfu_threshold == cpu["zerotrain"]["mfu_threshold"]
    alone = settings.resolve(None, "p", {"zerotrain": {"expected_mfu": 0.4, "health": {"windows": 5}}})
    assert alone.mfu_threshold == pytest.approx(0.3) and alone.sources["mfu_threshold"] == "rule: 0.75 x expected_mfu"
    assert alone.health == {**settings.HEALTH_DEFAULTS, "windows": 5}
    assert (alone.hang_timeout, alone.sources["hang_timeout"]) == (None, "rule: the larger of 600 s and 5x the"
                                                                    " slowest phase so far (start-up: at least 1800 s)")


def test_the_hang_timeout_sets_the_comm_timeout_for_preflight_and_the_run_alike(mix_path, tmp_path):
    """--hang-timeout 1200: the process group's collectives time out after 2400 s, in pre-flight (which
    resolves the settings as the run does, launcher/commands/preflight/harness.py) and in the run."""
    cfg = resolve_config(["--data", str(mix_path), "--out", str(tmp_path), "--hang-timeout", "1200"])
    plan = plan_run(cfg, 1, 0)
    name, profile = load_profile(cfg.parallel.profile)
    preflight = settings.resolve(cfg, name, profile)  # what pre-flight's process group is given
    assert plan.settings.comm_timeout_s == preflight.comm_timeout_s == 2400
    assert plan.settings.sources["hang_timeout"] == "flag"


def test_the_node_is_probed_once_and_a_dry_run_reads_the_profiles_hardware():
    assert Node.here() is Node.here()  # one probe per process
    assert Node.here().device in ("cpu", "cuda") and Node.here().probed
    hardware = load_profile("a100-80g-x8")[1]["zerotrain"]["hardware"]
    a100 = Node.of_profile(hardware)
    assert (a100.device, a100.count, a100.varlen, a100.probed) == ("cuda", 8, True, False)
    assert a100.memory == hardware["device_memory_gib"] * 2**30
    assert Node.of_profile({"accelerator": "cpu"}).count == 0


def test_the_dry_run_prints_the_start_up_description(mix_path, tmp_path, capsys, monkeypatch):
    """describe(plan): the lines the Trainer says at start-up, and --dry-run prints them too."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = resolve_config(["--data", str(mix_path), "--out", str(tmp_path), "--hang-timeout", "1200"])
    lines = describe(plan_run(with_values(cfg, {"dry_run": True}), 1, 0))
    assert lines[0].startswith("hyper-parameters: lr 0.003 (profile cpu: optimizer.params.lr)")
    assert "attention: sdpa (auto on cpu, fp32)" in lines
    setting = next(line for line in lines if line.startswith("settings: "))
    assert "hang-timeout 1200 (flag)" in setting and "comm-timeout-s 2400 (rule: max(1800 s, 2 x hang_timeout))" in setting
    dry_run(cfg)
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line in lines] == lines


@pytest.mark.launches
def test_a_misspelt_profile_key_is_refused_in_one_line_naming_the_likely_one(tmp_path, mix_path):
    """A key of the zerotrain section no setting owns would be ignored, the run taking the default silently."""
    import subprocess
    import sys

    from conftest import REPO

    p = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    p["zerotrain"]["activation_checkpoint"] = True
    prof = tmp_path / "typo.json"
    prof.write_text(json.dumps(p))
    out = tmp_path / "runs"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "train", "--profile", str(prof), "--data", str(mix_path),
                           "--out", str(out), "--dry-run"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "zerotrain.activation_checkpoint is not a setting (did you mean zerotrain.activation_checkpointing?)")
    assert list(out.iterdir()) == []
