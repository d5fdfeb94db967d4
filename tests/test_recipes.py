"""Every shipped recipe (recipes/*.json) resolves fully and fits its hardware, in CI, without a GPU.

Each recipe is loaded like `zerotrain train --config R` and handed to `zerotrain.launcher.trainer.dry_run`
in this process: profile, batch triple at the profile's declared world size, model, tokenizer,
data (local sources read, shards verified, the evaluation holdout carved) and the planner's
memory verdict. Nothing is built or written. A new recipe is picked up by the glob; it must say
what it is for (`description`) and fit, unless its description says "DOES NOT FIT:" and why.

Some recipes name inputs a CI machine cannot have (a gated tokenizer, shards prepared from hub
datasets): STAND_INS maps exactly those paths to small stand-ins with the properties the dry run
depends on (the tokenizer's vocabulary size; a shard directory with a manifest), and the recipe's
description must tell the user how to make the real one. Any other missing input fails the test.
Hub sources are streamed and not read at plan time; a socket guard proves the dry run is offline.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, synthetic_docs

RECIPES = sorted((REPO / "recipes").glob("*.json"))
PATH_KEYS = ("data", "tokenizer", "eval_data", "init_from")

# What the issue asked each shipped recipe to be, at its profile's world size (a drifting preset,
# profile or recipe shows here). params: as the dry run prints them (stand-in tokenizers included).
EXPECTED = {
    "a100x8-1.46b-edu-mix": dict(params=1_416_931_200, world=8, stage=2, micro=16, accum=4, seq_len=2048),
    "rtx6000ada-x2-760m": dict(params=759_743_488, world=2, stage=3, micro=8, accum=16, seq_len=2048),
    "rtx6000ada-x2-1.3b": dict(params=1_300_071_936, world=2, stage=3, micro=4, accum=32, seq_len=2048),
    "h100pcie-x8-1000usd": dict(params=12_904_828_928, world=8, stage=3, micro=8, accum=8, seq_len=2048),
    "h100pcie-x8-1000usd-optimal": dict(params=1_284_209_280, world=8, stage=3, micro=8, accum=8, seq_len=2048),
    "cpu-debug": dict(params=869_504, world=1, stage=3, micro=8, accum=1, seq_len=256),
    "a100x8-13b-offload": dict(params=12_612_817_920, world=8, stage=3, micro=4, accum=16, seq_len=2048),
    "rtx6000ada-x2-7b-offload": dict(params=6_453_727_232, world=2, stage=3, micro=2, accum=64, seq_len=2048),
    "h100x8-xlarge-32k-extend": dict(params=1_416_931_200, world=8, stage=3, micro=4, accum=1, seq_len=32768),
}


def llama3_sized_tokenizer(root: Path) -> Path:
    """A tokenizer.json with Llama 3's vocabulary size (128,000 + 256 special = 128,256) and its
    end-of-text token; the dry run needs only the size (streamed data is not tokenized then)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128_000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"]
                           + [f"<|reserved_special_token_{i}|>" for i in range(254)])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    return root


def edu_mix_shards(root: Path) -> Path:
    """`zerotrain prepare` of a small local mix with the real mix's source names and weights."""
    from zerotrain.dataio.pipeline.prepare import prepare
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    real = json.loads((REPO / "dataio" / "mixes" / "web-edu-pdf-med.json").read_text())
    src = root / "src"
    src.mkdir(parents=True)
    sources = []
    for i, s in enumerate(real["sources"]):
        with open(src / f"{s['name']}.jsonl", "w") as f:
            for doc in synthetic_docs(200, seed=10 + i, min_words=40, max_words=120):
                f.write(json.dumps({"text": doc}) + "\n")
        sources.append({"name": s["name"], "weight": s["weight"], "path": f"{s['name']}.jsonl"})
    (src / "mix.json").write_text(json.dumps({"sources": sources}))
    return prepare(str(src / "mix.json"), ByteTokenizer(), root / "shards", log=lambda *a, **k: None)


