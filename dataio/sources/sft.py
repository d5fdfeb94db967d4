"""Supervised fine-tuning records: rendering, the response mask, overflow, and how the mask travels.

A mix source with `"format": "sft"` or `"format": "chat"` (zerotrain.dataio.format.mix documents the keys)
holds records, not documents:

- "sft": `{"prompt": ..., "response": ...}` (field names: `prompt_field`, `response_field`),
  rendered as `prompt + separator + response` (`separator` default "\\n"), whatever the tokenizer.
- "chat": `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}` (field:
  `messages_field`): an optional system message first, then user and assistant turns alternating,
  starting with a user turn, with at least one assistant turn. Turns after the last assistant turn
  train nothing and are left out. Rendered with the tokenizer's chat template when it has one (a
  Hugging Face tokenizer directory whose tokenizer_config.json has `chat_template`, or a
  chat_template.jinja; applied with transformers' `apply_chat_template`), else with the plain
  template PLAIN_CHAT (ChatML written out as text):
      <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
      <|im_start|>assistant\\n{content}<|im_end|>\\n ...

Loss is on response tokens only. The mask is computed from CHARACTER SPANS of the rendered
text, never by looking for a response marker among the tokens (a marker tokenizes differently in
context, and a search that misses leaves every label at -100 without a word):
- "sft": the response's span is known by construction;
- "chat": for each assistant turn i the text is rendered three ways: the turns before it with the
  generation prompt (`add_generation_prompt=True`), the turns up to and including it, and the
  whole chat. The turn's span runs from the end of the first to the end of the second: its
  content, its end-of-turn token and whatever the template puts before the next turn. Each
  rendering must be a prefix of the next (true of ordinary templates); a template that rewrites
  earlier turns once later ones follow is refused with one line naming it.
Spans are kept in bytes of the UTF-8 text; tokens map to them through their offsets (the byte
tokenizer: a token is a byte; a Hugging Face tokenizer: `encode(...).offsets`). A token is
trained when any of its characters lies in a response (so a token that merges the separator
with the response's first characters is trained). The EOS the packer appends after every
document is trained too: every SFT document ends with a response, so that EOS is its last
end-of-turn (for "sft" records, the only one).

How the mask travels without a second array: an SFT document's token array is SIGNED, a token
that takes no loss stored as -(id + 1). Everything between the reader and the batch
(IndexedSource, StreamedSource, MixedStream, both packers, their saved states, the carried
documents of a world-size change, eval rows) moves token arrays without looking at their values,
so it moves the mask with them; `zerotrain.dataio.format.packing.make_batch` decodes it (input_ids = the ids,
labels = -100 where the sign was set). Pretraining documents are never negative, so their
batches are unchanged bit for bit.

Overflow (a record whose tokens plus EOS exceed --seq-len), per source `"overflow"`:
- "truncate_prompt" (the default): the record's start is cut (the prompt; in a chat, the earliest
  turns) so that its end fits; at least one prompt token stays before the last response, so every
  response token keeps its label. A record whose last response (with its end-of-turn) does not
  fit even so is dropped. Both are counted in the summary printed before training.
- "drop": the record is left out and counted.
- "error": DataError naming the source, file and line (or record).
Records are never cut into pieces (one record = one document), and a local SFT source is
tokenized whole when the data is loaded (every rank, the same result): the overflow counts are
exact before training starts, and the source is held in memory as int32 tokens (4 bytes a
token). `zerotrain prepare` does not take SFT sources (shards have no room for the mask).

Token shares in a mix count ALL tokens of an SFT document (prompt, response, EOS), as they are
what fills the rows; a mix may hold SFT and pretraining sources side by side.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from zerotrain.dataio.format.errors import DataError, first_line

ROLES = ("system", "user", "assistant")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # the plain chat template's markers (plain text, not special tokens)
ENCODE_BLOCK = 1024  # records tokenized together


def is_sft(spec) -> bool:
    """A source of SFT records ("sft" or "chat"), as opposed to text documents or a flat token file."""
    return getattr(spec, "format", "text") in ("sft", "chat")


# --------------------------------------------------------------------------------------------
# Rendering a record: (text, response spans in bytes)
# --------------------------------------------------------------------------------------------

# PLAIN_CHAT as a Jinja chat template, as transformers' apply_chat_template runs it: what `zerotrain export` writes
# (chat_template.jinja) for a run that rendered chats with plain_chat, so that the export renders them the same
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ '" + IM_START + "' + message['role'] + '\\n' + message['content']"
                       " + '" + IM_END + "' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '" + IM_START
                       + "assistant\\n' }}{% endif %}")


def plain_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """PLAIN_CHAT: the template used when the tokenizer has none (ChatML, as text; PLAIN_CHAT_TEMPLATE in Jinja)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


