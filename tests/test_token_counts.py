"""Counts as people write them, and every integer parser's limits (zerotrain/cli_args.py): token counts accept
11e9, 11B, 500M, 2T, 4096, 1.5B (exact integers) from a flag of train, plan and preflight, a recipe value and a
notebook keyword; non-integers, overflow and negatives are one line. In-process, plus one subprocess per surface
for the exit status and the absence of a traceback."""
import json
import subprocess
import sys

import pytest

from zerotrain.cli_args import MAX_INT, Parser, exact_integer
from zerotrain.launcher.commands import plan as plan_command
from zerotrain.launcher.commands.preflight.harness import parse_args as preflight_args
from zerotrain.launcher.config import TOKEN_COUNTS
from zerotrain.launcher.config_resolve import config_from, resolve_config
from zerotrain.launcher.errors import UsageError

WRITTEN = {"11e9": 11_000_000_000, "11B": 11_000_000_000, "500M": 500_000_000, "2T": 2_000_000_000_000,
           "4096": 4096, "1.5B": 1_500_000_000, "1.5e3": 1500, "64K": 64_000, "11b": 11_000_000_000}
REFUSED = {"1.5e0": "not a whole number", "2.5": "not a whole number", "1e400": "too large",
           "1e-999999999": "not a whole number", "11X": "not a number", "inf": "not a number",
           "nan": "not a number", "": "not a number", "2.5K3": "not a number"}


@pytest.mark.parametrize("text, value", WRITTEN.items())
def test_every_token_flag_reads_the_forms_people_write(text, value, mix_path):
    for name in TOKEN_COUNTS:
        flag = "--" + name.replace("_", "-")
        argv = ["--data", str(mix_path), flag, text]
        if name == "eval_tokens":
            argv += ["--eval-every-steps", "10"]
        cfg = resolve_config(argv)
        assert cfg.to_dict()[name] == value and type(cfg.to_dict()[name]) is int


@pytest.mark.parametrize("text, why", REFUSED.items())
def test_non_integers_and_overflow_are_one_line_naming_the_flag(text, why, mix_path):
    for name in TOKEN_COUNTS:
        flag = "--" + name.replace("_", "-")
        with pytest.raises(UsageError) as e:
            resolve_config(["--data", str(mix_path), f"{flag}={text}"])
        assert f"argument {flag}: {text!r}: {why}" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_negative_counts_are_refused_with_the_flags_own_words(mix_path):
    with pytest.raises(UsageError, match="--total-tokens: must be a positive integer, got -5000000000"):
        resolve_config(["--data", str(mix_path), "--total-tokens=-5B"])


def test_recipes_and_keywords_take_the_same_forms(tmp_path, mix_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"data": str(mix_path), "total_tokens": "11B", "warmup-tokens": 2e6,
                                  "global_batch_tokens": "64K"}))
    cfg = resolve_config(["--config", str(recipe)])
    s = cfg.schedule
    assert (s.total_tokens, s.warmup_tokens, s.global_batch_tokens) == (11 * 10**9, 2 * 10**6, 64_000)
    assert resolve_config(["--config", str(recipe), "--total-tokens", "2T"]).schedule.total_tokens == 2 * 10**12
    notebook = config_from({"data": str(mix_path), "total_tokens": "500M"})  # the notebook's keyword
    assert notebook.schedule.total_tokens == 500 * 10**6
    assert config_from({"data": str(mix_path), "total_tokens": 11e9}).schedule.total_tokens == 11 * 10**9
    for bad, why in (("2.5", "'2.5': not a whole number"), (1.5, "1.5: not a whole number"),
                     ("lots", "'lots': not a number"), (float("inf"), "inf: not a finite number")):
        with pytest.raises(UsageError) as e:
            config_from({"data": str(mix_path), "total_tokens": bad})
        assert str(e.value).startswith(f"--total-tokens {why}"), str(e.value)
    recipe.write_text(json.dumps({"data": str(mix_path), "eval_tokens": "1.5e0", "eval_every_steps": 5}))
    with pytest.raises(UsageError, match=r"--eval-tokens '1.5e0': not a whole number"):
        resolve_config(["--config", str(recipe)])


