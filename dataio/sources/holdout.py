"""Evaluation data: a held-out slice of the training mix, and the packed rows every rank evaluates.

The holdout (`split_holdout`), the default when no `--eval-data` is given, is carved out of each
LOCAL source once its documents are read and BEFORE long documents are cut into pieces
(`zerotrain.dataio.pipeline.loader.cut_data`), so whole documents are held out and no piece of an eval document is
ever trained on; it is done before any loader sees the stores:

- per source, a target of `eval_tokens x weight` tokens (the mix's normalised weight; tokens
  count with their EOS, as in training);
- the source's documents are put in a seeded order (numpy `default_rng([seed, HOLDOUT_SALT,
  source index])`, so the same seed always holds out the same documents, another seed others);
  the holdout is the shortest prefix of that order whose tokens reach the target, with at least
  one document and never more than MAX_FRACTION (10%) of the source's documents nor of its
  tokens (the cap wins over the target; a single first document may exceed the token cap);
- a source with fewer than 1 / MAX_FRACTION (10) documents cannot spare one: DataError.
The training stores are the same `DocStore`s minus those documents (index arrays only, no text
is copied), so the loader never sees a held-out document in any epoch, on any rank.
Token counts are exact for the bytes tokenizer and for prepared shards; for a Hugging Face
tokenizer on text the tokens per byte are estimated on up to 200 evenly spaced documents.
SFT sources (dataio/sources/sft.py) are held out like any other, record by record (their stores are
tokens already, so the counts are exact); their eval rows carry the response mask, so their
val_loss is the loss on responses, as in training.
Streamed sources (hub datasets, `"streaming": true`) have no random access and no known size:
they get no holdout (their share of `eval_tokens` is simply not evaluated); evaluating them needs
`--eval-data` (`mix_rows`).

Eval rows: each source's evaluation documents are packed with the training packer (best-fit,
`zerotrain.dataio.format.packing`), into rows of `seq_len` tokens that never mix sources, so the loss per
source is exact: position ids restart at every document, labels are -100 on document starts
and padding. Every rank builds the same finite list of rows (deterministic; nothing depends on
the rank); the evaluator gives rank r rows r, r + world, ...
- `holdout_rows`: all documents of the holdout's eval stores;
- `mix_rows`: from a separate eval mix (`--eval-data MIX.json`, loaded with the same dataio
  functions): per source about `eval_tokens x weight` tokens, documents in an order seeded by
  EVAL_MIX_SEED, fixed (not the training seed), so runs with different seeds are compared on
  the same rows; a streamed eval source contributes its first documents, in stream order.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.format.packing import BestFitPacker, with_bos
from zerotrain.dataio.sources.sft import ChatRenderer, is_sft, stream_block
from zerotrain.dataio.sources.streamed import bad_record, no_text, open_streamed, record_text, records

MAX_FRACTION = 0.10  # the most a holdout takes from a source, of its documents and of its tokens
HOLDOUT_SALT = 0x686F6C64  # "hold": keeps the holdout order apart from the loader's epoch orders
EVAL_MIX_SEED = 0  # the order documents are taken from an --eval-data mix, the same for every run
ENCODE_BLOCK = 256  # documents tokenized together
ROW_KEYS = ("input_ids", "labels", "position_ids")


def split_holdout(stores: list, specs, seed: int, eval_tokens: int, tokenizer=None,
                  max_fraction: float = MAX_FRACTION) -> tuple[list, list]:
    """(train_stores, eval_stores): each local source minus / only its held-out documents.

    `stores[i]` is source i's DocStore as read (before `cut_data` cuts long documents into
    pieces: whole documents are held out, so no piece of an eval document is ever trained on),
    or None for a streamed source (None in both outputs). `tokenizer`: None or the bytes
    tokenizer when store lengths are tokens already. Both outputs keep the documents' natural
    order. Raises DataError (one line).
    """
    if isinstance(eval_tokens, bool) or not isinstance(eval_tokens, int) or eval_tokens <= 0:
        raise DataError(f"--eval-tokens: must be a positive integer, got {eval_tokens!r}")
    if len(stores) != len(specs):
        raise ValueError(f"{len(stores)} stores for {len(specs)} sources")
    train, held = [], []
    for index, (spec, store) in enumerate(zip(specs, stores)):
        if store is None:
            train.append(None)
            held.append(None)
            continue
        if getattr(store, "whole_documents", None) is not None:
            raise ValueError(f"split_holdout: source {spec.name!r} is already cut into pieces; hold out first")
        n = len(store)
        cap_docs = int(n * max_fraction + 1e-9)
        if cap_docs < 1:
            raise DataError(f"{spec.where()}: {n} document(s) are too few to hold out an evaluation slice (the"
                            f" holdout takes at most {max_fraction:.0%} of a source, so it needs at least"
                            f" {math.ceil(1 / max_fraction)}); give --eval-data MIX.json instead")
        per_unit = _tokens_per_unit(store, tokenizer)
        order = np.random.default_rng([seed, HOLDOUT_SALT, index]).permutation(n)
        cum = np.cumsum(store.lengths[order] * per_unit + 1)  # estimated tokens, EOS included
        k = int(np.searchsorted(cum, eval_tokens * spec.weight)) + 1  # the shortest prefix reaching the target
        k_tokens = int(np.searchsorted(cum, max_fraction * cum[-1], side="right"))  # prefixes within the token cap
        k = max(1, min(k, cap_docs, k_tokens))
        keep = np.ones(n, bool)
        keep[order[:k]] = False
        train.append(_subset(store, np.flatnonzero(keep), keep_counts=True))
        held.append(_subset(store, np.flatnonzero(~keep), keep_counts=False))
    return train, held


def _tokens_per_unit(store: DocStore, tokenizer) -> float:
    """Tokens per store unit: 1 for token stores and the bytes tokenizer, else estimated."""
    if store.kind == "tokens" or tokenizer is None or tokenizer.name == "bytes":
        return 1.0
    sample = np.unique(np.linspace(0, len(store) - 1, min(len(store), 200)).astype(np.int64))
    n_tokens = sum(len(t) for t in tokenizer.encode_batch([store.text(int(d)) for d in sample]))
    return n_tokens / max(1, int(store.lengths[sample].sum()))


def _subset(store: DocStore, ids: np.ndarray, keep_counts: bool) -> DocStore:
    """The same buffers, fewer documents. The reader's counts and notes stay with the training part."""
    out = replace(store, chunk=store.chunk[ids], start=store.start[ids], end=store.end[ids])
    if not keep_counts:
        out = replace(out, bad_records=0, first_bad="", empty_records=0,
                      **({"note": ""} if hasattr(store, "note") else {}),
                      **({"truncated": 0, "dropped": 0} if hasattr(store, "truncated") else {}))
    return out


def holdout_summary(train_stores: list, eval_stores: list, specs) -> list[str]:
    """One line per source for the driver to print before training."""
    lines = []
    for spec, tr, ev in zip(specs, train_stores, eval_stores):
        if ev is None:
            lines.append(f"holdout {spec.name}: none (streamed source)")
            continue
        units = "tokens" if ev.kind == "tokens" else "bytes"
        n_ev, n_all = int(ev.lengths.sum()), int(ev.lengths.sum() + tr.lengths.sum())
        lines.append(f"holdout {spec.name}: {len(ev):,} of {len(ev) + len(tr):,} documents,"
                     f" {n_ev:,} {units} ({n_ev / max(1, n_all):.2%}), never trained on")
    return lines


# --------------------------------------------------------------------------------------------
# Packed eval rows
# --------------------------------------------------------------------------------------------

def holdout_rows(eval_stores: list, specs, tokenizer, seq_len: int) -> dict[str, dict[str, torch.Tensor]]:
    """{source name: rows} for every held-out document (streamed sources have none)."""
    out = {}
    for spec, store in zip(specs, eval_stores):
        if store is not None:
            docs = with_bos(_encode(store, np.arange(len(store)), tokenizer), tokenizer.bos_id if spec.bos else None)
            out[spec.name] = pack_rows(docs, seq_len, tokenizer.eos_id)  # as the training stream has them
    return out


def mix_rows(data, seq_len: int, eval_tokens: int, seed: int = EVAL_MIX_SEED) -> dict[str, dict[str, torch.Tensor]]:
    """{source name: rows} of about eval_tokens x weight tokens per source of a loaded eval mix.

    `data`: a `zerotrain.dataio.pipeline.loader.Data` after `load_data` (stores, or None for streamed sources).
    """
    if isinstance(eval_tokens, bool) or not isinstance(eval_tokens, int) or eval_tokens <= 0:
        raise DataError(f"--eval-tokens: must be a positive integer, got {eval_tokens!r}")
    out = {}
    for index, (spec, store) in enumerate(zip(data.specs, data.stores)):
        target = eval_tokens * spec.weight
        blocks = _stream_blocks(spec, data.tokenizer, seq_len) if store is None else _store_blocks(
            store, index, seed, data.tokenizer)
        docs, got = [], 0
        for block in blocks:
            for d in with_bos(block, data.tokenizer.bos_id if spec.bos else None):
                if got >= target:
                    break
                docs.append(d)
                got += len(d) + 1
            if got >= target:
                break
        if not docs:
            raise DataError(f"eval data: {spec.where()} yielded no documents")
        out[spec.name] = pack_rows(docs, seq_len, data.tokenizer.eos_id)
    return out


def _store_blocks(store: DocStore, index: int, seed: int, tokenizer):
    order = np.random.default_rng([seed, HOLDOUT_SALT, index]).permutation(len(store))
    for lo in range(0, len(order), ENCODE_BLOCK):
        yield _encode(store, order[lo:lo + ENCODE_BLOCK], tokenizer)


def _stream_blocks(spec: SourceSpec, tokenizer, seq_len: int | None = None):
    """A streamed source from its start, in order: every rank reads the same documents. SFT
    records come with their mask, overflow applied for seq_len (zerotrain.dataio.sources.sft.stream_block)."""
    def on_bad(why: str, record=None) -> None:
        if spec.bad_records == "stop":
            raise DataError(f"eval data: {bad_record(spec, why, record)}")

    renderer = ChatRenderer(tokenizer) if is_sft(spec) else None

    def encode(items):
        if renderer is None:
            return tokenizer.encode_batch(items)
        return stream_block(spec, items, tokenizer, renderer, seq_len, on_bad)

    texts = []
    for record in records(open_streamed(spec, 0, 1)):
        text = record if renderer is not None else record_text(
            spec, record, lambda why, record=record: on_bad(why, record))
        if renderer is not None or not no_text(text):
            texts.append(text)
        if len(texts) >= ENCODE_BLOCK:
            yield encode(texts)
            texts = []
    if texts:
        yield encode(texts)


def _encode(store: DocStore, ids: np.ndarray, tokenizer) -> list:
    """Token arrays (no EOS) of documents `ids`; the bytes of a text store are its byte tokens."""
    if store.kind == "tokens" or tokenizer.name == "bytes":
        return [store.doc(int(d)) for d in ids]
    out = []
    for lo in range(0, len(ids), ENCODE_BLOCK):
        out.extend(tokenizer.encode_batch([store.text(int(d)) for d in ids[lo:lo + ENCODE_BLOCK]]))
    return out


def pack_rows(docs: list, seq_len: int, eos_id: int) -> dict[str, torch.Tensor]:
    """All of `docs` packed into (N, seq_len) rows by the training packer, the last rows padded.

    The packer normally keeps its open rows for documents still to come; here no more come,
    so they are closed (in the order they were opened) and emitted too. Rows without a single
    token to predict (a lone EOS left over from a document of exactly seq_len tokens) are dropped.
    """
    packer = BestFitPacker(seq_len, eos_id, micro_batch=1, open_rows=64)
    for d in docs:
        packer.add_document(d)
    packer.ready.extend(packer.open.pop(rid) for rid in sorted(packer.open))
    packer.rooms.clear()

    def no_more(_: int) -> list:
        raise AssertionError("eval packing asked for more documents")  # ready rows are never short

    rows = [packer.next_batch(no_more) for _ in range(len(packer.ready))]
    rows = [r for r in rows if (r["labels"][:, 1:] != -100).any()]
    if not rows:
        raise DataError("eval data: no token to evaluate (documents too short)")
    return {k: torch.from_numpy(np.concatenate([r[k] for r in rows]).astype(np.int64)) for k in ROW_KEYS}
