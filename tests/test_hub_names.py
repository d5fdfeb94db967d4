"""Hugging Face hub names resolve as they do everywhere else (zerotrain.dataio.sources.hub).

Nothing is downloaded: each test builds a Hugging Face cache on disk by hand, in the layout `hf download`
leaves (models--org--name/snapshots/<commit>/..., refs/main; datasets--owner--name/... for a dataset,
tests/test_data_local_hub.py `fake_hub_cache`), and runs zerotrain in a fresh process with
HF_HUB_OFFLINE=1 and HF_HOME / HF_HUB_CACHE pointing there (huggingface_hub reads them at import, as a
user's shell sets them). One 1-rank run trains with `--tokenizer org/name` found only in that cache; its
export copies the tokenizer (chat template included), shards at --max-shard-size 1MB and checks itself.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, launch, read_metrics, synthetic_docs
from test_data_local_hub import fake_hub_cache
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.sources.tokenizer import train_bpe

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
DATASET_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # fake_hub_cache's
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
TRAIN = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--warmup-steps", "1"]


def tokenizer_cache(hub: Path, repo: str = "org/name", commit: str = COMMIT) -> Path:
    """A byte-level BPE with a chat template as the hub cache holds `repo` at `commit` (refs/main)."""
    top = hub / f"models--{repo.replace('/', '--')}"
    snap = top / "snapshots" / commit
    train_bpe(synthetic_docs(300, seed=5), 300, snap)
    (snap / "chat_template.jinja").write_text(CHAT)
    (top / "refs").mkdir(parents=True, exist_ok=True)
    (top / "refs" / "main").write_text(commit)
    return snap


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # Llama 3.2's numbers, the original context shrunk to 32 positions


def model_cache(hub: Path, repo: str, commit: str = COMMIT) -> Path:
    """A model as the hub cache holds `repo` at `commit`: what `hf download` leaves (config.json,
    generation_config.json, model.safetensors, written by transformers itself) and a tokenizer (tokenizer_cache's),
    refs/main naming the commit. org/qwen: a Qwen3ForCausalLM (QK-norm, head_dim 16 = 2 x hidden / heads, tied);
    org/llama32: a Llama 3.2-like LlamaForCausalLM (llama3 RoPE scaling, head_dim 16 = 2 x hidden / heads, tied)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    snap = tokenizer_cache(hub, repo, commit)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=320, tie_word_embeddings=True, max_position_embeddings=128)
    config = Qwen3Config(**shape) if repo == "org/qwen" else \
        LlamaConfig(**shape, rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(snap)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory, mix_path):
    """HF_HOME with a tokenizer and a dataset in its hub cache, and mixes naming hub sources."""
    root = tmp_path_factory.mktemp("hub")
    tokenizer_cache(root / "hf" / "hub")
    model_cache(root / "hf" / "hub", "org/qwen")
    model_cache(root / "hf" / "hub", "org/llama32")
    fake_hub_cache(root / "hf" / "hub")  # owner/name: README configs, sample/10BT/ 2 parquet files x 200 records
    mixes = {"hub": [{"name": "edu", "weight": 0.5, "hf": "owner/name", "config": "sample-10BT", "download": True},
                     {"name": "web", "weight": 0.2, "hf": "owner/name", "config": "sample-10BT"},
                     {"name": "prose", "weight": 0.3, "path": str(mix_path.parent / "prose.jsonl")}],
             "absent": [{"name": "gone", "weight": 1, "hf": "owner/absent"}],
             "absent-download": [{"name": "gone", "weight": 1, "hf": "owner/absent", "download": True}]}
    for name, sources in mixes.items():
        (root / f"{name}.json").write_text(json.dumps({"sources": sources}))
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf"), "HF_DATASETS_CACHE": str(root / "ds")}
    for var in ("HF_HUB_CACHE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        env[var] = ""  # not the machine's own: HF_HOME decides (an empty value is unset to huggingface_hub)
    return root, env


def zerotrain(args: list[str], env: dict, cwd=REPO) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in {**os.environ, "OMP_NUM_THREADS": "1", **env}.items() if v != ""}
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], capture_output=True, text=True, cwd=cwd,
                          env=environ, timeout=600)


def one_error_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "[WARNING]" not in ln]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("zerotrain: error:"), proc.stderr[-2000:]
    return lines[0]


@pytest.mark.launches
def test_a_tokenizer_only_in_the_hf_cache_trains_offline_and_exports(hub, tmp_path):
    """`--tokenizer org/name`, present only in HF_HOME's hub cache, with HF_HUB_OFFLINE=1: a short 1-rank run
    trains on a mix whose "download": true source is its cached snapshot (counted and held out like local
    files), records the tokenizer pinned to its commit; `zerotrain export --max-shard-size 1MB` resolves it
    again, copies its files and chat template, writes several shards and an index transformers loads,
    and prints the check's figure (the loss on the documents the run held out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, env = hub
    out = tmp_path / "runs"
    proc = launch("python", ["--data", str(root / "hub.json"), "--tokenizer", "org/name", "--out", str(out),
                             "--run-id", "hubtok", *TRAIN, "--max-steps", "3", "--eval-every-steps", "3",
                             "--eval-tokens", "2000"],
                  env_extra={k: v for k, v in env.items() if v}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads((out / "hubtok" / "config.json").read_text())
    assert saved["tokenizer"] == f"org/name@{COMMIT}" and saved["model"]["vocab_size"] == 320
    edu = next(s for s in saved["sources"] if s["name"] == "edu")
    assert edu["hub"] == "owner/name" and edu["hf"].endswith(f"datasets--owner--name/snapshots/{DATASET_COMMIT}")
    assert re.search(r"edu +weight +50\.0% +~[\d,]+ tokens +~[\d.]+ epochs", proc.stdout), proc.stdout[-3000:]
    metrics = read_metrics(out / "hubtok")
    assert [m["step"] for m in metrics] == [1, 2, 3] and "edu" in metrics[-1]["val_loss_per_source"]

    hf_dir = tmp_path / "hf"
    proc = zerotrain(["export", str(out / "hubtok"), "--to", str(hf_dir), "--max-shard-size", "1MB"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shards = sorted(hf_dir.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and all(s.stat().st_size < 1_100_000 for s in shards), shards
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    check = re.search(r"check: loss on ([\d,]+) tokens of the documents the run held out of .*: checkpoint \(fp32,"
                      r" zerotrain\) ([\d.]+), export \(float32, transformers\) ([\d.]+), relative difference"
                      r" (\S+) \(within the float32 tolerance 0.0001\)", proc.stdout)
    assert check, proc.stdout[-2000:]
    assert float(check.group(4)) < 1e-4 and check.group(4) in (hf_dir / "README.md").read_text()
    snapshot = root / "hf" / "hub" / "models--org--name" / "snapshots" / COMMIT
    for name in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (hf_dir / name).read_bytes() == (snapshot / name).read_bytes(), name
    given = json.loads((snapshot / "tokenizer_config.json").read_text())  # with the trained context as its length
    assert json.loads((hf_dir / "tokenizer_config.json").read_text()) == {**given, "model_max_length": 64}
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template == CHAT and tokenizer.model_max_length == 64
    card = (hf_dir / "README.md").read_text()  # the tokenizer as given, pinned; no path
    assert f"- tokenizer: `org/name` from the Hugging Face Hub (`org/name@{COMMIT}`; vocabulary 300," in card
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id is not None


@pytest.mark.launches
def test_init_from_a_hub_name_in_the_cache_dry_runs_trains_and_exports_back(hub, mix_path, tmp_path):
    """`--init-from org/qwen` (Qwen3) and `org/llama32` (Llama 3.2-like), present only in HF_HOME's hub cache,
    offline: the dry run and a short 1-process ZeRO-3 run each (the cpu profile) take the model and its tokenizer
    from the cached snapshot (the tokenizer recorded pinned to the commit); the checked export is the architecture
    it came from, with its head_dim and RoPE parameters. A name the cache lacks is one line naming the
    command that fetches it, and nothing is written."""
    root, env = hub
    snap = root / "hf" / "hub" / "models--org--qwen" / "snapshots" / COMMIT
    out = tmp_path / "runs"
    common = ["--data", str(mix_path), "--out", str(out), "--seq-len", "64", "--micro-batch", "2",
              "--warmup-steps", "1", "--max-steps", "2", "--lr", "1e-3"]
    line = one_error_line(zerotrain(["train", "--init-from", "org/absent", *common, "--dry-run"], env))
    assert line == (f"zerotrain: error: --init-from org/absent: no such directory; as a hub model org/absent: not in"
                    f" the Hugging Face cache ({root / 'hf' / 'hub'}) and offline mode is on: `hf download org/absent"
                    " --include config.json generation_config.json '*.safetensors' model.safetensors.index.json"
                    " tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json"
                    " chat_template.jinja` on a machine with network into the same HF_HOME / HF_HUB_CACHE, or unset"
                    " HF_HUB_OFFLINE")
    part = tokenizer_cache(root / "hf" / "hub", "org/toks")  # a snapshot fetched in part: its tokenizer alone
    line = one_error_line(zerotrain(["train", "--init-from", "org/toks", *common, "--dry-run"], env))
    assert line == (f"zerotrain: error: --init-from org/toks: no config.json (not a Hugging Face model directory) in"
                    f" its cached snapshot {part} (fetched in part, e.g. its tokenizer alone): `hf download org/toks"
                    " --include config.json generation_config.json '*.safetensors' model.safetensors.index.json"
                    " tokenizer.json tokenizer_config.json special_tokens_map.json added_tokens.json"
                    " chat_template.jinja`")
    proc = zerotrain(["train", "--init-from", "org/qwen", *common, "--dry-run"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"hub: model org/qwen, commit {COMMIT[:12]}, from the Hugging Face cache (offline): {snap}" in proc.stdout
    assert f"hub: tokenizer org/qwen@{COMMIT}, commit {COMMIT[:12]}, from the Hugging Face cache" in proc.stdout
    assert not out.exists()

    for repo, arch in (("org/qwen", "Qwen3ForCausalLM"), ("org/llama32", "LlamaForCausalLM")):
        run_id = repo.split("/")[1]
        snap = root / "hf" / "hub" / f"models--org--{run_id}" / "snapshots" / COMMIT
        proc = launch("python", ["--init-from", repo, *common, "--run-id", run_id],
                      env_extra={k: v for k, v in env.items() if v}, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"initialised from {snap}" in proc.stdout and "ZeRO-3" in proc.stdout
        saved = json.loads((out / run_id / "config.json").read_text())
        assert saved["tokenizer"] == f"{repo}@{COMMIT}" and saved["run"]["init_from"] == repo
        assert saved["run_sources"]["tokenizer"] == "init-from"
        assert (saved["model"]["head_dim"], saved["model"]["dim"]) == (16, 32)
        assert saved["model"]["qk_norm"] == (repo == "org/qwen")
        assert saved["model"]["rope_scaling"] == (None if repo == "org/qwen" else LLAMA3)
        assert [m["step"] for m in read_metrics(out / run_id)] == [1, 2]

        hf_dir = tmp_path / f"hf-{run_id}"  # checked: transformers' loss on it within 1e-4 of ours
        proc = zerotrain(["export", str(out / run_id), "--to", str(hf_dir)], env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "(within the float32 tolerance 0.0001)" in proc.stdout, proc.stdout[-2000:]
        config, theirs = json.loads((hf_dir / "config.json").read_text()), json.loads((snap / "config.json").read_text())
        assert (config["architectures"], config["model_type"], config["head_dim"]) == ([arch], theirs["model_type"], 16)
        assert config["rope_parameters"] == theirs["rope_parameters"]
        assert (hf_dir / "tokenizer.json").read_bytes() == (snap / "tokenizer.json").read_bytes()


def test_notebook_model_takes_a_hub_name(tmp_path):
    from zerotrain.launcher.commands.finetune import model_values
    from zerotrain.launcher.errors import UsageError

    assert model_values("org/qwen@main", {}, tmp_path) == {"init_from": "org/qwen@main"}
    with pytest.raises(UsageError, match="no such directory, not a preset .* and not a hub name ORG/NAME"):
        model_values("qwen", {}, tmp_path)


TOKENIZERS_OFFLINE = f"""
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.sources.tokenizer import load_tokenizer
for name in ("org/name", "org/name@main", "org/name@{COMMIT}", "org/absent", "org/name@v2", "mytok", "./nope"):
    try:
        tok = load_tokenizer(name)
        print("OK", name, tok.name, tok.vocab_size)
    except DataError as e:
        print("ERR", name, e)
"""


@pytest.mark.launches
def test_hub_tokenizer_names_revisions_and_refusals_offline(hub):
    """org/name, @branch and @commit resolve from the cache (as AutoTokenizer.from_pretrained would,
    revision included); what the cache lacks is one line naming the name and the command that fetches it."""
    root, env = hub
    proc = subprocess.run([sys.executable, "-c", TOKENIZERS_OFFLINE], capture_output=True, text=True, cwd=REPO,
                          env={k: v for k, v in {**os.environ, **env}.items() if v != ""}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {ln.split(" ", 2)[1]: ln for ln in proc.stdout.splitlines()}
    for name in ("org/name", "org/name@main", f"org/name@{COMMIT}"):
        assert got[name] == f"OK {name} org/name@{COMMIT} 300"
    cache = str(root / "hf" / "hub")
    assert got["org/absent"] == (f"ERR org/absent tokenizer org/absent: not in the Hugging Face cache ({cache}) and"
                                 " offline mode is on: `hf download org/absent --include tokenizer.json"
                                 " tokenizer_config.json special_tokens_map.json added_tokens.json"
                                 " chat_template.jinja` on a machine with network into the same HF_HOME /"
                                 " HF_HUB_CACHE, or unset HF_HUB_OFFLINE")
    assert "--revision v2` on a machine" in got["org/name@v2"]
    assert got["mytok"].startswith("ERR mytok tokenizer mytok: no such file or directory; as a hub name: not in")
    assert got["./nope"] == ("ERR ./nope tokenizer ./nope: no such file or directory (use 'bytes', a tokenizer.json"
                             " / directory, or a Hugging Face hub name ORG/NAME[@REVISION])")


@pytest.mark.launches
def test_dry_run_checks_every_hub_name_and_refuses_what_is_not_cached_offline(hub, tmp_path):
    """--dry-run says where the tokenizer and each hub source come from; offline with nothing cached a
    streamed source (today: "size unknown (streamed)", exit 0) or a "download": true one is refused in one
    line, exit 2, nothing written."""
    root, env = hub
    common = ["--tokenizer", "org/name", "--out", str(tmp_path / "runs"), *TRAIN, "--dry-run"]
    by_hub_cache = {**env, "HF_HUB_CACHE": str(root / "hf" / "hub"), "HF_HOME": str(tmp_path / "elsewhere")}
    proc = zerotrain(["train", "--data", str(root / "hub.json"), "--eval-every-steps", "2", "--eval-tokens", "2000",
                      *common], by_hub_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    snap = root / "hf" / "hub" / "datasets--owner--name" / "snapshots" / DATASET_COMMIT
    assert (f"hub: tokenizer org/name, commit {COMMIT[:12]}, from the Hugging Face cache (offline):"
            f" {root / 'hf' / 'hub' / 'models--org--name' / 'snapshots' / COMMIT}") in proc.stdout
    assert (f"hub: source 'edu': owner/name downloaded (\"download\": true) in {snap}: sized, held out and re-split"
            " like local files") in proc.stdout
    assert f"hub: source 'web': owner/name streamed, offline, from the Hugging Face cache's snapshot {snap}" \
        in proc.stdout
    assert re.search(r"edu +weight +50\.0% +~[\d,]+ tokens", proc.stdout)  # counted, where streamed is not:
    assert "web            weight  20.0%  size unknown" in proc.stdout
    for mix, what in (("absent", "(streamed)"), ("absent-download", "(\"download\": true)")):
        line = one_error_line(zerotrain(["train", "--data", str(root / f"{mix}.json"), *common], env))
        assert (f"source 'gone': hub dataset 'owner/absent' {what}: nothing cached and offline mode is on"
                f" ({root / 'hf' / 'hub'}): `hf download --repo-type dataset owner/absent`") in line, line
    assert not (tmp_path / "runs").exists()


def test_download_is_a_mix_key_for_hub_names(tmp_path):
    (tmp_path / "d").mkdir()
    for source, message in (
            ({"path": "d", "download": True}, "download goes with a hub dataset name in 'hf'"),
            ({"hf": "d", "download": True}, "download goes with a hub dataset name in 'hf'"),
            ({"hf": "owner/name", "download": True, "streaming": True}, "and not with streaming"),
            ({"hf": "owner/name", "download": "yes"}, "download must be true or false, got 'yes'")):
        (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "s", "weight": 1, **source}]}))
        with pytest.raises(DataError, match=re.escape(message)):
            parse_mix(tmp_path / "mix.json")
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "s", "weight": 1, "hf": "owner/name",
                                                                "download": True}]}))
    (spec,) = parse_mix(tmp_path / "mix.json").sources
    assert spec.download and spec.streamed and spec.hub is None  # a hub name until materialised


def test_an_online_dry_run_refuses_what_the_hub_refuses_and_warns_when_it_cannot_be_reached(monkeypatch):
    """The hub's own answers (no such repository, gated) are refusals; no answer at all (no network
    where the dry run is made: a laptop, a login node) is a 'not checked' line, not a refusal."""
    import huggingface_hub
    import requests
    from huggingface_hub.errors import RepositoryNotFoundError

    from zerotrain.dataio.sources import hub

    def answer(error):
        def repo_info(self, repo, repo_type=None):
            raise error
        monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)

    answer(RepositoryNotFoundError("404 Client Error", response=requests.Response()))
    with pytest.raises(DataError, match=r"hub dataset 'org/missing': no dataset repository of that name"):
        hub._reachable("org/missing", "dataset")
    answer(requests.ConnectionError("Failed to resolve 'huggingface.co'"))
    assert hub._reachable("org/any", "dataset").startswith(
        "not checked: the hub cannot be reached from here (Failed to resolve")
