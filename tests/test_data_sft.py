"""Supervised fine-tuning data (dataio/sources/sft.py and its path through the loader): prompt/response and
chat records, the response mask computed from character spans (byte tokenizer and a Hugging Face
tokenizer with a chat template), overflow, packing, holdout, exact resume, mixing with text
sources, bad records as one line, and the token-weighted loss checked against a single-process
reference under a real 2-rank `deepspeed` launch."""
import json
import re
import os
import subprocess

import numpy as np
import pytest
import torch

from conftest import BIN, REPO, free_port
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import SourceSpec, parse_mix
from zerotrain.dataio.format.packing import check_packing
from zerotrain.dataio.pipeline.commands import describe_data
from zerotrain.dataio.pipeline.loader import (Batches, load_data, make_loader, open_data, token_weighted,
                                              trainable_tokens)
from zerotrain.dataio.sources.holdout import holdout_rows
from zerotrain.dataio.sources.readers import load_text_source
from zerotrain.dataio.sources.sft import (ChatRenderer, encode, labelled_tokens, plain_chat, render_record, sniff_format,
                                          split_masked)
from zerotrain.dataio.sources.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
EOS = BYTES.eos_id
RNG_WORDS = "add the numbers please now then reverse word".split()


def qa_records(n, seed=0, long_every=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = f"q{i}: " + " ".join(rng.choice(RNG_WORDS, rng.integers(1, 8)))
        response = f"a{i}=" + "".join(rng.choice(list("0123456789"), rng.integers(1, 25)))
        if long_every and i % long_every == 0:
            prompt += " pad" * 40
        out.append({"prompt": prompt, "response": response})
    return out


def chats(n, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 2 else []
        for t in range(1 + i % 3):
            msgs.append({"role": "user", "content": f"u{i}.{t} " + " ".join(rng.choice(RNG_WORDS, 3))})
            # the plain template's own markers inside a response: a marker search would be fooled
            msgs.append({"role": "assistant", "content": f"r{i}.{t} é <|im_start|>assistant\nx"})
        if i % 4 == 0:
            msgs.append({"role": "user", "content": "a trailing question that trains nothing"})
        out.append({"messages": msgs})
    return out


def write_jsonl(path, records, blank_after=None):
    with open(path, "w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps(r) + "\n")
            if blank_after is not None and i == blank_after:
                f.write("\n")
    return path


def write_mix(root, sources, **mix):
    path = root / "mix.json"
    path.write_text(json.dumps({"sources": sources, **mix}))
    return path


def documents(batch):
    """(input ids, labels) per document of a batch, split where position ids restart; padding skipped."""
    out = []
    for ids, labels, pos in zip(batch["input_ids"].numpy(), batch["labels"].numpy(), batch["position_ids"].numpy()):
        starts = list(np.flatnonzero(pos == 0)) + [len(ids)]
        for a, z in zip(starts[:-1], starts[1:]):
            if not (ids[a:z] == EOS).all():  # a padding segment
                out.append((ids[a:z], labels[a:z]))
    return out


def labelled_text(ids, labels) -> bytes:
    assert ((labels == -100) | (labels == ids)).all(), "a label differs from its token"
    return bytes(int(t) if t < 256 else 0x7C for t in ids[labels != -100])  # EOS shown as "|"


# --------------------------------------------------------------------------------------------
# The mask: prompt/response and chat, bytes
# --------------------------------------------------------------------------------------------

def test_prompt_response_labels_are_exactly_the_response_and_its_eos(tmp_path):
    recs = qa_records(300)
    write_jsonl(tmp_path / "qa.jsonl", recs)
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64)
    by_response = {r["response"].encode(): (r["prompt"] + "\n" + r["response"]).encode() for r in recs}
    b = Batches(data, 0, 1, 7, 64, 4)
    seen = cut = 0
    for _ in range(15):
        for ids, labels in documents(b.next()):
            text = bytes(int(t) for t in ids[:-1])
            response = text.split(b"\n")[-1]
            # one record = one document: whole, or (overflow truncate_prompt) its prompt's start cut
            assert ids[-1] == EOS and by_response[response].endswith(text), "a record was cut or altered"
            assert labelled_text(ids, labels) == response + b"|"
            seen, cut = seen + 1, cut + (text != by_response[response])
    assert seen > 60 and 0 < cut < seen and data.stores[0].truncated > 0


def test_chat_plain_template_trains_every_assistant_turn_with_its_end_of_turn(tmp_path):
    recs = chats(60)
    write_jsonl(tmp_path / "chat.jsonl", recs)
    mix = write_mix(tmp_path, [{"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=512)
    want = {}
    for r in recs:
        turns = r["messages"][:max(i for i, m in enumerate(r["messages"]) if m["role"] == "assistant") + 1]
        text = plain_chat(turns).encode()
        want[text] = b"".join((m["content"] + "<|im_end|>\n").encode() for m in turns if m["role"] == "assistant")
    seen = 0
    b = Batches(data, 0, 1, 7, 512, 2)
    for _ in range(15):
        for ids, labels in documents(b.next()):
            text = bytes(int(t) for t in ids[:-1])
            assert text in want  # trailing user turns are left out; nothing cut
            assert labelled_text(ids, labels) == want[text] + b"|"
            seen += 1
    assert seen >= 60
    assert "(the plain ChatML template)" in "\n".join(describe_data(data, 10_000))


# --------------------------------------------------------------------------------------------
# A Hugging Face tokenizer with a chat template: offsets
# --------------------------------------------------------------------------------------------

LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer

    from zerotrain.dataio.sources.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("chat-tok")
    train_bpe(["reverse the word hello: olleh. What is 12 plus 7? 19. café crème add the numbers"] * 50, 330, root)
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.save(str(root / "tokenizer.json"))
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LLAMA3_LIKE}))
    return root


def test_chat_template_of_a_hf_tokenizer_masks_by_offsets(chat_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from zerotrain.dataio.sources.tokenizer import HFTokenizer

    tok = HFTokenizer(chat_tokenizer_dir)
    assert tok.chat_template == LLAMA3_LIKE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"},
            {"role": "assistant", "content": "19, café"}, {"role": "user", "content": "reverse hello"},
            {"role": "assistant", "content": "olleh crème"}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}] * 4)
    write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "What is 12 plus 7?", "response": "19"}] * 4)
    mix = write_mix(tmp_path, [{"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat"},
                               {"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft", "separator": " "}])
    data = load_data(open_data(str(mix), tok), None, 1, 0, seq_len=128)
    chat_store, qa_store = data.stores
    # The text is transformers' own rendering of the chat, special tokens and all.
    reference = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir)).apply_chat_template(msgs, tokenize=False)
    ids, trained = split_masked(chat_store.doc(0))
    assert tok.decode(ids) == tok.decode(tok.encode(reference))
    assert list(ids) == tok.encode(reference)
    # Trained: each answer and its <|eot_id|>; not the headers, the system prompt or the questions.
    eot = tok._tok.token_to_id("<|eot_id|>")
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
    answers = [ids[r] for r in runs if trained[r[0]]]
    assert [tok.decode(a) for a in answers] == ["19, café", "olleh crème"]
    assert all(a[-1] == eot for a in answers)
    assert trained.sum() == sum(len(a) for a in answers)
    # prompt/response with separator " ": the byte-level token " 19" straddles the boundary and is trained
    ids, trained = split_masked(qa_store.doc(0))
    pieces = [(tok._tok.id_to_token(int(i)), bool(t)) for i, t in zip(ids, trained)]
    assert pieces[-1] == ("Ġ19", True) and not any(t for _, t in pieces[:-1])
    assert "the chat template of" in "\n".join(describe_data(data, 1000))