class ChatRenderer:
    """Renders chats for one tokenizer: its chat template (transformers) or plain_chat."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None

    @property
    def name(self) -> str:
        return f"the chat template of {self.tokenizer.name}" if self.template else "the plain ChatML template"

    def render(self, conversations: list[list[dict]], add_generation_prompt: list[bool]) -> list[str]:
        if not self.template:
            return [plain_chat(c, g) for c, g in zip(conversations, add_generation_prompt)]
        return self.tokenizer.apply_chat_template(conversations, add_generation_prompt)


def check_messages(messages, field: str) -> tuple[list[dict] | None, str | None]:
    """(the turns to render, None) or (None, why the chat is bad). Trailing turns after the last
    assistant turn train nothing: they are left out."""
    if not isinstance(messages, list) or not messages:
        return None, f"{field!r} must be a non-empty list of messages, got {_short(messages)}"
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, f"message {i + 1} is not an object"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return None, f"message {i + 1}: role must be {', '.join(ROLES)}, got {_short(role)}"
        if not isinstance(content, str):
            return None, f"message {i + 1} ({role}): content must be text, got {_short(content)}"
        turns.append({"role": role, "content": content})
    body = turns[1:] if turns[0]["role"] == "system" else turns
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            at = i + 1 + (len(turns) - len(body))
            return None, (f"roles do not alternate: message {at} is {m['role']!r}, expected {want!r} (an optional"
                          " system message first, then user and assistant turns in turn, starting with user)")
    last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=None)
    if last is None:
        return None, "no assistant turn (nothing to train on)"
    for i, m in enumerate(turns[:last + 1]):
        if m["role"] == "assistant" and not m["content"].strip():  # whitespace alone is nothing to learn
            return None, f"message {i + 1} (assistant): empty response"
    return turns[:last + 1], None


def render_chat(turns: list[dict], renderer: ChatRenderer) -> tuple[str, list[tuple[int, int]]]:
    """(text, character spans of the assistant turns) of checked turns (see the module docstring)."""
    answers = [i for i, m in enumerate(turns) if m["role"] == "assistant"]
    convs, gen = [turns], [False]
    for i in answers:
        convs += [turns[:i], turns[:i + 1]]
        gen += [True, False]
    texts = renderer.render(convs, gen)
    full, spans, end = texts[0], [], 0
    for k in range(len(answers)):
        before, upto = texts[1 + 2 * k], texts[2 + 2 * k]
        if not (full.startswith(upto) and upto.startswith(before) and len(before) >= end):
            raise TemplateNotPrefix()
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
        end = len(upto)
    return full, spans


class TemplateNotPrefix(Exception):
    """The chat template renders earlier turns differently once later turns follow."""


def render_record(spec, record: dict, renderer: ChatRenderer, on_bad) -> tuple[str, np.ndarray] | None:
    """(text, spans as a (k, 2) int64 array of BYTE offsets) of one record, or None after
    on_bad(why) when the record is bad (missing or empty response, bad chat, ...)."""
    if spec.format == "sft":
        prompt = text_value(record, spec.prompt_field, on_bad)
        response = None if prompt is None else text_value(record, spec.response_field, on_bad)
        if response is None:
            return None
        if not response.strip():  # whitespace alone is nothing to learn, as a text record of it is no document
            on_bad(f"empty {spec.response_field!r} (nothing to train on)")
            return None
        head = prompt + spec.separator
        text = head + response
        spans = [(len(head), len(text))]
    else:
        turns, why = check_messages(record.get(spec.messages_field), spec.messages_field)
        if turns is None:
            on_bad(why if record.get(spec.messages_field) is not None else f"no {spec.messages_field!r} value")
            return None
        try:
            text, spans = render_chat(turns, renderer)
        except TemplateNotPrefix:
            raise DataError(f"{spec.where()}: {renderer.name} renders earlier turns differently once later turns"
                            " follow, so the assistant turns' text cannot be located; use a template without"
                            " that (or one plain prompt/response per record, format sft)") from None
        except Exception as e:  # a template's own raise_exception (jinja2 TemplateError) and the like
            on_bad(f"{renderer.name} refused it: {first_line(e)}")
            return None
        if not spans:
            on_bad("the chat template renders no assistant text")
            return None
    return text, _byte_spans(text, spans)


def text_value(record: dict, field: str, on_bad) -> str | None:
    """record[field] if it is text, else None after on_bad(why) (missing, or not a string). The rule for
    every field read as text: an SFT record's prompt and response, a streamed text record's text_field."""
    value = record.get(field)
    if value is None:
        on_bad(f"no {field!r} value")
        return None
    if not isinstance(value, str):
        on_bad(f"{field!r} is {type(value).__name__}, not text")
        return None
    return value


def _byte_spans(text: str, spans) -> np.ndarray:
    out = np.asarray(spans, np.int64).reshape(-1, 2)
    if not text.isascii():
        out = np.vectorize(lambda c: len(text[:c].encode("utf-8")), otypes=[np.int64])(out)
    return out


def record_text(spec, record: dict, on_bad, renderer: ChatRenderer | None = None) -> str | None:
    """The rendered text alone (tokenizer training): the plain template unless a renderer is given."""
    out = render_record(spec, record, renderer or ChatRenderer(), on_bad)
    return None if out is None else out[0]


# --------------------------------------------------------------------------------------------
# Tokens with the mask (signed), and overflow
# --------------------------------------------------------------------------------------------

def masked(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """int32 token array with the tokens that take no loss stored as -(id + 1)."""
    ids = ids.astype(np.int32, copy=False)
    return np.where(trained, ids, -ids - 1).astype(np.int32, copy=False)


def split_masked(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of a signed token array (the inverse of `masked`)."""
    neg = tokens < 0
    return np.where(neg, -tokens - 1, tokens), ~neg


