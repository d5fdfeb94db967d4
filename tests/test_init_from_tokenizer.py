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
from zerotrain.launcher.config_resolve import config_warnings

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


@pytest.mark.launches
def test_a_fine_tune_from_an_export_trains_and_exports_with_its_tokenizer(tuned):
    from zerotrain.dataio.sources.sft import plain_chat
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

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


@pytest.mark.launches
def test_a_tokenizer_other_than_the_models_is_refused_unless_swapped(tuned, tmp_path, capsys):
    from zerotrain.launcher.config_resolve import resolve_config

    export_a, out = tuned["root"] / "export-a", tmp_path / "runs"
    base = ["--data", str(tuned["mix"]), "--out", str(out), "--init-from", str(export_a)]
    line = refused(base + ["--tokenizer", "bytes", "--dry-run"], capsys)
    assert line.startswith(f"--tokenizer bytes (vocabulary 258) is not the tokenizer of --init-from {export_a}"), line
    assert "--swap-tokenizer" in line
    cfg = resolve_config(base + ["--tokenizer", "bytes", "--swap-tokenizer"])
    assert cfg.data.tokenizer == "bytes" and cfg.sources["tokenizer"] == "flag"
    assert any("--swap-tokenizer" in w for w in config_warnings(cfg))
    assert resolve_config(base + ["--tokenizer", str(tuned["tok"])]).data.tokenizer == str(tuned["tok"])  # the same one
    assert refused(base[:4] + ["--swap-tokenizer"], capsys).startswith("--swap-tokenizer: only with --init-from")
    assert not out.exists()


def test_a_directory_without_a_tokenizer_needs_one_unless_its_vocabulary_is_bytes(tmp_path, capsys):
    import torch

    from zerotrain.launcher.config_resolve import resolve_config
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
    assert cfg.data.tokenizer == "bytes" and cfg.sources["tokenizer"] == "init-from"
    assert not (tmp_path / "runs").exists()