def test_a_chat_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer_dir, tmp_path):
    from zerotrain.dataio.sources.tokenizer import HFTokenizer

    cfg_path = chat_tokenizer_dir / "tokenizer_config.json"
    tok = HFTokenizer(chat_tokenizer_dir)
    tok.chat_template = "{{ messages | length }}" + LLAMA3_LIKE  # the turn count up front: not prefix-stable
    spec = SourceSpec(name="c", weight=1.0, path=str(cfg_path), format="chat")
    with pytest.raises(DataError) as e:
        render_record(spec, chats(1)[0], ChatRenderer(tok), print)
    assert "renders earlier turns differently" in str(e.value) and "\n" not in str(e.value)


def test_offsets_of_multibyte_text_map_to_bytes():
    """encode() with the byte tokenizer and spans in bytes: a response after non-ASCII text."""
    spec = SourceSpec(name="s", weight=1.0, path="x", format="sft")
    text, spans = render_record(spec, {"prompt": "crème brûlée €", "response": "ça"}, ChatRenderer(), print)
    assert spans.tolist() == [[len("crème brûlée €\n".encode()), len(text.encode())]]
    ids, trained = split_masked(encode(BYTES, [(text, spans)])[0])
    assert bytes(ids[trained].astype(np.uint8)) == "ça".encode()