def xlarge_2k_base(root: Path) -> Path:
    """The 2k base of h100x8-xlarge-32k-extend as `zerotrain export --dtype bfloat16` leaves it: config.json of the
    `xlarge` preset (bytes tokenizer, rope base 10,000) and a model.safetensors whose header names every tensor at
    its shape, its 2.8 GB of data a sparse file of zeros that takes no disk: a dry run and the plan read config.json
    and the headers (modeling/hf.py check_weights), never the weights."""
    import math
    import struct

    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.modeling import hf
    from zerotrain.modeling.sizes import preset

    args = preset("xlarge", vocab_size=ByteTokenizer().vocab_size, max_seq_len=2048)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in hf.expected_shapes(args).items():
        size = 2 * math.prod(shape)
        header[hf.hf_name(name)] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    root.mkdir(parents=True)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    (root / "config.json").write_text(json.dumps(hf.hf_config(args, dtype="bfloat16")))
    return root


STAND_INS = {
    "data/llama-3-tokenizer": llama3_sized_tokenizer,
    "data/web-edu-pdf-med-bytes": edu_mix_shards,
    "data/xlarge-2k-base": xlarge_2k_base,
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand-ins")
    return {name: make(root / name.replace("/", "_")) for name, make in STAND_INS.items()}


@pytest.fixture(scope="module")
def demo_data():
    """The demo's data (dataio/mixes/demo.json points at it): built as `make demo` builds it."""
    from zerotrain.launcher.commands.demo import build_demo_data

    return build_demo_data(REPO / "runs" / "demo-data")


def recipe_values(path: Path, stand_ins: dict) -> dict:
    from zerotrain.launcher.config import load_recipe

    values = load_recipe(str(path))
    for key in PATH_KEYS:
        value = values.get(key)
        if isinstance(value, str) and value != "bytes" and not (REPO / value).exists() and value in stand_ins:
            assert value in values.get("description", ""), \
                f"{path.name}: {key} {value} is not shipped; its description must say how to make it"
            values[key] = str(stand_ins[value])
    return values


@pytest.fixture
def offline(monkeypatch):
    """Every name lookup or connection (the hub, W&B) is refused and recorded: recipes must resolve
    offline. Recorded, not only refused, because `datasets` catches and retries network errors."""
    attempts = []

    def refuse(*args):
        attempts.append(args[-1] if len(args) == 2 else args[:2])
        raise OSError("no network in a dry run")

    # datasets (5.2) sends a download-count HEAD to S3 on every load_dataset of a LOCAL file
    # (load.py increase_load_count; failures swallowed, 3 s timeout): not a read of data, so it is
    # switched off here, exactly, and everything else stays refused.
    import datasets

    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the profile's declared world, not a launcher's
    return attempts


def test_recipes_are_shipped():
    assert {p.stem for p in RECIPES} >= set(EXPECTED)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_resolves_and_fits(path, stand_ins, demo_data, offline, tmp_path, monkeypatch, capsys):
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.trainer import dry_run

    monkeypatch.chdir(REPO)  # recipes name paths as a user at the repository root types them
    values = recipe_values(path, stand_ins)
    description = values.get("description")
    assert isinstance(description, str) and len(description) > 40, f"{path.name}: say what the recipe is for"
    out = tmp_path / "runs"
    # As `--dry-run` sets it: plan_run then leaves out the fit check against THIS machine's memory; the
    # verdict that matters is the planner's for the profile's hardware (result.extra["fits"]).
    # out is a RUN field: the same run id, and nothing of an earlier local run to resume or drift from.
    cfg = config_from({**values, "dry_run": True, "out": str(out)})

    result = dry_run(cfg)
    printed = capsys.readouterr().out

    # The one network use a dry run has: asking the hub whether each streamed source exists. Refused
    # here, it is a warning line (a dry run is often made where there is no network), never a refusal.
    assert set(offline) <= {("huggingface.co", 443)}, f"the dry run tried the network: {offline}"
    if offline:
        assert "not checked: the hub cannot be reached from here" in printed, printed
    assert result.exit_code == 0 and result.stop == "dry-run"
    assert not out.exists(), "a dry run wrote something"
    marker = re.search(r"DOES NOT FIT:\s*(.*)", description)
    if marker:  # a recipe kept on purpose although the planner refuses it must say why
        assert len(marker.group(1)) > 20 and result.extra["fits"] is False, printed
    else:
        assert result.extra["fits"] is True, f"{path.name} no longer fits its hardware:\n{printed}"
    ds = result.extra["ds_config"]
    world = result.extra["world"]
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    if cfg.schedule.global_batch_tokens is not None:
        assert ds["train_batch_size"] * cfg.data.seq_len == cfg.schedule.global_batch_tokens

    expected = EXPECTED.get(path.stem)
    if expected:
        params = int(re.search(r"model \S+: ([\d,]+) parameters", printed).group(1).replace(",", ""))
        got = dict(params=params, world=world, stage=ds["zero_optimization"]["stage"],
                   micro=ds["train_micro_batch_size_per_gpu"], accum=ds["gradient_accumulation_steps"],
                   seq_len=cfg.data.seq_len)
        assert got == expected


def test_optimal_recipe_is_the_planners_compute_optimal_size(capsys, monkeypatch):
    """h100pcie-x8-1000usd-optimal spends the same budget on the depth closest to the size the
    planner calls compute-optimal for h100pcie-x8-1000usd; its max_steps is what the budget buys."""
    from zerotrain.launcher.config import load_recipe
    from zerotrain.launcher.commands.plan import plan_main
    from zerotrain.modeling.model import count_params
    from zerotrain.modeling.sizes import depth_args

    monkeypatch.chdir(REPO)
    plan_main(["--config", "recipes/h100pcie-x8-1000usd.json", "--json"])
    target = json.loads(capsys.readouterr().out)["compute_optimal"]["params"]
    plan_main(["--config", "recipes/h100pcie-x8-1000usd-optimal.json", "--json"])
    optimal_plan = json.loads(capsys.readouterr().out)

    base, optimal = (load_recipe(f"recipes/h100pcie-x8-{n}.json") for n in ("1000usd", "1000usd-optimal"))
    for key in ("profile", "aspect_ratio", "head_dim", "tokenizer", "data", "seq_len", "budget_usd", "gpu_hour_usd"):
        assert optimal[key] == base[key], key

    def size(depth):
        return count_params(depth_args(depth, optimal["aspect_ratio"], optimal["head_dim"], vocab_size=258,
                                       max_seq_len=optimal["seq_len"]))["total"]

    depth = optimal["depth"]
    assert all(abs(size(depth) - target) < abs(size(d) - target) for d in (depth - 1, depth + 1))
    assert optimal_plan["binding"] == "budget_usd" and optimal_plan["steps"] == optimal["max_steps"]


def test_cpu_debug_is_the_demo():
    """recipes/cpu-debug.json says what `make demo` runs: the same flags, the same mix."""
    from zerotrain.launcher.config import load_recipe
    from zerotrain.launcher.config_resolve import build_parser
    from zerotrain.launcher.commands.demo import DEMO_FLAGS

    recipe = load_recipe(str(REPO / "recipes" / "cpu-debug.json"))
    demo = {k: v for k, v in vars(build_parser().parse_args(["--data", "x", *DEMO_FLAGS])).items()
            if v is not None and k not in ("data", "config")}
    assert {k: recipe[k] for k in demo} == demo
    mix = json.loads((REPO / recipe["data"]).read_text())
    assert [(s["name"], s["weight"], Path(s["path"]).name, s.get("sample_by")) for s in mix["sources"]] == \
        [("docs", 0.7, "docs.jsonl", None), ("code", 0.3, "code.txt", "paragraph")]
    assert all((REPO / "dataio" / "mixes" / s["path"]).resolve().parent == REPO / "runs" / "demo-data"
               for s in mix["sources"])


def test_the_demo_mix_without_its_files_says_how_to_make_them(tmp_path):
    """From a wheel the shipped demo mix points into site-packages, where no demo data is: the one line names
    the missing file and, from the mix's description, the step a newcomer is missing (`zerotrain demo`, then
    --data runs/demo-data/mix.json). A mix without a description keeps the bare line."""
    from zerotrain.dataio.format.errors import DataNotHere
    from zerotrain.dataio.format.mix import parse_mix

    shipped = json.loads((REPO / "dataio" / "mixes" / "demo.json").read_text())
    (tmp_path / "dataio" / "mixes").mkdir(parents=True)  # as in site-packages/zerotrain/: no runs/ beside it
    mix = tmp_path / "dataio" / "mixes" / "demo.json"
    mix.write_text(json.dumps(shipped))
    with pytest.raises(DataNotHere) as e:
        parse_mix(mix)
    line = str(e.value)
    assert "\n" not in line and f"data file {tmp_path / 'runs' / 'demo-data' / 'docs.jsonl'} does not exist" in line
    assert "run `zerotrain demo` first and pass --data runs/demo-data/mix.json" in line
    mix.write_text(json.dumps({k: v for k, v in shipped.items() if k != "description"}))
    with pytest.raises(DataNotHere) as e:
        parse_mix(mix)
    assert str(e.value).endswith("docs.jsonl does not exist")


@pytest.mark.launches
@pytest.mark.parametrize("name", ["rtx6000ada-x2-760m", "rtx6000ada-x2-1.3b"])
def test_workstation_recipes_launch_with_expandable_segments(name, tmp_path, monkeypatch):
    """The launch each description gives puts the allocator setting into every rank's environment
    (from the profile's zerotrain.env; a value set in the launching shell would win)."""
    from zerotrain.launcher.commands.launch import plan_hostfile_launch

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    assert "`localhost slots=2`" in json.loads((REPO / "recipes" / f"{name}.json").read_text())["description"]
    launch = plan_hostfile_launch(["--hostfile", str(hosts), "--", "--config", f"recipes/{name}.json"])
    assert launch.rank_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_docs_list_every_recipe():
    text = (REPO / "docs" / "profiles.md").read_text()
    section = text[text.index("# Recipes"):]
    assert all(f"recipes/{p.name}" in section for p in RECIPES)


def zerotrain(*args, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.mark.launches
def test_dry_run_command_prints_the_resolved_recipe(tmp_path):
    """`zerotrain train --config R --dry-run`: exit 0, the batch triple and the verdict, nothing written."""
    r = zerotrain("train", "--config", "recipes/a100x8-1.46b-edu-mix.json", "--dry-run", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "profile a100-80g-x8, world 8, ZeRO-2, batch 16 x 4 x 8 x 2048 = 1,048,576 tokens per step" in r.stdout
    assert "model xlarge: 1,416,931,200 parameters" in r.stdout and "\nplan: fits:" in r.stdout
    # the run in tokens, as the plan it was built from: 11B tokens, a 100M-token warmup
    assert ("warmup-steps 96 (rule: --warmup-tokens / tokens per step), max-steps 10491 (rule: --total-tokens /"
            " tokens per step)") in r.stdout
    assert ("run length: --total-tokens 11,000,000,000 -> 10,491 steps of 1,048,576 tokens per step = 11,000,610,816"
            " tokens") in r.stdout
    assert "cosine decay to 3e-05 at step 10491" in r.stdout and "this run reads 11,000,610,816 tokens" in r.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.launches
def test_recipe_with_unknown_key_is_refused_in_one_line(tmp_path):
    recipe = json.loads((REPO / "recipes" / "cpu-debug.json").read_text())
    recipe["save_every_step"] = 100  # a typo of save_every_steps: never silently ignored
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps(recipe))
    r = zerotrain("train", "--config", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"zerotrain: error: recipe {bad}: unknown key 'save_every_step'"]
    assert not (tmp_path / "o").exists()


def test_context_extension_recipe_is_the_planners(stand_ins, monkeypatch, capsys):
    """h100x8-xlarge-32k-extend: `zerotrain plan` of the recipe fits with flex and activation checkpointing and
    gives the figures its description quotes; the planner accepts only N = 1 for xlarge's 15 heads on 8 GPUs
    (the recipe's choice) and refuses any other N in one line, as the run would; without activation
    checkpointing 32k does not fit. The base's rope and shape come from --init-from, the new base from the recipe."""
    from zerotrain.launcher import model_spec
    from zerotrain.launcher.commands.plan import plan_main
    from zerotrain.launcher.config import load_recipe
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.errors import UsageError

    monkeypatch.chdir(REPO)
    base = str(stand_ins["data/xlarge-2k-base"])
    argv = ["--config", "recipes/h100x8-xlarge-32k-extend.json", "--init-from", base, "--data", "(planned)"]
    plan_main([*argv, "--json"])
    p = json.loads(capsys.readouterr().out)
    sp = p["sequence_parallel"]
    assert p["fits"] and p["attention"] == "flex" and p["activation_checkpointing"] and p["zero_stage"] == 3
    assert p["params_total"] == 1_416_931_200 and p["tokens_per_step"] == 2**20 and p["steps"] == 1908
    assert sp["size"] == 1 and sp["valid_sizes"] == [1] and sp["max_seq_len"] >= 32768
    description = load_recipe("recipes/h100x8-xlarge-32k-extend.json")["description"]
    for quoted in (f"needs {p['memory_per_gpu_gib']:.1f} GiB per GPU", f"largest micro-batch {p['max_micro_batch']}",
                   f"micro-batch 1 is {sp['max_seq_len']:,} positions", f"{p['hours']:.1f} h at the profile's MFU"):
        assert quoted in description, quoted
    plan_main([*argv, "--json", "--no-activation-checkpointing", "--micro-batch", "1"])
    without = json.loads(capsys.readouterr().out)
    assert not without["fits"] and f"one 32k row needs {without['memory_per_gpu_gib']:.0f} GiB" in description
    for n in (2, 8):
        with pytest.raises(UsageError, match=rf"^--sequence-parallel {n} \(flag\): sequence parallelism over {n} ranks"
                                             rf" needs attention heads divisible by {n}; the model has 15$"):
            plan_main([*argv, "--sequence-parallel", str(n)])
    values = {**load_recipe("recipes/h100x8-xlarge-32k-extend.json"), "init_from": base}
    args, _, init_from = model_spec.resolve(config_from(values), 258)
    assert (args.rope_theta, args.n_heads, args.dim, init_from) == (500000.0, 15, 1920, base)


@pytest.mark.launches
def test_shipped_recipes_resolve_their_files_from_the_package_from_any_directory(tmp_path, demo_data):
    """`--config NAME` from a directory that is not the checkout: the recipe's mix is the installed package's
    (zerotrain.resource_dir), not a "no such file"; the demo mix's sources are the checkout's runs/demo-data (an
    editable install: the package is the checkout; tests/test_packaging.py runs the same from a wheel)."""
    from zerotrain import resource_dir

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, mix in (("a100x8-1.46b-edu-mix", "web-edu-pdf-med.json"), ("cpu-debug", "demo.json")):
        r = zerotrain("train", "--config", name, "--dry-run", "--out", str(tmp_path / "o"), cwd=elsewhere)
        assert r.returncode == 0, r.stderr
        assert f"data: mix {resource_dir('zerotrain.dataio', 'mixes', mix)}," in r.stdout
    assert not (tmp_path / "o").exists() and list(elsewhere.iterdir()) == []


def test_a_recipe_given_by_path_resolves_against_its_own_directory_first(tmp_path, mix_path, monkeypatch):
    """A recipe file's relative inputs: next to the file first, then the working directory; absolute paths, hub
    names, `bytes` and the place a run writes (`out`) are left as they are."""
    from zerotrain.launcher.config import load_recipe

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "mix.json").write_text(mix_path.read_text())
    recipe = project / "recipe.json"
    recipe.write_text(json.dumps({"data": "data/mix.json", "tokenizer": "bytes", "out": "data", "profile": "cpu",
                                  "init_from": "org/model"}))
    cwd = tmp_path / "cwd"
    (cwd / "data").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    values = load_recipe(str(recipe))
    assert values["data"] == str(project / "data" / "mix.json")  # the file's directory wins over the cwd's data/
    assert (values["tokenizer"], values["out"], values["profile"], values["init_from"]) == \
        ("bytes", "data", "cpu", "org/model")
    (project / "data" / "mix.json").unlink()
    (cwd / "data" / "mix.json").write_text("{}")
    assert load_recipe(str(recipe))["data"] == "data/mix.json"  # then the working directory, as given