def encode(tokenizer, rendered: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
    """Signed token arrays (see `masked`) of rendered records, without EOS."""
    if tokenizer.name == "bytes":
        out = []
        for text, spans in rendered:
            ids = np.frombuffer(text.encode("utf-8"), np.uint8)
            trained = np.zeros(len(ids), bool)
            for a, b in spans:
                trained[a:b] = True
            out.append(masked(ids, trained))
        return out
    out = []
    for (text, spans), (ids, offsets) in zip(rendered, tokenizer.encode_with_offsets([t for t, _ in rendered])):
        if not text.isascii():  # offsets are in characters; spans are in bytes
            raw = np.frombuffer(text.encode("utf-8"), np.uint8)
            char_at = np.append(np.flatnonzero((raw & 0xC0) != 0x80), len(raw))  # byte offset of each character
            offsets = char_at[offsets]
        starts, ends = offsets[:, 0], offsets[:, 1]
        # A token is trained when it overlaps a response span; a zero-width one when it lies inside one.
        k = np.searchsorted(spans[:, 1], starts, side="right")  # the first span ending after the token starts
        inside = k < len(spans)
        trained = np.zeros(len(ids), bool)
        trained[inside] = spans[k[inside], 0] < np.maximum(ends[inside], starts[inside] + 1)
        out.append(masked(ids, trained))
    return out


def fit(tokens: np.ndarray, seq_len: int | None, overflow: str) -> tuple[np.ndarray | None, str]:
    """(the document to train, what happened: "" | "truncated" | "dropped" | "too long").
    "too long" only with overflow "error" (the caller raises, naming the record)."""
    if seq_len is None or len(tokens) + 1 <= seq_len:
        return tokens, ""
    if overflow == "error":
        return None, "too long"
    if overflow == "drop":
        return None, "dropped"
    cut = len(tokens) + 1 - seq_len
    prompt = np.flatnonzero(tokens < 0)
    if len(prompt) and cut <= prompt[-1]:  # the last untrained token (before the last response) stays
        return tokens[cut:], "truncated"
    return None, "dropped"


def labelled_tokens(store) -> int:
    """Tokens of a tokenized SFT store that carry a label once packed: each document's trained
    tokens after its first (position 0 never has one) and its EOS."""
    if not len(store):
        return 0
    trained = np.concatenate([[0], np.cumsum(store.chunks[0] >= 0)])
    first = store.chunks[0][store.start] >= 0
    return int((trained[store.end] - trained[store.start]).sum() - first.sum() + len(store))


# --------------------------------------------------------------------------------------------
# Local sources: a whole source at load time
# --------------------------------------------------------------------------------------------

def tokenize_store(store, spec, tokenizer, seq_len: int | None, where_record):
    """A DocStore of rendered SFT records (readers._sft_docstore) -> a DocStore of signed tokens
    (kind "tokens", one in-memory chunk), overflow applied and counted. `where_record(d)` names
    record d for an error ("FILE line N")."""
    docs, truncated, dropped = [], 0, 0
    for lo in range(0, len(store), ENCODE_BLOCK):
        ids = range(lo, min(len(store), lo + ENCODE_BLOCK))
        rendered = [(store.text(d), store.spans_of(d)) for d in ids]
        for d, tokens in zip(ids, encode(tokenizer, rendered)):
            doc, what = fit(tokens, seq_len, spec.overflow)
            if what == "too long":
                raise DataError(f"{spec.where()}: {where_record(d)}: record of {len(tokens) + 1:,} tokens (with EOS)"
                                f" is longer than --seq-len {seq_len} (\"overflow\": \"error\"; use \"truncate_prompt\""
                                " or \"drop\" in the mix, or a larger --seq-len)")
            truncated += what == "truncated"
            dropped += what == "dropped"
            if doc is not None:
                docs.append(doc)
    if not docs:
        raise DataError(f"{spec.where()}: no record fits in --seq-len {seq_len} ({dropped:,} dropped,"
                        f" overflow {spec.overflow}); use a larger --seq-len")
    lengths = np.fromiter((len(t) for t in docs), np.int64, len(docs))
    end = np.cumsum(lengths)
    return replace(store, kind="tokens", chunks=[np.concatenate(docs)], chunk=np.zeros(len(docs), np.int32),
                   start=end - lengths, end=end, spans=None, records=None, record_file=None,
                   truncated=truncated, dropped=dropped)


# --------------------------------------------------------------------------------------------
# Streamed sources: a block of records at a time
# --------------------------------------------------------------------------------------------

def stream_block(spec, records: list[dict], tokenizer, renderer: ChatRenderer, seq_len: int | None,
                 on_bad) -> list[np.ndarray]:
    """Signed token arrays of a block of streamed records (bad ones after on_bad(why, record); overflow applied:
    dropped records are simply left out, "error" raises naming the stream)."""
    rendered = [r for r in (render_record(spec, rec, renderer, lambda why, rec=rec: on_bad(why, rec))
                            for rec in records) if r is not None]  # on_bad(why, record): the record is named
    out = []
    for tokens in encode(tokenizer, rendered) if rendered else []:
        doc, what = fit(tokens, seq_len, spec.overflow)
        if what == "too long":
            raise DataError(f"{spec.where()}: streamed record of {len(tokens) + 1:,} tokens (with EOS) is longer than"
                            f" --seq-len {seq_len} (\"overflow\": \"error\"; use \"truncate_prompt\" or \"drop\")")
        if doc is not None:
            out.append(doc)
    return out


def sniff_format(path) -> str:
    """The `format` a single data file's records suggest: "chat" (a "messages" field), "sft"
    ("prompt" and "response"), else "text". Reads the first record of json lines or the schema of
    a parquet file; anything else (or unreadable) is "text", left to the normal checks. For
    callers that wrap one file into a mix (zerotrain.launcher.commands.finetune)."""
    p = Path(path)
    fields: set = set()
    try:
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            fields = set(pq.read_schema(p).names)
        elif p.suffix in (".jsonl", ".json", ".ndjson"):
            with open(p, "rb") as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        fields = set(record) if isinstance(record, dict) else set()
                        break
    except (OSError, ValueError, UnicodeDecodeError):
        return "text"
    if "messages" in fields:
        return "chat"
    return "sft" if {"prompt", "response"} <= fields else "text"


def _short(value) -> str:
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."