# --------------------------------------------------------------------------------------------
# Bad records and bad mixes: one line
# --------------------------------------------------------------------------------------------

BAD = [
    ("sft", {"prompt": "p"}, "no 'response' value"),
    ("sft", {"prompt": "p", "response": ""}, "empty 'response'"),
    ("sft", {"prompt": "p", "response": " \n\t "}, "empty 'response' (nothing"),  # whitespace alone: nothing to learn
    ("sft", {"response": "r"}, "no 'prompt' value"),
    ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                           {"role": "assistant", "content": "c"}]}, "roles do not alternate"),
    ("chat", {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "b"}]},
     "roles do not alternate"),
    ("chat", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, "no assistant turn"),
    ("chat", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "empty response"),
    ("chat", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  \n"}]},
     "empty response "),
    ("chat", {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "x"}]}, "role must be"),
    ("chat", {"messages": []}, "non-empty list"),
]


@pytest.mark.parametrize("fmt,record,why", BAD, ids=[w for _, _, w in BAD])
def test_a_bad_record_is_one_line_naming_source_file_and_line(tmp_path, fmt, record, why):
    good = qa_records(3)[0] if fmt == "sft" else chats(1)[0]
    bad = dict(record)
    if fmt == "sft":  # keep the columns present in the file; the bad record has nulls there
        bad = {"prompt": record.get("prompt"), "response": record.get("response")}
    write_jsonl(tmp_path / "r.jsonl", [good, good, bad, good], blank_after=0)  # a blank line: record 3 is line 4
    mix = write_mix(tmp_path, [{"name": "recs", "path": "r.jsonl", "weight": 1, "format": fmt}])
    with pytest.raises(DataError) as e:
        load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=256)
    msg = str(e.value)
    assert "source 'recs'" in msg and "r.jsonl line 4" in msg and why in msg and "\n" not in msg
    # bad_records skip: dropped and counted in the summary
    mix = write_mix(tmp_path, [{"name": "recs", "path": "r.jsonl", "weight": 1, "format": fmt, "bad_records": "skip"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=256)
    assert len(data.stores[0]) == 3
    assert "skipped 1 bad record(s)" in "\n".join(describe_data(data, 1000))


@pytest.mark.parametrize("source,why", [
    ({"format": "dialog"}, "format must be text or sft or chat"),
    ({"format": "chat", "prompt_field": "q"}, "prompt_field goes with format sft"),
    ({"format": "sft", "messages_field": "m"}, "messages_field goes with format chat"),
    ({"overflow": "drop"}, "overflow goes with format sft or chat"),
    ({"format": "sft", "text_field": "t"}, "text_field goes with format text"),
    ({"format": "sft", "overflow": "wrap"}, "overflow must be truncate_prompt or drop or error"),
    ({"format": "sft", "response_field": ""}, "response_field must be a non-empty string"),
    ({"format": "sft", "path": "notes.txt"}, "not .txt"),
])
def test_bad_sft_source_keys_are_one_line(tmp_path, source, why):
    write_jsonl(tmp_path / "r.jsonl", qa_records(3))
    (tmp_path / "notes.txt").write_text("a\n\nb\n")
    mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, **source}])
    with pytest.raises(DataError) as e:
        parse_mix(mix)
    assert why in str(e.value) and "source 's'" in str(e.value)