def run_tokens(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """The ids the run feeds for a chat (dataio/sources/sft.py: its renderer and its encoding, mask dropped); with the
    generation prompt, the prompt the run's rendering puts before an assistant turn."""
    from zerotrain.dataio.format.mix import SourceSpec
    from zerotrain.dataio.sources.sft import ChatRenderer, encode, render_record, split_masked

    renderer = ChatRenderer(tokenizer)
    if add_generation_prompt:
        return list(tokenizer.encode(renderer.render([messages], [True])[0]))
    spec = SourceSpec(name="chat", weight=1.0, path="chat.jsonl", format="chat")
    rendered = render_record(spec, {"messages": messages}, renderer, pytest.fail)
    return split_masked(encode(tokenizer, [rendered])[0])[0].tolist()


@pytest.mark.launches
@pytest.mark.parametrize("export", ["export-a", "export-b"])
def test_the_export_renders_chats_as_the_run_did(tuned, export):
    """Run A's tokenizer had no chat template: it rendered plain ChatML, and its export carries that as
    chat_template.jinja; run B's tokenizer (export A's) brought that template, and its export keeps it."""
    from transformers import AutoTokenizer

    from zerotrain.dataio.sources.sft import PLAIN_CHAT_TEMPLATE
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    out = tuned["root"] / export
    assert (out / "chat_template.jinja").read_text() == PLAIN_CHAT_TEMPLATE
    run = load_tokenizer(str(tuned["tok"] if export == "export-a" else tuned["root"] / "export-a"))
    theirs = AutoTokenizer.from_pretrained(out)
    for record in chats(3):
        messages = record["messages"]
        assert theirs.apply_chat_template(messages, tokenize=True)["input_ids"] == run_tokens(run, messages)
        prompt = theirs.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        assert prompt == run_tokens(run, messages[:-1], add_generation_prompt=True)
        assert run_tokens(run, messages)[:len(prompt)] == prompt  # the generation prompt is what training saw
    # 4. the trained context, not "unbounded"; the model's positions as before
    assert theirs.model_max_length == SEQ_LEN
    trained = json.loads((tuned["a" if export == "export-a" else "b"][0] / "config.json").read_text())["model"]
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == trained["max_seq_len"]
    # 5. the card: the format, and the tokenizer by its content, never by a path
    card = (out / "README.md").read_text()
    assert "- data format: chat records rendered with zerotrain's plain ChatML template" in card \
        if export == "export-a" else "- data format: chat records rendered with the tokenizer's own chat template" in card
    assert f"vocabulary {run.vocab_size:,}, tokenizer.json sha256 {run.sha256[:16]}" in card
    assert str(tuned["root"]) not in card and "tok/tokenizer.json" not in card and "tokenizer.json`" not in card


def test_the_card_names_a_hub_tokenizer_as_given():
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.commands.export import tokenizer_words

    class Hub:  # what load_tokenizer returns for a hub name: pinned name, its origin (dataio/sources/hub.py)
        name, origin, vocab_size, sha256 = "org/tok@0123456789abcdef", "the Hugging Face cache", 500, "ab" * 32

    words = tokenizer_words({"run": {"tokenizer": "org/tok"}}, Hub())
    assert words.startswith("`org/tok` from the Hugging Face Hub (`org/tok@0123456789abcdef`; vocabulary 500,")
    assert "byte tokenizer" in tokenizer_words({}, ByteTokenizer())


def test_the_card_says_a_runs_documents_began_with_bos(tmp_path):
    """A run whose mix said "bos": true: its card says prompts begin with BOS too, and whether the tokenizer's
    encode already puts it first (a Llama's) or the ids must start with it (the byte tokenizer's 256)."""
    from test_data_bos import bos_tokenizer
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.commands.export import bos_words

    run = {"sources": [{"name": "a", "bos": True}, {"name": "b", "bos": False}]}
    assert bos_words(run, ByteTokenizer()) == [
        "- documents began with BOS (id 256): this tokenizer does not add it: start a prompt's ids with it"]
    llama = bos_tokenizer(tmp_path)
    assert bos_words(run, llama) == [f"- documents began with BOS (id {llama.bos_id}, `<|begin_of_text|>`): this"
                                     " tokenizer's `encode` puts it first"]
    assert bos_words({"sources": [{"name": "a"}]}, llama) == [] and bos_words({}, ByteTokenizer()) == []


@pytest.mark.launches
def test_the_run_records_its_tokenizer_by_absolute_path_and_content_and_export_holds_it_to_them(tuned, tmp_path,
                                                                                             monkeypatch, capsys):
    """config.json names the tokenizer by its absolute path (export and generate read it again from any directory)
    with the sha256 of its tokenizer.json; a file replaced since (another tokenizer at that path) is refused in
    one line (exit 2), never exported beside weights that learned other ids."""
    import shutil

    from zerotrain.dataio.sources.tokenizer import load_tokenizer
    from zerotrain.launcher.cli import main as cli

    monkeypatch.chdir(tuned["root"])
    assert load_tokenizer("tok").name == str(tuned["tok"].resolve() / "tokenizer.json")
    saved = json.loads((tuned["a"][0] / "config.json").read_text())
    assert saved["tokenizer_sha256"] == load_tokenizer(str(tuned["tok"])).sha256
    run = tmp_path / "a"
    shutil.copytree(tuned["a"][0], run)
    other = tmp_path / "tok"
    shutil.copytree(tuned["tok"], other)  # the same vocabulary, another file: written again, indented
    (other / "tokenizer.json").write_text(json.dumps(json.loads((other / "tokenizer.json").read_text()), indent=1))
    (run / "config.json").write_text(json.dumps({**saved, "tokenizer": str(other / "tokenizer.json")}))
    with pytest.raises(SystemExit) as e:
        cli(["export", str(run), "--to", str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the run's tokenizer {other / 'tokenizer.json'} is not the one it trained with" in err[0]


@pytest.mark.launches
def test_the_export_of_a_fine_tune_keeps_the_base_models_generation_config(tuned, tmp_path):
    """Run B trained with its --init-from model's own tokenizer: its export carries that model's
    generation_config.json (an end-of-text list and sampling defaults, as Llama 3 Instruct's has), not one written
    from the tokenizer, which would keep one end-of-text id; run A's (a tokenizer of its own) is written anew."""
    import shutil

    from transformers import GenerationConfig

    from zerotrain.launcher.cli import main as cli

    base = tmp_path / "export-a"
    shutil.copytree(tuned["root"] / "export-a", base)
    ours = json.loads((base / "generation_config.json").read_text())
    (base / "generation_config.json").write_text(json.dumps(
        {**ours, "eos_token_id": [ours["eos_token_id"], 5], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    run = tmp_path / "b"
    shutil.copytree(tuned["b"][0], run)
    saved = json.loads((run / "config.json").read_text())
    assert saved["run_sources"]["tokenizer"] == "init-from"
    (run / "config.json").write_text(json.dumps({**saved, "run": {**saved["run"], "init_from": str(base)}}))
    cli(["export", str(run), "--to", str(tmp_path / "out")])
    got = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (got.eos_token_id, got.do_sample, got.temperature, got.top_p) == ([ours["eos_token_id"], 5], True, 0.6, 0.9)
    written = GenerationConfig.from_pretrained(tuned["root"] / "export-a")  # run A: no base model, ours
    assert written.eos_token_id == ours["eos_token_id"] and not written.do_sample
