"""A source's "bos": true (dataio/format/mix.py): the tokenizer's BOS before every document it gives, in the
training stream and in the held-out rows, counted in its tokens; the warning for a tokenizer that transformers
puts a BOS before every text with (a Llama's) when text sources train without it; a missing key of an older
run's recorded sources is its default, not drift. In-process, no launch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import synthetic_docs
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import parse_mix
from zerotrain.dataio.pipeline.loader import load_data, make_loader, missing_bos, open_data
from zerotrain.dataio.sources.holdout import holdout_rows
from zerotrain.dataio.sources.tokenizer import ByteTokenizer, HFTokenizer, train_bpe

SEQ, MB = 512, 2  # the documents (up to ~400 bytes) fit a row


def mix(root, sources: list[dict], **top) -> str:
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_docs(60, seed=1)))
    (root / "b.txt").write_text("\n\n".join(synthetic_docs(60, seed=2)) + "\n")
    (root / "mix.json").write_text(json.dumps({**top, "sources": sources}))
    return str(root / "mix.json")


A = {"name": "a", "path": "a.jsonl", "weight": 1}
B = {"name": "b", "path": "b.txt", "weight": 1}


def test_bos_is_a_mix_default_a_source_may_override_and_sft_sources_leave_to_their_template(tmp_path):
    specs = parse_mix(mix(tmp_path, [A, {**B, "bos": False}, {**A, "name": "c", "format": "chat"}],
                          bos=True)).sources
    assert [s.bos for s in specs] == [True, False, False]  # a chat source: its chat template decides
    for bad, want in [({"sources": [{**A, "format": "sft", "bos": True}]}, "bos goes with format text or tokens"),
                      ({"bos": "yes", "sources": [A]}, "bos must be true or false, got 'yes'")]:
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match=want):
            parse_mix(tmp_path / "bad.json")


@pytest.mark.parametrize("packing", ["best-fit", "greedy"])
def test_every_document_of_a_bos_source_starts_with_bos_in_the_rows_and_its_tokens_count_it(tmp_path, packing):
    """Greedy packing takes exactly the tokens the stream says its documents hold: a BOS the stream did not
    count would leave its rows short."""
    tok = ByteTokenizer()
    data = load_data(open_data(mix(tmp_path, [{**A, "bos": True}, B]), tok), holdout=(0, 2000))
    loader = make_loader(data, 0, 1, 0, SEQ, MB, packing)
    batches = [loader.next_batch() for _ in range(20)]
    assert all(b["input_ids"].shape == (MB, SEQ) for b in batches)
    ids = np.concatenate([b["input_ids"].numpy().ravel() for b in batches])
    starts = np.concatenate([b["position_ids"].numpy().ravel() == 0 for b in batches])
    bos_at = np.flatnonzero(ids == tok.bos_id)
    assert len(bos_at) > 20 and starts[bos_at].all()  # BOS only where a document starts
    texts = {t.encode() for t in synthetic_docs(60, seed=1)}  # what follows a BOS is a document of "a"
    eos = np.flatnonzero(ids == tok.eos_id)
    whole = [(i, eos[eos > i][0]) for i in bos_at if (eos > i).any() and not starts[i + 1:eos[eos > i][0]].any()]
    assert len(whole) > 10 and all(bytes(ids[i + 1:j].astype(np.uint8)) in texts for i, j in whole)
    b_docs = [i for i in np.flatnonzero(starts) if ids[i] not in (tok.bos_id, tok.eos_id)]
    assert b_docs  # source "b" (no bos) starts its documents with their text
    a, b = data.stores  # the sizes the epochs and --max-epochs count: a BOS and an EOS per document of "a"
    assert [n for n, _ in data.source_tokens()] == [int(a.lengths.sum()) + 2 * len(a), int(b.lengths.sum()) + len(b)]
    rows = holdout_rows(data.eval_stores, data.specs, tok, SEQ)  # evaluated as trained
    held = rows["a"]["input_ids"].ravel().numpy()
    first = rows["a"]["position_ids"].ravel().numpy() == 0
    assert (held[first & (held != tok.eos_id)] == tok.bos_id).all() and (rows["b"]["input_ids"] != tok.bos_id).all()


def bos_tokenizer(tmp_path) -> HFTokenizer:
    """A BPE whose post-processor prepends BOS, as a Llama's does."""
    from tokenizers import Tokenizer, processors

    out = train_bpe(synthetic_docs(200, seed=3), 300, tmp_path / "bpe")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(out / "tokenizer.json"))
    return HFTokenizer(out)