def test_a_source_of_several_files_names_the_file_of_a_bad_record(tmp_path):
    (tmp_path / "parts").mkdir()
    write_jsonl(tmp_path / "parts" / "a.jsonl", qa_records(5))
    write_jsonl(tmp_path / "parts" / "b.jsonl", chats(3) + [{"messages": [{"role": "user", "content": "q"}]}])
    write_jsonl(tmp_path / "parts" / "c.jsonl", [])
    mix = write_mix(tmp_path, [{"name": "m", "path": "parts/[bc].jsonl", "weight": 1, "format": "chat"}])
    with pytest.raises(DataError, match=r"b\.jsonl line 4: no assistant turn"):
        load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=512)
    write_jsonl(tmp_path / "parts" / "b.jsonl", chats(3))
    write_jsonl(tmp_path / "parts" / "c.jsonl", chats(4, seed=9))
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=512)
    store = data.stores[0]
    assert len(store) == 7 and store.files[0].endswith("b.jsonl")
    for d, rec in enumerate(chats(3) + chats(4, seed=9)):  # each file's spans stayed with its records
        ids, trained = split_masked(store.doc(d))
        answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert bytes(ids[trained].astype(np.uint8)).decode() == "".join(a + "<|im_end|>\n" for a in answers)


def test_sniff_format_for_a_single_file(tmp_path):
    assert sniff_format(write_jsonl(tmp_path / "c.jsonl", chats(2))) == "chat"
    assert sniff_format(write_jsonl(tmp_path / "q.jsonl", qa_records(2))) == "sft"
    assert sniff_format(write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])) == "text"
    assert sniff_format(tmp_path / "missing.jsonl") == "text"


def test_a_missing_field_names_the_file(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", [{"question": "q", "answer": "a"}] * 3)
    mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, "format": "sft"}])
    with pytest.raises(DataError, match=r"r\.jsonl has no field 'prompt' \(fields: question, answer"):
        load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64)
    mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, "format": "sft",
                                "prompt_field": "question", "response_field": "answer"}])
    assert len(load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64).stores[0]) == 3


# --------------------------------------------------------------------------------------------
# Overflow, packing, pieces
# --------------------------------------------------------------------------------------------

def test_overflow_policies_are_applied_and_counted(tmp_path):
    recs = qa_records(40, long_every=4)  # every 4th prompt is ~200 bytes: longer than a 64-byte row
    recs.append({"prompt": "short", "response": "x" * 80})  # the response alone does not fit
    write_jsonl(tmp_path / "r.jsonl", recs)
    full = {(r["prompt"] + "\n" + r["response"]).encode() for r in recs}
    too_long = sum(len((r["prompt"] + "\n" + r["response"]).encode()) + 1 > 64 for r in recs)
    results = {}
    for overflow in ("truncate_prompt", "drop"):
        mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, "format": "sft",
                                    "overflow": overflow}])
        data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64)
        store = data.stores[0]
        results[overflow] = (store.truncated, store.dropped, len(store))
        assert all(len(store.doc(d)) + 1 <= 64 for d in range(len(store)))
        summary = "\n".join(describe_data(data, 10_000))
        assert f"overflow {overflow} at seq len 64" in summary
        for d in range(len(store)):
            ids, trained = split_masked(store.doc(d))
            text = bytes(ids.astype(np.uint8))
            if overflow == "drop" or text in full:
                assert text in full
            else:  # truncated: the record's end is whole, with its prompt's last bytes before it
                assert any(f.endswith(text) for f in full) and not trained[0] and trained[-1]
    assert results["truncate_prompt"] == (too_long - 1, 1, 40)
    assert results["drop"] == (0, too_long, 41 - too_long)
    mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, "format": "sft", "overflow": "error"}])
    with pytest.raises(DataError) as e:
        load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64)
    assert "r.jsonl line 1: record of" in str(e.value) and "longer than --seq-len 64" in str(e.value)


