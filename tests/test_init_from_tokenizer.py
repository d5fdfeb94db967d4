"""A fine-tune from an export takes the export's tokenizer, as users run it: a BPE tokenizer from
`zerotrain tokenizer train`, a chat run with it, `zerotrain export`, then `zerotrain train --init-from EXPORT`
without --tokenizer, and that run's export. Two single-process runs of the real driver (world 1: nothing
here is about ranks) shared by every assertion; the refusals are in-process (no launch)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import launch, synthetic_docs

TRAIN = ["--seq-len", "64", "--micro-batch", "2", "--max-steps", "2", "--warmup-steps", "1",
         "--log-data-every-steps", "0"]
SEQ_LEN = 64


def chats(n: int) -> list[dict]:
    docs = synthetic_docs(2 * n, seed=11, max_words=8)
    return [{"messages": [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": docs[2 * i]},
                          {"role": "assistant", "content": docs[2 * i + 1]}]} for i in range(n)]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A BPE tokenizer trained on a chat mix; run A with it and its export; run B from that export with no
    --tokenizer, and its export."""
    from zerotrain.launcher.cli import main as cli

    root = tmp_path_factory.mktemp("initfrom")
    with open(root / "chat.jsonl", "w") as f:
        for record in chats(200):
            f.write(json.dumps(record) + "\n")
    mix = root / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "chat", "path": "chat.jsonl", "weight": 1.0, "format": "chat"}]}))
    cli(["tokenizer", "train", "--data", str(mix), "--vocab-size", "400", "--out", str(root / "tok")])
    done = {"root": root, "mix": mix, "tok": root / "tok"}
    for name, extra in (("a", ["--tokenizer", str(root / "tok"), "--model", "debug"]), ("b", ["--init-from", str(root / "export-a")])):
        proc = launch("python", ["--data", str(mix), "--out", str(root / "runs"), "--run-id", name, *TRAIN, *extra])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        done[name] = (root / "runs" / name, proc.stdout)
        cli(["export", str(root / "runs" / name), "--to", str(root / f"export-{name}")])
    return done


def test_a_fine_tune_from_an_export_trains_and_exports_with_its_tokenizer(tuned):
    from zerotrain.dataio.sft import plain_chat
    from zerotrain.dataio.tokenizer import load_tokenizer

    export_a = tuned["root"] / "export-a"
    saved = json.loads((tuned["b"][0] / "config.json").read_text())
    assert saved["tokenizer"] == str(export_a / "tokenizer.json")  # not "bytes"
    assert saved["run_sources"]["tokenizer"] == "init-from"
    assert saved["run"]["tokenizer"] == str(export_a)
    ours = load_tokenizer(str(tuned["tok"]))
    assert (export_a / "tokenizer.json").read_bytes() == (tuned["tok"] / "tokenizer.json").read_bytes()
    # the ids fed are the BPE's: both runs count the same tokens per record, far fewer than its bytes
    a, b = (re.search(r"([\d,]+) chat records .*mean ([\d,]+) / max ([\d,]+) tokens", tuned[k][1]) for k in "ab")
    assert a and b and a.groups() == b.groups(), (tuned["a"][1][-2000:], tuned["b"][1][-2000:])
    byte_mean = sum(len(plain_chat(c["messages"]).encode()) for c in chats(200)) / 200
    assert int(b.group(2).replace(",", "")) < 0.6 * byte_mean, (b.groups(), byte_mean)
    exported = load_tokenizer(str(tuned["root"] / "export-b"))  # its export carries it
    assert exported.vocab_size == ours.vocab_size
    assert exported._tok.get_vocab() == ours._tok.get_vocab()


def refused(argv: list[str], capsys) -> str:
    from zerotrain.launcher.train import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err.removeprefix("zerotrain: error: ")


def test_a_tokenizer_other_than_the_models_is_refused_unless_swapped(tuned, tmp_path, capsys):
    from zerotrain.launcher.config import resolve_config

    export_a, out = tuned["root"] / "export-a", tmp_path / "runs"
    base = ["--data", str(tuned["mix"]), "--out", str(out), "--init-from", str(export_a)]
    line = refused(base + ["--tokenizer", "bytes", "--dry-run"], capsys)
    assert line.startswith(f"--tokenizer bytes (vocabulary 258) is not the tokenizer of --init-from {export_a}"), line
    assert "--swap-tokenizer" in line
    cfg = resolve_config(base + ["--tokenizer", "bytes", "--swap-tokenizer"])
    assert cfg.tokenizer == "bytes" and cfg.sources["tokenizer"] == "flag"
    assert any("--swap-tokenizer" in w for w in cfg.warnings())
    assert resolve_config(base + ["--tokenizer", str(tuned["tok"])]).tokenizer == str(tuned["tok"])  # the same one
    assert refused(base[:4] + ["--swap-tokenizer"], capsys).startswith("--swap-tokenizer: only with --init-from")
    assert not out.exists()


def test_a_directory_without_a_tokenizer_needs_one_unless_its_vocabulary_is_bytes(tmp_path, capsys):
    import torch

    from zerotrain.launcher.config import resolve_config
    from zerotrain.modeling import hf
    from zerotrain.modeling.model import ModelArgs, Transformer

    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [{"name": "x", "path": "x.txt", "weight": 1.0}]}))
    (tmp_path / "x.txt").write_text("some text\n")
    for name, vocab, eos in (("bpe", 1000, 0), ("bytes", 258, 257)):
        args = ModelArgs(dim=64, n_layers=1, n_heads=2, vocab_size=vocab, max_seq_len=64)
        hf.save(tmp_path / name, Transformer(args).state_dict(), args, bos_id=None, eos_id=eos)
    torch.manual_seed(0)
    base = ["--data", str(mix), "--out", str(tmp_path / "runs")]
    line = refused(base + ["--init-from", str(tmp_path / "bpe")], capsys)
    assert line == (f"--init-from {tmp_path / 'bpe'}: no tokenizer.json in the directory, and its vocabulary (1024)"
                    " is not the byte tokenizer's; give --tokenizer (the one the model was trained with)")
    cfg = resolve_config(base + ["--init-from", str(tmp_path / "bytes")])
    assert cfg.tokenizer == "bytes" and cfg.sources["tokenizer"] == "init-from"
    assert not (tmp_path / "runs").exists()

