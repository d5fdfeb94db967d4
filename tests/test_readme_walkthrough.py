"""The README's "Your first real run" walkthrough, run in its CPU form, so the guide cannot rot.

Every command of that section (its bash blocks, and the `zerotrain ...` commands quoted inline) is taken
from README.md itself and run after a fixed set of CPU substitutions: the GPU profile becomes `cpu`, the
1.4B preset `debug`, 8 GPUs 2 CPU ranks, 27,000 steps 4, and the section's mix file (a Hub source) is
replaced by a local mix of the same shape. A command that changes in the README changes here; a
command the code no longer accepts fails here.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, free_port, write_mix

SECTION = ("## Your first real run", "## Fine-tune a model")
# README text -> its CPU form (applied in order, as whole words)
CPU_FORM = [
    ("a100-80g-x8", "cpu"), ("--model xlarge", "--model debug"), ("--seq-len 2048", "--seq-len 64"),
    ("launch -n 8", "launch -n 2"), ("--num_gpus 8", "--num_gpus 2"), ("--vocab-size 32000", "--vocab-size 300"),
    ("--max-steps 27000", "--max-steps 4"), ("--save-every-steps 1000", "--save-every-steps 2"),
    ("--eval-every-steps 1000", "--eval-every-steps 2"), ("--eval-tokens 1000000", "--eval-tokens 1500"),
    ("--stage v1,v2,v3", "--stage v1 --steps 4"), ("--keep-last 5", "--keep-last 2"),
]


def walkthrough_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION[0]):text.index(SECTION[1])]
    commands = []
    for m in re.finditer(r"```bash\n(.*?)```|`(zerotrain [^`]+)`", section, re.S):
        if m.group(1) is not None:  # a bash block: one command per line, `\` continues it
            commands += [c.strip() for c in m.group(1).replace("\\\n", " ").splitlines()
                         if c.strip() and not c.strip().startswith("#")]
        elif not m.group(2).endswith("..."):
            commands.append(m.group(2))
    return list(dict.fromkeys(commands))


def cpu_form(command: str, run_id: str | None) -> list[str]:
    for readme, cpu in CPU_FORM:
        command = re.sub(rf"(?<![\w-]){re.escape(readme)}(?![\w-])", cpu, command)
    if run_id is not None:
        command = command.replace("RUN_ID", run_id)
    argv = shlex.split(command)
    if argv[0] == "zerotrain":
        return [sys.executable, "-m", "zerotrain", *argv[1:]]
    if argv[0] == "deepspeed":  # a port of its own: DeepSpeed's default 29500 is held by the suite (tests/conftest.py)
        port = [] if "--master_port" in argv else ["--master_port", str(free_port())]
        return [sys.executable, "-m", "deepspeed.launcher.runner", *port, *argv[1:]]
    return argv


def test_the_commands_are_found():
    commands = walkthrough_commands()
    verbs = [c.split()[1] if c.startswith("zerotrain") else c.split()[0] for c in commands]
    for verb in ("tokenizer", "profiles", "plan", "train", "deepspeed", "launch", "runs", "report", "export"):
        assert verb in verbs, f"the walkthrough lost its `{verb}` step: {commands}"


@pytest.mark.launches
def test_walkthrough_runs_in_its_cpu_form(tmp_path):
    text = (REPO / "README.md").read_text()
    readme_mix = json.loads(re.search(r"```json\n(.*?)```", text[text.index(SECTION[0]):], re.S).group(1))
    assert [s["weight"] for s in readme_mix["sources"]] == [0.8, 0.2]
    local = write_mix(tmp_path / "data", weights=(0.8, 0.2))  # the same shape, local files, no network
    (tmp_path / "mix.json").write_text(json.dumps(
        {"sources": [{**s, "path": str(local.parent / s["path"])} for s in json.loads(local.read_text())["sources"]]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore"}
    run_id = None
    for command in walkthrough_commands():
        if "runs/RUN_ID" in command and run_id is None:
            (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if (p / "config.json").is_file()]
            run_id = run_dir.name
        argv = cpu_form(command, run_id)
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n -> {shlex.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert (tmp_path / "exported" / "config.json").is_file()


@pytest.mark.parametrize("command", ["zerotrain launch -n 8 --max-restarts 3 -- --profile a100-80g-x8"])
def test_cpu_form_substitutions(command):
    assert cpu_form(command, None)[3:] == ["launch", "-n", "2", "--max-restarts", "3", "--", "--profile", "cpu"]