def test_greedy_packing_and_too_few_records_are_refused(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", qa_records(2))
    mix = write_mix(tmp_path, [{"name": "s", "path": "r.jsonl", "weight": 1, "format": "sft"}])
    data = open_data(str(mix), BYTES)
    with pytest.raises(DataError, match="--packing greedy: source 's' holds SFT records"):
        check_packing("greedy", data.specs)
    assert check_packing("best-fit", data.specs) == "best-fit"
    with pytest.raises(DataError, match=r"2 SFT record\(s\) cannot be split across 3 ranks"):
        load_data(data, 1024, 3, 0, seq_len=64)  # records are never cut to make more of them
    data = load_data(open_data(str(mix), BYTES), 1024, 1, 0, seq_len=64)
    with pytest.raises(DataError, match="greedy"):
        make_loader(data, 0, 1, 1, 64, 1, "greedy")


# --------------------------------------------------------------------------------------------
# Mixing, holdout, resume, prepare
# --------------------------------------------------------------------------------------------

def test_sft_and_text_sources_mix_by_all_tokens(tmp_path):
    write_jsonl(tmp_path / "qa.jsonl", qa_records(2000))
    rng = np.random.default_rng(3)
    write_jsonl(tmp_path / "prose.jsonl", [{"text": " ".join(rng.choice(RNG_WORDS, rng.integers(20, 200)))}
                                           for _ in range(400)])
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 0.3, "format": "sft"},
                               {"name": "prose", "path": "prose.jsonl", "weight": 0.7}])
    data = load_data(open_data(str(mix), BYTES), 1024, 1, 0, seq_len=128)
    assert token_weighted(data.specs) and data.token_weighted
    b = Batches(data, 0, 1, 5, 128, 8)
    labelled = total = 0
    for _ in range(60):
        batch = b.next()
        labelled += trainable_tokens(batch)
        total += batch["real_tokens"]
    shares = np.array(b.tokens_per_source()) / sum(b.tokens_per_source())
    assert abs(shares[0] - 0.3) < 0.02 and abs(shares[1] - 0.7) < 0.02  # all tokens of a record count
    assert 0.5 < labelled / total < 0.9  # text fully labelled, SFT prompts not
    text_only = open_data(str(write_mix(tmp_path, [{"name": "prose", "path": "prose.jsonl", "weight": 1}])), BYTES)
    assert not token_weighted(text_only.specs)


def test_holdout_keeps_whole_records_and_eval_rows_keep_the_mask(tmp_path):
    recs = qa_records(400)
    write_jsonl(tmp_path / "qa.jsonl", recs)
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, holdout=(3, 2000), seq_len=256)
    train, held = data.stores[0], data.eval_stores[0]
    as_text = (lambda st: {bytes(split_masked(st.doc(d))[0].astype(np.uint8)) for d in range(len(st))})
    assert len(held) + len(train) == 400 and not as_text(train) & as_text(held) and len(held) >= 20
    rows = holdout_rows(data.eval_stores, data.specs, BYTES, 256)["qa"]
    responses = {(r["prompt"] + "\n" + r["response"]).encode(): r["response"].encode() for r in recs}
    n = 0
    for ids, labels in documents({k: rows[k] for k in ("input_ids", "labels", "position_ids")}):
        assert labelled_text(ids, labels) == responses[bytes(int(t) for t in ids[:-1])] + b"|"
        n += 1
    assert n == len(held)
    assert trainable_tokens(rows) == labelled_tokens(held)  # what the summary's share of trained tokens counts
    assert f"(+{len(held)} held out for evaluation)" in "\n".join(describe_data(data, 10_000))


