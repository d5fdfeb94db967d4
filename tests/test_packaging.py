"""zerotrain as a user installs it: a wheel built from this checkout, installed (not editable)
into a fresh virtual environment, run from a project directory that has its own `modeling/`, `launcher/`
and `dataio/` packages.

The fresh environment gets the test environment's dependencies through a .pth file (nothing is
downloaded) but not its editable zerotrain: a .pth file in a directory that is itself added by a .pth
file is not processed, so the editable install's finder never loads there and every `zerotrain`
import resolves to the wheel's copy in the fresh site-packages.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, write_mix

PACKAGE_DIRS = {"zerotrain": "zerotrain", "zerotrain.launcher": "launcher", "zerotrain.modeling": "modeling",
                "zerotrain.dataio": "dataio", "zerotrain.ds_configs": "ds_configs", "zerotrain.recipes": "recipes"}


def test_setup_cfg_lists_every_package_and_maps_the_folders():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
    assert mapping == PACKAGE_DIRS
    on_disk = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([package, *rel.parts]))
    assert on_disk == listed, f"setup.cfg packages: missing {sorted(on_disk - listed)}, extra {sorted(listed - on_disk)}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin, user project dir, wheel path): the wheel is built once for the module."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy of the checkout without build leftovers (what a clean clone holds)
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(src)], check=True)
    for path in subprocess.run(["git", "-C", str(REPO), "ls-files", "--others", "--exclude-standard", "--modified"],
                               capture_output=True, text=True, check=True).stdout.split():
        if (REPO / path).is_file():  # uncommitted work is part of what is tested
            (src / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, src / path)
    for path in subprocess.run(["git", "-C", str(REPO), "ls-files", "--deleted"],
                               capture_output=True, text=True, check=True).stdout.split():
        (src / path).unlink(missing_ok=True)
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    wheel = next(dist.glob("zerotrain-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True)
    project = root / "userproj"  # a typical ML project: its own packages with our folder names
    (project / "modeling").mkdir(parents=True)
    (project / "modeling" / "__init__.py").write_text("")
    (project / "modeling" / "model.py").write_text("class MyModel:  # the user's, not ours\n    pass\n")
    for pkg in ("launcher", "dataio"):
        (project / pkg).mkdir()
        (project / pkg / "__init__.py").write_text(f"raise ImportError('the user\\'s own {pkg} was imported')\n")
    write_mix(project / "data")
    return py, venv / "bin", project, wheel


def run(cmd, project, timeout=600, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update({"OMP_NUM_THREADS": "1", "PATH": str(Path(cmd[0]).parent) + ":/usr/bin:/bin", **env})
    return subprocess.run([str(c) for c in cmd], cwd=project, capture_output=True, text=True, timeout=timeout,
                          env=environ)


@pytest.mark.launches
def test_wheel_ships_the_profiles_recipes_and_templates(installed):
    names = set(zipfile.ZipFile(installed[3]).namelist())
    for shipped in [*(REPO / "ds_configs").glob("*.json"), *(REPO / "recipes").glob("*.json"),
                    *(REPO / "recipes" / "eval_tasks").glob("*.*"),  # the shipped lm-eval tasks and their data
                    *(REPO / "launcher" / "accelerate").glob("*.yaml"), REPO / "launcher" / "slurm" / "train.sbatch",
                    *(REPO / "dataio" / "mixes").glob("*.json"), REPO / "modeling" / "scaling_rules.yaml"]:
        rel = shipped.relative_to(REPO).as_posix()
        assert f"zerotrain/{rel}" in names, f"{rel} is not in the wheel"
    assert not any(n.split("/")[0] in ("launcher", "modeling", "dataio") for n in names)  # nothing top-level


@pytest.mark.launches
def test_installed_commands_from_a_project_with_its_own_packages(installed, tmp_path):
    py, bin_dir, project, _ = installed
    profiles = sorted(p.stem for p in (REPO / "ds_configs").glob("*.json"))
    for cmd in ([bin_dir / "zerotrain", "profiles"], [py, "-m", "zerotrain", "profiles"]):
        proc = run(cmd, project)
        assert proc.returncode == 0, proc.stderr
        assert [line.split()[0] for line in proc.stdout.splitlines()] == profiles
    proc = run([py, "-m", "zerotrain", "--version"], project)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("zerotrain ")
    where = run([py, "-c", "import zerotrain.launcher, modeling.model as m; print(zerotrain.launcher.__file__);"
                 " print(m.MyModel.__module__)"], project)
    assert where.returncode == 0, where.stderr
    ours, theirs = where.stdout.split()
    assert Path(ours).is_relative_to(py.parent.parent) and theirs == "modeling.model"  # both, side by side
    proc = run([bin_dir / "zerotrain", "train", "--profile", "a100-80g-x8", "--model", "tiny", "--seq-len", "256",
                "--data", "data/mix.json", "--out", str(tmp_path / "dry"), "--dry-run"], project)
    assert proc.returncode == 0, proc.stderr
    assert "a100-80g-x8" in proc.stdout
    assert not (tmp_path / "dry").exists()


@pytest.mark.launches
def test_installed_shipped_recipe_resolves_its_mix_from_the_wheel(installed, tmp_path):
    """`zerotrain train --config a100x8-1.46b-edu-mix --dry-run` from the user's project (no dataio/mixes there):
    the recipe's mix is the wheel's copy in site-packages."""
    py, bin_dir, project, _ = installed
    proc = run([bin_dir / "zerotrain", "train", "--config", "a100x8-1.46b-edu-mix", "--dry-run", "--out",
                str(tmp_path / "o")], project)
    assert proc.returncode == 0, proc.stderr
    mix = next(line for line in proc.stdout.splitlines() if line.startswith("data: mix "))
    path = Path(mix.removeprefix("data: mix ").split(",")[0])
    assert path.is_relative_to(py.parent.parent) and path.parts[-4:] == ("zerotrain", "dataio", "mixes",
                                                                          "web-edu-pdf-med.json"), mix
    assert not (tmp_path / "o").exists()


@pytest.mark.launches
def test_installed_training_run_and_demo(installed, tmp_path):
    """One process trains 3 steps; `zerotrain demo` (2 ranks under DeepSpeed's runner, the module form)
    trains 3 steps; both from the user's project directory, with the wheel's code."""
    py, bin_dir, project, _ = installed
    out = tmp_path / "runs"
    proc = run([bin_dir / "zerotrain", "train", "--profile", "cpu", "--model", "debug", "--seq-len", "64",
                "--micro-batch", "2", "--data", "data/mix.json", "--out", str(out), "--run-id", "one",
                "--max-steps", "3", "--save-every-steps", "3"], project)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "one" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2, 3]
    proc = run([bin_dir / "zerotrain", "demo", "--max-steps", "3", "--save-every-steps", "3", "--seq-len", "64"],
               project, ZEROTRAIN_DEMO_DIR=str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--module zerotrain.launcher.train" in proc.stdout
    (run_dir,) = [p for p in (tmp_path / "demo").iterdir() if p.name.startswith("demo-2")]
    assert (run_dir / "checkpoints" / "global_step3" / "zerotrain.json").is_file()


# import name -> the distribution that provides it, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "cpuinfo": "py-cpuinfo"}
# guarded imports of packages an optional extra installs (a run needing one refuses in one line without it)
OPTIONAL = {"lm_eval"}  # zerotrain[eval]: --eval-tasks (launcher/components/tasks/)


def test_every_imported_package_is_declared_and_python_requires_is_honest():
    import ast

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    declared = {line.split(">")[0].split("=")[0].split("<")[0].strip().lower().replace("_", "-")
                for line in cfg["options"]["install_requires"].split("\n") if line.strip()}
    imported = set()
    for folder in PACKAGE_DIRS.values():
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "zerotrain"} - OPTIONAL
    missing = {m for m in third_party if DISTRIBUTION.get(m, m).lower().replace("_", "-") not in declared}
    assert not missing, f"imported but not in install_requires: {sorted(missing)}"
    extras = {line.split(">")[0].split("=")[0].strip().replace("-", "_") for line in
              cfg["options.extras_require"]["eval"].split("\n") if line.strip() and not line.strip().startswith("#")}
    assert OPTIONAL <= extras and OPTIONAL <= imported  # each declared in the eval extra, and still used
    assert not OPTIONAL & {d.replace("-", "_") for d in declared}  # never in the base install
    # hashlib.file_digest (checkpoints, shards) is Python 3.11+
    assert cfg["options"]["python_requires"].strip() == ">=3.11"