def test_a_tokenizer_that_puts_bos_before_every_text_warns_for_text_sources_without_it(tmp_path):
    tok = bos_tokenizer(tmp_path)
    assert tok.adds_bos and not HFTokenizer(train_bpe(synthetic_docs(50, seed=4), 300, tmp_path / "plain")).adds_bos
    path = mix(tmp_path, [A, B, {**A, "name": "c", "bos": True}])
    (line,) = missing_bos(open_data(path, tok))
    assert line.startswith(f"tokenizer {tok.name} puts BOS '<|begin_of_text|>' (id {tok.bos_id}) before every text")
    assert "source(s) a, b train without it: set \"bos\": true in the mix" in line
    assert missing_bos(open_data(mix(tmp_path, [A, B], bos=True), tok)) == []
    assert missing_bos(open_data(path, ByteTokenizer())) == []  # transformers puts nothing before a text


def test_a_tokenizer_without_bos_refuses_a_bos_source(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "hello": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "words").mkdir()
    words.save(str(tmp_path / "words" / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "words")
    assert tok.bos_id is None and not tok.adds_bos
    with pytest.raises(DataError, match=f"mix.json: source .a.: bos: true, but tokenizer {tok.name} has no BOS token"):
        load_data(open_data(mix(tmp_path, [{**A, "bos": True}]), tok))
    from zerotrain.dataio.pipeline.prepare import prepare

    with pytest.raises(DataError, match="has no BOS token"):  # before anything is tokenized or written
        prepare(str(tmp_path / "mix.json"), tok, tmp_path / "shards")
    assert not (tmp_path / "shards").exists() and not list(tmp_path.glob(".shards*"))


def test_a_shard_manifest_holds_bos_as_a_mix_file_does():
    from zerotrain.dataio.format.shards import manifest_specs

    source = {"name": "a", "weight": 1.0, "path": "/data/a.jsonl"}
    assert [s.bos for s in manifest_specs({"mix": {"sources": [source, {**source, "name": "b", "bos": True}]}})] == [
        False, True]
    with pytest.raises(DataError, match="shard manifest: source 'a': bos must be true or false, got 'yes'"):
        manifest_specs({"mix": {"sources": [{**source, "bos": "yes"}]}})


def test_a_key_an_older_run_did_not_record_is_its_default_not_drift(tmp_path):
    from zerotrain.launcher.run_plan import data_drift

    specs = [s.__dict__ for s in open_data(mix(tmp_path, [A]), ByteTokenizer()).specs]
    older = [{k: v for k, v in specs[0].items() if k != "bos"}]  # recorded before "bos" existed
    assert data_drift({"sources": older}, specs, None) == []
    assert data_drift({"sources": older}, [{**specs[0], "bos": True}], None) == ["mix source 'a' bos False -> True"]


def test_an_eval_mix_that_differs_from_training_on_bos_is_said(tmp_path):
    from zerotrain.dataio.pipeline.loader import bos_differs

    tok = ByteTokenizer()
    (tmp_path / "t").mkdir()
    (tmp_path / "e").mkdir()
    trained = open_data(mix(tmp_path / "t", [A, B], bos=True), tok)
    without = open_data(mix(tmp_path / "e", [A, {**B, "bos": True}]), tok)
    (line,) = bos_differs(trained, without, "eval.json")
    assert line.startswith("--eval-data eval.json: source(s) a evaluate documents without BOS, the training mix's"
                           " documents are with it")
    assert bos_differs(trained, trained, "eval.json") == []
    assert bos_differs(without, trained, "x") == []  # a training mix with both: nothing to compare with