@pytest.mark.parametrize("streamed", [False, True])
def test_exact_resume_with_sft_sources(tmp_path, streamed):
    write_jsonl(tmp_path / "qa.jsonl", qa_records(300))
    write_jsonl(tmp_path / "chat.jsonl", chats(300))
    write_jsonl(tmp_path / "prose.jsonl", [{"text": f"document {i} " * (i % 30 + 1)} for i in range(300)])
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft"},
                               {"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat",
                                "streaming": streamed},
                               {"name": "prose", "path": "prose.jsonl", "weight": 1}])
    data = load_data(open_data(str(mix), BYTES), 512, 1, 0, seq_len=128)
    first = Batches(data, 0, 1, 9, 128, 2)
    run = [first.next() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint holds
    run += [first.next() for _ in range(4)]
    again = Batches(data, 0, 1, 9, 128, 2)
    again.load_state_dict(state)
    for want in run[4:]:
        got = again.next()
        for k in ("input_ids", "labels", "position_ids"):
            assert torch.equal(got[k], want[k])
    assert any((b["labels"] == -100).float().mean() > 0.3 for b in run)  # the masks are really there


def test_streamed_sft_records_are_rendered_checked_and_fitted(tmp_path):
    recs = chats(40) + [{"messages": [{"role": "user", "content": "q"}]}]
    write_jsonl(tmp_path / "chat.jsonl", recs)
    mix = write_mix(tmp_path, [{"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat",
                                "streaming": True, "overflow": "drop"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=200)
    loader = make_loader(data, 0, 1, 1, 200, 2)
    named = 'source \'chat\': streamed record {"messages": [{"role": "user", "content": "q"}]}: no assistant turn'
    with pytest.raises(DataError, match=re.escape(named)):  # named by its JSON: a stream has no line numbers
        for _ in range(40):
            loader.next_batch()
    mix = write_mix(tmp_path, [{"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat",
                                "streaming": True, "overflow": "drop", "bad_records": "skip", "on_exhausted": "stop"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=200)
    stream = make_loader(data, 0, 1, 1, 200, 2).stream.sources[0]
    docs = stream.take(500)
    fits = [r for r in recs[:40] if len(plain_chat(r["messages"][:max(
        i for i, m in enumerate(r["messages"]) if m["role"] == "assistant") + 1]).encode()) + 1 <= 200]
    assert 0 < len(docs) == len(fits) < 40 and stream.bad_records == 1


def test_prepare_refuses_sft_sources_and_tokenizer_training_reads_them(tmp_path):
    from zerotrain.dataio.pipeline.prepare import prepare

    write_jsonl(tmp_path / "chat.jsonl", chats(5))
    mix = write_mix(tmp_path, [{"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat"}])
    with pytest.raises(DataError, match="zerotrain prepare does not take SFT records"):
        prepare(str(mix), BYTES, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    store = load_text_source(parse_mix(mix).sources[0])  # no tokenizer: the plain template's text
    assert store.text(0).startswith("<|im_start|>user\n")


# --------------------------------------------------------------------------------------------
# The loss: token-weighted over the global batch
# --------------------------------------------------------------------------------------------

def test_sum_loss_and_count_match_the_mean(tmp_path):
    from zerotrain.modeling.loss import global_token_mean_scale
    from zerotrain.modeling.model import Transformer, preset

    write_jsonl(tmp_path / "qa.jsonl", qa_records(50))
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft"}])
    batch = make_loader(load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=64), 0, 1, 1, 64, 3).next_batch()
    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=BYTES.vocab_size))
    args = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    n = trainable_tokens(batch)
    assert 0 < n < batch["input_ids"].numel() // 2
    assert torch.allclose(model(**args, loss_reduction="sum"), model(**args) * n, rtol=1e-5)
    nothing = {**args, "labels": torch.full_like(batch["labels"], -100)}
    assert model(**nothing, loss_reduction="sum").item() == 0.0  # contributes nothing, never nan
    assert global_token_mean_scale(4, 2, 100) == 0.08
    with pytest.raises(ValueError):
        global_token_mean_scale(4, 2, 0)


@pytest.mark.launches
def test_global_token_mean_under_deepspeed_matches_a_single_process_reference(tmp_path):
    """One 2-rank ZeRO-3 launch (tests/helpers/sft_loss_harness.py): the gradient DeepSpeed applies
    equals the gradient of (all token losses) / (all labelled tokens) computed in one process,
    and differs from the mean of per-micro-batch means; the logged loss is the global token mean."""
    rng = np.random.default_rng(5)
    recs = [{"prompt": " ".join(rng.choice(RNG_WORDS, rng.integers(1, 12))),
             "response": "".join(rng.choice(list("0123456789"), rng.choice([1, 2, 3, 20, 35])))} for _ in range(80)]
    write_jsonl(tmp_path / "qa.jsonl", recs)
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "format": "sft"}])
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "helpers" / "sft_loss_harness.py"), str(mix), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert 2 * min(r["counts"]) < max(r["counts"]) and r["n_global"] == sum(r["counts"])  # micro-batches differ
    assert r["grad_rel_err"] < 2e-3, r
    assert r["naive_rel_err"] > 0.1, r  # a mean of per-micro-batch means would be caught
    assert abs(r["step_loss"] - r["reference_loss"]) < 1e-5 * r["reference_loss"]
    assert abs(r["naive_loss"] - r["reference_loss"]) > 1e-4


