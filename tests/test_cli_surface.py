"""Every `zerotrain` command behaves as people expect: `-h/--help` prints the usage and
exits 0 without doing anything else, help shows defaults and choices, underscore spellings of the flags work,
bad usage is one line and exit 2. The shared parser is zerotrain/cli_args.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zerotrain.cli_args import Parser
from zerotrain.errors import UsageError
from zerotrain.launcher.cli import COMMANDS
from zerotrain.launcher.cli import main as cli
from zerotrain.launcher.config_resolve import resolve_config


def listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_prints_usage_exits_0_and_does_nothing_else(command, flag, tmp_path, monkeypatch, capsys):
    (tmp_path / "keep.txt").write_text("a file that was here before")
    monkeypatch.chdir(tmp_path)  # the demo writes runs/demo-data here, a run writes runs/: neither may happen
    monkeypatch.setenv("ZEROTRAIN_DEMO_DIR", str(tmp_path / "runs"))

    def no_process(*args, **kwargs):  # `launch --help` and `demo --help` must not start DeepSpeed
        raise AssertionError(f"{command} {flag} started a process: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(SystemExit) as e:
        cli([command, flag])
    out = capsys.readouterr().out
    assert e.value.code in (0, None)
    assert out.startswith(f"usage: zerotrain {command}") and "-h, --help" in out
    assert listing(tmp_path) == ["keep.txt"]


def test_top_level_help_and_version(capsys):
    cli(["--help"])
    out = capsys.readouterr().out
    assert all(f"zerotrain {name}" in out for name in COMMANDS)
    cli(["--version"])
    assert capsys.readouterr().out.startswith("zerotrain ")


def test_train_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--packing {best-fit,greedy}" in out and "best-fit (default)" in out
    assert "--on-spike {warn,stop,rollback}" in out and "(default: warn)" in out
    assert "--verify-data {quick,full}" in out and "quick (default" in out
    assert "--schedule {cosine,wsd}" in out and "--seq-len SEQ_LEN tokens per packed row (default: 256)" in out
    assert "--micro_batch" not in out  # underscore aliases are accepted, not listed twice


def test_plan_help_lists_its_own_flags_before_the_training_flags(capsys):
    with pytest.raises(SystemExit):
        cli(["plan", "--help"])
    out = capsys.readouterr().out
    assert out.index("--gpus") < out.index("--json") < out.index("training flags (as") < out.index("--profile")


def test_underscore_spellings_are_aliases_of_the_dashed_flags():
    dashed = resolve_config(["--data", "m.json", "--micro-batch", "4", "--seq-len", "64", "--warmup-steps", "2"])
    under = resolve_config(["--data", "m.json", "--micro_batch", "4", "--seq_len=64", "--warmup_steps", "2"])
    assert under == dashed and under.schedule.micro_batch == 4 and under.data.seq_len == 64
    assert under.sources["micro_batch"] == "flag"
    p = Parser(prog="x")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("rest", nargs="*")
    ns = p.parse_args(["--max_shard_size", "1MB", "--", "--keep_this"])
    assert ns.max_shard_size == "1MB" and ns.rest == ["--keep_this"]  # after --: another command's flags


def test_underscores_reach_every_command(tmp_path, capsys):
    cli(["params", "debug", "--vocab_size", "128256"])
    assert "vocab 128256" in capsys.readouterr().out
    cli(["plan", "--model", "debug", "--seq_len", "64", "--gpu_mem", "8", "--json"])
    assert '"seq_len": 64' in capsys.readouterr().out


@pytest.mark.launches
@pytest.mark.parametrize("argv, message", [
    (["train", "--no-such-flag"], "zerotrain train: unrecognized arguments: --no-such-flag"),
    (["train", "--seq-len", "x"], "zerotrain train: argument --seq-len: invalid int value: 'x'"),
    (["tokenizer"], "zerotrain tokenizer: the following arguments are required: ACTION"),
    (["profiles", "extra"], "zerotrain profiles: unrecognized arguments: extra"),
    (["launch"], "usage: zerotrain launch -n N"),
])
def test_bad_usage_is_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, "-m", "zerotrain", *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    if argv[0] != "launch":  # launch's usage is its two forms
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_parser_raises_the_one_usage_error_class():
    from zerotrain.dataio.format.errors import UsageError as DataUsageError
    from zerotrain.launcher.errors import UsageError as LauncherUsageError

    assert DataUsageError is LauncherUsageError is UsageError
    with pytest.raises(UsageError, match="^x: the following arguments are required: --to$"):
        p = Parser(prog="x")
        p.add_argument("--to", required=True)
        p.parse_args([])
