"""Flat token files as a mix source (`"format": "tokens"`): the layout nanoGPT-style trainers write,
read in place, memory-mapped; `zerotrain prepare` is not needed.

    {"name": "owt", "weight": 0.8, "path": "DATASET/train.bin", "format": "tokens", "dtype": "uint16", "eos_id": 50256}

The file is nothing but token ids of `dtype` (uint16 or uint32, native little-endian, as numpy's
`tofile` writes them), documents back to back, each followed by the end-of-text id `eos_id` (nanoGPT's
openwebtext/prepare.py appends tiktoken's `<|endoftext|>`, 50256, to every document).

Documents: the runs of tokens between end-of-text ids. The end-of-text id ends the document it closes,
exactly as for every other source: the source hands the loader the document WITHOUT it and the packer
appends the tokenizer's EOS after every document (dataio/format/packing.py), so `doc EOS doc EOS` in the file is
`doc EOS doc EOS` in a packed row, each EOS at the end of its document's positions, and position ids
restart right after it (document masking holds). Tokens after the last end-of-text id are one more
document; an empty run (two end-of-text ids in a row, one at the start) is no document (counted as
empty). Long documents are cut into pieces like any other source's (zerotrain.dataio.format.pieces).

The tokenizer: the run's `--tokenizer` must be the one the file was made with (`--tokenizer gpt2` for
tiktoken's gpt2 ids: found in the Hugging Face cache as any hub tokenizer is). Refused in one line: a
vocabulary smaller than the file's largest id + 1, or an end-of-text id other than `eos_id`.

Start-up cost: the file is memory-mapped (`np.memmap`: a 10 GB file costs page cache, not process
memory), and one pass over it, in blocks, finds the end-of-text positions and the largest id. Its result
is cached on this node (ZEROTRAIN_CACHE, else $XDG_CACHE_HOME/zerotrain, else ~/.cache/zerotrain;
`token-files/`): a .npy of the end-of-text positions (read with allow_pickle=False: nothing is ever
unpickled) and a JSON of what was found, keyed by the file's real path, size, mtime and the sha256 of
a sample of its bytes (its first, middle and last MiB); a changed file is scanned again. The ranks of a
node scan once (a lock on the entry: the first scans, the others wait and read it). An unwritable cache
only means every start scans. The index kept per document is two int64 (16 bytes a document).

Exact resume and a world-size change need nothing of their own: the source is a DocStore like a
prepared shard's (kind "tokens"), so the loader's state (epoch, position, tokens taken: a pure function
of the seed and the counts consumed) and zerotrain.dataio.pipeline.reshard apply unchanged.

Not here: what a mix may say (zerotrain.dataio.format.mix validates `dtype`, `eos_id` and the file's size),
the loader (zerotrain.dataio.pipeline.loader).
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np

from zerotrain import durable
from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError

TOKEN_DTYPES = ("uint16", "uint32")
SCAN_BLOCK = 1 << 24  # tokens compared at a time: the block's boolean mask is the scan's only allocation
SAMPLE = 1 << 20  # bytes hashed at the start, middle and end of the file for the cache key
CACHE_VERSION = 1


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """This node's zerotrain cache: `cache_dir`, else ZEROTRAIN_CACHE, else $XDG_CACHE_HOME/zerotrain,
    else ~/.cache/zerotrain (shard verification keeps its record there too)."""
    base = cache_dir or os.environ.get("ZEROTRAIN_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerotrain"
    return Path(base)


def scan(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, int]:
    """(positions of eos_id, the largest id) in one pass over `tokens`, a block at a time."""
    found, top = [], 0
    for lo in range(0, len(tokens), SCAN_BLOCK):
        block = np.asarray(tokens[lo:lo + SCAN_BLOCK])
        found.append(np.flatnonzero(block == eos_id) + lo)
        top = max(top, int(block.max()))
    return (np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)), top


def documents(eos_at: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(starts, ends, empty runs) of the documents of n tokens whose end-of-text ids sit at `eos_at`:
    each document ends before its end-of-text id; what follows the last one is a document too."""
    starts = np.concatenate([[0], eos_at + 1])
    ends = np.concatenate([eos_at, [n]])
    keep = ends > starts
    empty = int(len(starts) - keep.sum()) - (0 if n == 0 or len(eos_at) == 0 or eos_at[-1] != n - 1 else 1)
    return starts[keep], ends[keep], empty


def _key(path: Path, dtype: str, eos_id: int) -> tuple[str, dict]:
    """The cache entry's name and identity: real path, size, mtime, dtype, eos_id, a sample's sha256."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for at in sorted({0, max(0, st.st_size // 2 - SAMPLE // 2), max(0, st.st_size - SAMPLE)}):
            f.seek(at)
            h.update(f.read(SAMPLE))
    ident = {"version": CACHE_VERSION, "path": os.path.realpath(path), "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "dtype": dtype, "eos_id": eos_id, "sample_sha256": h.hexdigest()}
    name = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return name, ident


def _read_cached(meta_path: Path, npy_path: Path, ident: dict, n: int):
    """(eos positions, max id) from the cache entry, or None when absent, stale or damaged."""
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or meta.get("identity") != ident or not isinstance(meta.get("max_id"), int):
            return None
        eos_at = np.load(npy_path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if eos_at.dtype != np.int64 or eos_at.ndim != 1 or len(eos_at) != meta.get("eos_count") or \
            (len(eos_at) and (eos_at[0] < 0 or eos_at[-1] >= n or np.any(np.diff(eos_at) <= 0))):
        return None
    return eos_at, meta["max_id"]


def scan_cached(path: Path, tokens: np.ndarray, dtype: str, eos_id: int, cache_dir=None) -> tuple[np.ndarray, int]:
    """`scan` of the file, through this node's cache (module docstring)."""
    name, ident = _key(path, dtype, eos_id)
    root = cache_root(cache_dir) / "token-files"
    meta_path, npy_path = root / f"{name}.json", root / f"{name}.npy"
    lock = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}.lock", "a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # a node's ranks: the first scans, the others then read its result
    except OSError:
        lock = None
    try:
        cached = _read_cached(meta_path, npy_path, ident, len(tokens))
        if cached is not None:
            return cached
        eos_at, top = scan(tokens, eos_id)
        try:
            buf = io.BytesIO()
            np.save(buf, eos_at, allow_pickle=False)
            durable.write_bytes(npy_path, buf.getvalue())
            durable.write_json(meta_path, {"identity": ident, "eos_count": len(eos_at), "max_id": top,
                                           "tokens": len(tokens)})  # written last: the entry's commit
        except OSError:
            pass  # an unwritable cache: the next start scans again
        return eos_at, top
    finally:
        if lock is not None:
            lock.close()


def load_token_file(spec, tokenizer=None, cache_dir=None) -> DocStore:
    """The source's documents as a DocStore of kind "tokens" over the memory-mapped file; with a
    tokenizer, the file's largest id and `eos_id` are checked against it (DataError, one line)."""
    path = Path(spec.path)
    try:
        tokens = np.memmap(path, dtype=np.dtype(spec.dtype), mode="r") if path.stat().st_size else np.zeros(0)
    except OSError as e:
        raise DataError(f"{spec.where()}: cannot read {path}: {e.strerror}") from None
    if len(tokens) == 0:
        raise DataError(f"{spec.where()}: {path} is empty: holds no tokens")
    eos_at, top = scan_cached(path, tokens, spec.dtype, spec.eos_id, cache_dir)
    if tokenizer is not None:
        if top >= tokenizer.vocab_size:
            raise DataError(f"{spec.where()}: {path} holds token id {top:,}, beyond the {tokenizer.vocab_size:,} ids of"
                            f" tokenizer {tokenizer.name}; pass the tokenizer the file was made with (--tokenizer gpt2"
                            " for GPT-2 BPE ids)")
        if tokenizer.eos_id != spec.eos_id:
            raise DataError(f"{spec.where()}: eos_id {spec.eos_id} is not tokenizer {tokenizer.name}'s end-of-text id"
                            f" {tokenizer.eos_id} (the packer ends every document with the tokenizer's); pass the"
                            " tokenizer the file was made with, or the file's own end-of-text id")
    starts, ends, empty = documents(eos_at, len(tokens))
    if len(starts) == 0:
        raise DataError(f"{spec.where()}: {path} holds no documents (only end-of-text ids {spec.eos_id})")
    return DocStore(name=spec.name, kind="tokens", chunks=[tokens.view(np.ndarray)],  # slicing a np.memmap is slow
                    chunk=np.zeros(len(starts), np.int32), start=starts, end=ends, empty_records=empty,
                    files=(str(path),))