def test_plan_and_preflight_read_token_counts_with_the_same_parser(mix_path):
    opts, rest = preflight_args(["--stage", "v1", "--data", str(mix_path), "--total-tokens", "11B"])
    assert resolve_config(rest).schedule.total_tokens == 11 * 10**9
    planned = plan_command.plan_main(["--model", "debug", "--total-tokens", "2M", "--gpus", "1", "--gpu-mem", "80"])
    assert planned["binding"] == "total_tokens" and planned["steps"] == -(-2_000_000 // planned["tokens_per_step"])
    with pytest.raises(UsageError, match=r"argument --total-tokens: '2.5': not a whole number"):
        plan_command.plan_main(["--model", "debug", "--total-tokens", "2.5"])


def test_every_int_flag_refuses_overflow_and_fractions_in_one_line():
    p = Parser(prog="zerotrain x")
    p.add_argument("--n", type=int)
    p.add_argument_group("g").add_argument("--m", type=int)
    assert p.parse_args(["--n", "1e3", "--m", "-7"]).__dict__ == {"n": 1000, "m": -7}
    for argv, message in ((["--m", "1e400"], "argument --m: '1e400': too large"),
                          (["--n", "2.5"], "argument --n: '2.5': not a whole number"),
                          (["--n", "x"], "argument --n: invalid int value: 'x'")):
        with pytest.raises(UsageError, match=message):
            p.parse_args(argv)
    assert exact_integer(str(MAX_INT)) == MAX_INT
    with pytest.raises(ValueError, match="too large"):
        exact_integer(str(MAX_INT + 1))


@pytest.mark.parametrize("argv", [
    ["tokenizer", "train", "--data", "m.json", "--out", "o", "--vocab-size", "1e400"],
    ["tokenizer", "train", "--data", "m.json", "--out", "o", "--vocab-size", "512", "--max-documents", "2.5"],
    ["prepare", "--data", "m.json", "--out", "o", "--shard-tokens", "1e400"],
    ["prepare", "--data", "m.json", "--out", "o", "--max-tokens-per-source", "1.5e0"],
    ["data-bench", "--data", "m.json", "--tokens", "1e400"],
    ["data-bench", "--data", "m.json", "--seq-len", "99999999999999999999999"],
])
def test_data_commands_refuse_overflow_and_fractions_in_one_line(argv, tmp_path):
    from zerotrain.launcher.cli import main

    with pytest.raises(SystemExit) as end:
        main(argv)
    assert end.value.code == 2
    assert not (tmp_path / "o").exists()


def test_tokenizer_out_that_is_a_file_is_named_as_one(tmp_path, mix_path):
    from zerotrain.dataio.pipeline.commands import tokenizer_main

    out = tmp_path / "tok.json"
    out.write_text("{}")
    with pytest.raises(UsageError, match=f"--out {out}: is a file, not a directory"):
        tokenizer_main(["train", "--data", str(mix_path), "--vocab-size", "300", "--out", str(out)])
    assert out.read_text() == "{}"


@pytest.mark.launches
@pytest.mark.parametrize("argv, expected", [
    (["train", "--total-tokens", "1.5e0"], "zerotrain train: argument --total-tokens: '1.5e0': not a whole number"),
    (["plan", "--model", "debug", "--total-tokens", "1e400"], "argument --total-tokens: '1e400': too large"),
    (["preflight", "--stage", "v1", "--warmup-tokens", "2.5"], "argument --warmup-tokens: '2.5': not a whole number"),
    (["tokenizer", "train", "--data", "m.json", "--out", "o", "--vocab-size", "1e400"],
     "--vocab-size must be a positive integer, got '1e400' (too large"),
])
def test_each_surface_exits_2_with_one_line_and_no_traceback(argv, expected, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerotrain", *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == []
