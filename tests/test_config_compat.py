"""The flat edges of the nested config, pinned to what the flat config (before launcher/config.py became a tree of
groups) gave for the same flags: the run id hash, config.json's "run" section byte for byte (its keys, their order
and values) and its "run_sources".

Why pinned values are right here: a run directory is named by the run id and found again by it; `--resume auto`
reruns the same command and expects the same id, and the drift check compares the saved "run" section key by key.
A change to any of these would orphan every earlier run (a resumed command would start a new run beside its old
one). The values below were recorded on main before the config was nested (commit d788cbc) by running these exact
argv through `resolve_config`; they must never be updated to follow the code. Policy only: nothing is launched."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from zerotrain.launcher.config import LEAVES, RunConfig
from zerotrain.launcher.config_resolve import identity_hash, resolve_config

REPO = Path(__file__).resolve().parent.parent

# name -> (argv, run id hash, sha256[:16] of config.json's "run" as written (indent 2), of "run_sources")
PINNED = {
    "default": (["--data", "m.json"], "5d5a41ce", "b6dc3d3d057f2d23", "c87c2a987530a91c"),
    "shipped recipe": (["--config", "cpu-debug"], "44e73220", "95da7204cb6e4c5b", "da586a1c9079c94f"),
    "recipe by path, flag over it": (["--config", "recipes/a100x8-1.46b-edu-mix.json", "--data", "m.json"],
                                     "87bbb56d", "f0de09828bf9fb01", "99845af6430df69e"),
    "identity-when-set flags set": (
        ["--data", "m.json", "--packing", "greedy", "--qk-norm", "--rope-theta", "500000", "--schedule", "wsd",
         "--tiled-mlp", "--compile", "--optimizer", "lion", "--eval-tokens", "2000", "--piece-len", "128",
         "--warmup-tokens", "4096", "--depth", "2", "--hang-timeout", "30", "--keep-best", "2", "--max-steps", "50"],
        "f52d662a", "2efd697cc4d00130", "20432c825b1a7c86"),
    "identity flags given": (
        ["--data", "m.json", "--model", "tiny", "--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "5",
         "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "3", "--seed", "7", "--optimizer-args",
         '{"weight_decay": 0.0}', "--activation-checkpointing", "--no-compile", "--attention", "sdpa",
         "--eval-every-steps", "2", "--eval-tokens", "1000", "--eval-data", "dataio/mixes/demo.json"],
        "1323bda5", "22073beb3c2cf8b9", "442e069b406caf05"),
}


def digest(obj) -> str:
    return hashlib.sha256((json.dumps(obj, indent=2) + "\n").encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", PINNED)
def test_the_run_id_and_config_json_are_those_of_the_flat_config(name, monkeypatch):
    argv, run_id_hash, run_section, run_sources = PINNED[name]
    monkeypatch.chdir(REPO)  # the recipes' relative paths, as recorded
    cfg = resolve_config(argv)
    assert identity_hash(cfg) == run_id_hash
    assert digest(cfg.to_dict()) == run_section
    assert hashlib.sha256(json.dumps(cfg.sources, indent=2).encode()).hexdigest()[:16] == run_sources
    # config.json's "run" read back (a resume): the same tree, so no drift and the same id
    back = RunConfig.from_flat(json.loads(json.dumps(cfg.to_dict())), sources=cfg.sources)
    assert back == cfg and identity_hash(back) == run_id_hash


def test_the_flat_names_are_the_old_keys_in_the_old_order():
    """config.json's "run", `--help` and the settings line list the settings in this order (docs/cli.md)."""
    assert list(LEAVES)[:10] == ["profile", "model", "data", "tokenizer", "seq_len", "micro_batch", "grad_accum",
                                 "global_batch_tokens", "seed", "out"]
    assert list(LEAVES)[-3:] == ["eval_limit", "best_by", "hang_timeout"] and len(LEAVES) == 74
    assert (LEAVES["model"].path, LEAVES["data"].path, LEAVES["schedule"].path) == \
           ("model.preset", "data.path", "schedule.shape")