# The first 8 batches of write_mix's pretraining data (the bytes tokenizer, the default packing, seq 64, micro 4,
# seed 1), digested: input_ids, labels, position_ids and cu_seqlens. Pinned on 2026-11-27, after the response
# mask began to travel as the tokens' sign (docs/data.md: "pretraining batches are unchanged bit for bit"); a
# change to the loader, packer or collator that moves any pretraining token, label or position changes it.
PRETRAINING_DIGEST = "10d11954445b9df0323f2ea89165a89534357a8cd7799b09481515f4d1d332c8"


def test_pretraining_batches_carry_no_mask_and_are_unchanged_bit_for_bit(mix_path):
    import hashlib

    loader = make_loader(load_data(open_data(str(mix_path), BYTES)), rank=0, world=1, seed=1, seq_len=64, micro_batch=4)
    digest = hashlib.sha256()
    for _ in range(8):
        batch = loader.next_batch()
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        assert ids.min() >= 0  # no token carries a sign: nothing is masked
        # every token is a label but each document's first (nothing before it to predict it from)
        assert torch.equal(labels == -100, positions == 0) and torch.equal(labels[labels != -100], ids[labels != -100])
        for key in ("cu_seqlens", "input_ids", "labels", "position_ids"):
            digest.update(key.encode() + batch[key].numpy().tobytes())
    assert digest.hexdigest() == PRETRAINING_DIGEST


def test_fields_of_mixed_types_across_records_are_read_as_their_values(tmp_path):
    """`datasets` stores a field whose records hold more than one type (an answer a string here and a number
    there; chat messages with a key only some have) as its Json feature, JSON text in Arrow: rendered as such, a
    template trained on '"Paris"' with its quotes and a chat record was refused as 'message 1 is not an object'.
    Both are read as the values the records hold."""
    write_jsonl(tmp_path / "qa.jsonl", [{"question": "capital of France?", "answer": "Paris"},
                                        {"question": "2+2?", "answer": 4}] * 20)
    chat = chats(40)
    chat[7]["messages"][0]["name"] = "bob"  # an OpenAI-style extra key on one message of one record
    write_jsonl(tmp_path / "chat.jsonl", chat)
    mix = write_mix(tmp_path, [{"name": "qa", "path": "qa.jsonl", "weight": 1, "template": "Q: {question} A: {answer}"},
                               {"name": "chat", "path": "chat.jsonl", "weight": 1, "format": "chat"}])
    data = load_data(open_data(str(mix), BYTES), None, 1, 0, seq_len=512)
    b = Batches(data, 0, 1, 7, 512, 2)
    texts = {bytes(int(t) for t in ids if t < 256) for _ in range(40) for ids, _ in documents(b.next())}
    assert {b"Q: capital of France? A: Paris", b"Q: 2+2? A: 4"} <= texts
    assert not any(b'"Paris"' in t for t in texts)
    user = chat[7]["messages"][1]["content"].encode()  # the record with the extra key, trained
    assert any(user in t and b"Be brief." in t for t in texts)
