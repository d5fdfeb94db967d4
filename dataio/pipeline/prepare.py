"""`zerotrain prepare`: a mix tokenized once into prepared shards (zerotrain.dataio.format.shards holds their
layout, manifest and checks). Every source form a mix takes is read (a glob, a directory of shards, an `hf`
snapshot directory, a streamed hub dataset: zerotrain.dataio.sources); the shards are written to a temporary
directory and renamed, so an existing `--out` is never touched.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from zerotrain import durable
from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import SourceSpec, check_bos, parse_mix
from zerotrain.dataio.format.shards import FORMAT, VERSION, file_sha256, token_dtype
from zerotrain.dataio.sources.readers import load_text_source
from zerotrain.dataio.sources.streamed import bad_record, open_streamed, record_text, records


def iter_documents(spec: SourceSpec, tokenizer, max_tokens: int | None = None, store: DocStore | None = None):
    """(token array, byte length) for every document of a source, in order; at most max_tokens."""
    seen = 0
    if spec.streamed:
        ds = open_streamed(spec, 0, 1)
        bad = []
        texts = []

        def on_bad(why, record=None):
            if spec.bad_records == "stop":
                raise DataError(bad_record(spec, why, record))
            bad.append(why)

        def flush():
            return tokenizer.encode_batch(texts)

        for record in records(ds):
            text = record_text(spec, record, lambda why, record=record: on_bad(why, record))
            if text:
                texts.append(text)
            if len(texts) >= 1024:
                for t in flush():
                    yield t
                    seen += len(t)
                    if max_tokens and seen >= max_tokens:
                        return
                texts = []
        for t in flush():
            yield t
            seen += len(t)
            if max_tokens and seen >= max_tokens:
                return
        return
    store = store or load_text_source(spec)
    for lo in range(0, len(store), 1024):
        hi = min(len(store), lo + 1024)
        if tokenizer.name == "bytes":
            docs = [store.doc(d) for d in range(lo, hi)]
        else:
            docs = tokenizer.encode_batch([store.text(d) for d in range(lo, hi)])
        for t in docs:
            yield t
            seen += len(t)
            if max_tokens and seen >= max_tokens:
                return


def prepare(mix_path: str, tokenizer, out: str | Path, shard_tokens: int = 100_000_000,
            max_tokens_per_source: int | None = None, log=print) -> Path:
    """Tokenize every source of a mix into shards under `out` (written to a temporary directory
    first, then renamed: an existing `out` is never touched)."""
    mix = parse_mix(mix_path)
    for spec in mix.sources:  # shards hold unsigned token ids: no room for the response mask (dataio/sft.py)
        if spec.format == "tokens":
            raise DataError(f"{spec.where()}: format tokens is token ids already: train from the mix itself"
                            " (zerotrain prepare is not needed)")
        if spec.format != "text":
            raise DataError(f"{spec.where()}: format {spec.format}: zerotrain prepare does not take SFT records (shards"
                            " cannot keep the response mask); train from the mix itself (records are tokenized at"
                            " start-up)")
    check_bos(mix.sources, tokenizer, str(mix_path))
    out = Path(out)
    if out.exists():
        raise DataError(f"--out {out}: already exists; prepare writes a new directory (pick another --out)")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    manifest = {"format": FORMAT, "version": VERSION, "created_by": "zerotrain prepare",
                "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                              "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id},
                "dtype": np.dtype(dtype).name,
                "mix": {"path": str(mix_path), "warn_epochs": mix.warn_epochs,
                        "sources": [s.to_dict() for s in mix.sources]},
                "sources": [], "shards": []}
    try:
        for spec in mix.sources:
            t0 = time.time()
            store = None if spec.streamed else load_text_source(spec)
            n_docs = n_tok = 0
            pending, pending_tokens, k = [], 0, 0

            def flush():
                nonlocal pending, pending_tokens, k
                if not pending:
                    return
                lengths = np.fromiter((len(t) for t in pending), np.int64, len(pending))
                offsets = np.zeros(len(pending) + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                tokens = np.concatenate(pending).astype(dtype, copy=False)
                base = f"{spec.name}-{k:05d}"
                np.save(tmp / f"{base}.tokens.npy", tokens, allow_pickle=False)
                np.save(tmp / f"{base}.offsets.npy", offsets, allow_pickle=False)
                manifest["shards"].append({
                    "file": f"{base}.tokens.npy", "offsets_file": f"{base}.offsets.npy", "source": spec.name,
                    "sha256": file_sha256(tmp / f"{base}.tokens.npy"),
                    "offsets_sha256": file_sha256(tmp / f"{base}.offsets.npy"),
                    "tokens": int(len(tokens)), "documents": int(len(pending)), "dtype": np.dtype(dtype).name,
                    "tokenizer_sha256": tokenizer.sha256})
                pending, pending_tokens, k = [], 0, k + 1

            for doc in iter_documents(spec, tokenizer, max_tokens_per_source, store):
                if len(doc) == 0:
                    continue
                pending.append(doc)
                pending_tokens += len(doc)
                n_docs += 1
                n_tok += len(doc)
                if pending_tokens >= shard_tokens:
                    flush()
            flush()
            if n_docs == 0:
                raise DataError(f"{spec.where()}: holds no documents")
            manifest["sources"].append({"name": spec.name, "documents": n_docs, "tokens": n_tok,
                                        "bad_records": store.bad_records if store else 0,
                                        "files": len(store.files) if store else None})
            dt = time.time() - t0
            read = f"{len(store.files):,} file(s)" if store else "the stream"
            log(f"prepare: {spec.name}: {n_docs:,} documents, {n_tok:,} tokens from {read} in {k} shard(s)"
                f" ({n_tok / max(dt, 1e-9) / 1e6:.1f}M tokens/s)")
        durable.write_json(tmp / "manifest.json", manifest)
        tmp.rename(out)
        durable.fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


