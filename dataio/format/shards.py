"""Prepared shards: a mix tokenized once into versioned binary files plus `manifest.json`.

Layout of a prepared directory (format "zerotrain-shards", version 1):

    manifest.json
    SOURCE-00000.tokens.npy    1-D uint16 (vocab <= 65536) or uint32 token ids, documents
                               back to back, no EOS (the packer adds it)
    SOURCE-00000.offsets.npy   1-D int64, documents + 1 entries: document d is
                               tokens[offsets[d]:offsets[d + 1]]

The manifest records, per shard: file names, sha256 of both files, token and document counts,
dtype, the tokenizer's sha256, and the source it came from; per source its documents, tokens,
bad records and the number of data files it was read from (null when streamed); plus the
tokenizer and the mix (weights and policies) it was made from; `zerotrain prepare`
(zerotrain.dataio.pipeline.prepare) writes them. Files are standard `.npy` (read with
`np.load(mmap_mode="r")`, `allow_pickle=False`): nothing is unpickled. Training memory-maps
them; every check in `verify()` runs at start-up, per shard in parallel threads.

Shards hold whole documents: the manifest's counts and hashes describe what `prepare` wrote.
Long documents are cut into pieces at load (`zerotrain.dataio.pipeline.loader.load_data`,
`zerotrain.dataio.format.pieces.cut_pieces`), in tokens, with the same bound and rules as a mix (byte-tokenizer shards only at UTF-8 character
starts, so a byte-tokenized mix and its shards give the same pieces and the same stream); the
pieces are index arrays over the memory-mapped shards, and nothing about them is written here.
SFT sources (`"format": "sft"` / `"chat"`) are refused: their response mask has no place here.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from zerotrain import durable
from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError, first_line
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.format.tokenfile import cache_root

FORMAT, VERSION = "zerotrain-shards", 1
SHARD_KEYS = {"file", "offsets_file", "source", "sha256", "offsets_sha256", "tokens", "documents", "dtype",
              "tokenizer_sha256"}
FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.(tokens|offsets)\.npy$")


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def token_dtype(vocab_size: int):
    """The dtype of a shard's token ids for a tokenizer of `vocab_size`."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


# --------------------------------------------------------------------------------------------
# manifest and verification
# --------------------------------------------------------------------------------------------

def read_manifest(root: Path) -> dict:
    where = f"shards {root}"
    path = root / "manifest.json"
    if not path.is_file():
        raise DataError(f"{where}: no manifest.json (--data takes a mix .json file or a `zerotrain prepare` directory)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: invalid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        found = m.get("format") if isinstance(m, dict) else None
        raise DataError(f"{path}: not a zerotrain shard manifest (format {found!r})")
    if m.get("version") != VERSION:
        raise DataError(f"{path}: manifest version {m.get('version')!r}; this zerotrain reads version {VERSION}")
    for key, kind in (("tokenizer", dict), ("mix", dict), ("sources", list), ("shards", list), ("dtype", str)):
        if not isinstance(m.get(key), kind):
            raise DataError(f"{path}: manifest field {key!r} missing or not a {kind.__name__}")
    if m["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"{path}: dtype {m['dtype']!r} (expected uint16 or uint32)")
    names = {s.get("name") for s in m["mix"].get("sources", []) if isinstance(s, dict)}
    for i, sh in enumerate(m["shards"]):
        if not isinstance(sh, dict) or set(sh) != SHARD_KEYS:
            raise DataError(f"{path}: shard #{i} has the wrong fields (expected {', '.join(sorted(SHARD_KEYS))})")
        for key in ("file", "offsets_file"):
            if not isinstance(sh[key], str) or not FILE_NAME.match(sh[key]):
                raise DataError(f"{path}: shard #{i}: {key} {sh[key]!r} is not a plain shard file name")
        if sh["source"] not in names:
            raise DataError(f"{path}: shard {sh['file']}: source {sh['source']!r} is not in the manifest's mix")
        for key in ("tokens", "documents"):
            if isinstance(sh[key], bool) or not isinstance(sh[key], int) or sh[key] < 0:
                raise DataError(f"{path}: shard {sh['file']}: {key} must be a non-negative integer")
    for name in names:
        if not any(sh["source"] == name for sh in m["shards"]):
            raise DataError(f"{path}: source {name!r} has no shards")
    return m


def manifest_specs(manifest: dict) -> tuple[SourceSpec, ...]:
    """The mix's sources as recorded (a list of paths comes back from JSON as a list: made a tuple)."""
    fields = set(SourceSpec.__dataclass_fields__)
    specs = tuple(SourceSpec(**{k: tuple(v) if k == "path" and isinstance(v, list) else v
                                for k, v in s.items() if k in fields}) for s in manifest["mix"]["sources"])
    for spec in specs:  # what the loader acts on, checked as a mix file's is (a hand-edited manifest)
        if not isinstance(spec.bos, bool):
            raise DataError(f"shard manifest: {spec.where()}: bos must be true or false, got {spec.bos!r}")
    return specs


def check_tokenizer(root: Path, manifest: dict, tokenizer) -> None:
    want = manifest["tokenizer"]
    if want.get("sha256") != tokenizer.sha256:
        raise DataError(f"shards {root}: tokenized with {want.get('name')!r} (sha256 {str(want.get('sha256'))[:12]}),"
                        f" but --tokenizer is {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]});"
                        " pass the same tokenizer")


# np.load parses a .npy header with ast.literal_eval, and CPython 3.11's AST builder is not safe to run from
# several threads at once: verify's threads failed at random with "SystemError: AST constructor recursion depth
# mismatch" (seen in this suite on 3.11.7). One header at a time (a header is a few hundred bytes; the
# memory map is lazy); the hashing, the work of a verify, stays parallel.
_NPY_HEADER = threading.Lock()


def _load_npy(path: Path, dtype: str, length: int, what: str) -> np.ndarray:
    try:
        with _NPY_HEADER:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{what}: file missing") from None
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{what}: corrupt or truncated .npy file ({first_line(e)})") from None
    if arr.dtype != np.dtype(dtype) or arr.ndim != 1:
        raise DataError(f"{what}: holds {arr.dtype} with shape {arr.shape}, manifest says 1-D {dtype}")
    if len(arr) != length:
        raise DataError(f"{what}: holds {len(arr):,} entries, manifest says {length:,}")
    return arr


def check_shard(root: Path, sh: dict, dtype: str, vocab_size: int, tokenizer_sha: str, hashes: bool = True,
                token_range: bool = True) -> dict:
    """Every check of one shard; raises DataError naming the shard. Returns what it measured.
    token_range=False skips the one check besides the hashes that reads every token."""
    what = f"shard {root / sh['file']}"
    if sh["dtype"] != dtype or sh["tokenizer_sha256"] != tokenizer_sha:
        raise DataError(f"{what}: dtype/tokenizer in its manifest entry differ from the manifest's")
    tokens = _load_npy(root / sh["file"], dtype, sh["tokens"], what)
    owhat = f"shard {root / sh['offsets_file']}"
    offsets = _load_npy(root / sh["offsets_file"], "int64", sh["documents"] + 1, owhat)
    if offsets[0] != 0 or offsets[-1] != len(tokens) or (len(offsets) > 1 and np.any(np.diff(offsets) <= 0)):
        raise DataError(f"{owhat}: document offsets are not increasing from 0 to {len(tokens):,}")
    if hashes:
        for file, key in ((sh["file"], "sha256"), (sh["offsets_file"], "offsets_sha256")):
            got = file_sha256(root / file)
            if got != sh[key]:
                raise DataError(f"shard {root / file}: sha256 mismatch (manifest {sh[key][:12]}...,"
                                f" file {got[:12]}...); the file changed or is corrupt: prepare the data again")
    top = None
    if token_range:
        top = int(tokens.max()) if len(tokens) else 0
        if top >= vocab_size:
            raise DataError(f"{what}: token id {top} >= the tokenizer's vocabulary size {vocab_size}")
    return {"file": sh["file"], "tokens": len(tokens), "documents": len(offsets) - 1, "max_token": top,
            "bytes": (root / sh["file"]).stat().st_size + (root / sh["offsets_file"]).stat().st_size}


class VerifiedCache:
    """This node's record of shard files whose sha256 and token range were checked (JSON, never
    unpickled): ZEROTRAIN_CACHE, else $XDG_CACHE_HOME/zerotrain, else ~/.cache/zerotrain, file
    verified-shards.json, keyed by host name and real path.

    A file counts as verified only while its identity is unchanged: device, inode, size, mtime and
    ctime in nanoseconds (a write to it, a copy over it or a rename onto it changes one of them),
    and only for the sha256 the manifest expects now. A cache that cannot be read or written is
    ignored: quick verification then hashes every time, as full does. As a context manager it
    reads the cache and, on exit, merges what was added under an exclusive lock; with hold_lock it
    holds that lock for the whole verification (quick mode: the node's first process hashes, the
    others wait for it and then find every shard known).
    """

    def __init__(self, cache_dir: Path | None = None, hold_lock: bool = False):
        self.path = cache_root(cache_dir) / "verified-shards.json"
        self.host = socket.gethostname()
        self.hold_lock = hold_lock
        self.entries: dict = {}
        self.added: dict = {}
        self.lock_file = None
        self.mutex = threading.Lock()  # verify's threads add entries concurrently

    def _lock(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.lock_file = open(self.path.with_suffix(".lock"), "a")
            fcntl.flock(self.lock_file, fcntl.LOCK_EX)
        except OSError:
            self.lock_file = None

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (OSError, ValueError):  # unreadable or corrupt: as if empty
            return {}
        return entries if isinstance(entries, dict) else {}

    def __enter__(self):
        if self.hold_lock:
            self._lock()
        self.entries = self._read()
        return self

    def __exit__(self, *exc):
        try:
            if self.added:
                if self.lock_file is None:
                    self._lock()
                merged = {**self._read(), **self.added}  # another process may have written meanwhile
                prefix = f"{self.host}:"  # forget this node's files that are gone (test and scratch data)
                merged = {k: v for k, v in merged.items() if not k.startswith(prefix) or os.path.exists(k[len(prefix):])}
                durable.write_json(self.path, merged, indent=0, sort_keys=True)
        except OSError:
            pass
        finally:
            if self.lock_file is not None:
                self.lock_file.close()  # releases the lock
                self.lock_file = None

    @staticmethod
    def identity(path: Path) -> list[int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def identities(self, root: Path, sh: dict) -> tuple:
        return self.identity(root / sh["file"]), self.identity(root / sh["offsets_file"])

    def _key(self, path: Path) -> str:
        return f"{self.host}:{os.path.realpath(path)}"

    def known(self, root: Path, sh: dict, vocab_size: int) -> bool:
        """Both files of the shard verified before, unchanged since, against today's manifest."""
        tok = self.entries.get(self._key(root / sh["file"]))
        off = self.entries.get(self._key(root / sh["offsets_file"]))
        tok_id, off_id = self.identities(root, sh)
        return (isinstance(tok, dict) and isinstance(off, dict) and tok_id is not None and off_id is not None
                and tok.get("identity") == tok_id and tok.get("sha256") == sh["sha256"]
                and off.get("identity") == off_id and off.get("sha256") == sh["offsets_sha256"]
                and isinstance(tok.get("max_token"), int) and tok["max_token"] < vocab_size)

    def add(self, root: Path, sh: dict, max_token: int, before: tuple) -> None:
        """Record a shard that passed every check; `before`: its files' identities before hashing."""
        if before != self.identities(root, sh):  # changed while it was being hashed: not verified
            return
        with self.mutex:
            self.added[self._key(root / sh["file"])] = {"identity": before[0], "sha256": sh["sha256"],
                                                        "max_token": max_token}
            self.added[self._key(root / sh["offsets_file"])] = {"identity": before[1],
                                                                "sha256": sh["offsets_sha256"]}


VERIFY_MODES = ("full", "quick")


def verify(root: Path, manifest: dict, tokenizer=None, hashes: bool = True, threads: int | None = None,
           mode: str = "full", cache_dir: Path | None = None) -> list[dict]:
    """All checks of all shards, in parallel threads; the first failing shard (manifest order) is reported.

    mode "full": every check of every shard (sha256 of both files, the token-id range), as
    `zerotrain verify` does; shards that pass are recorded in this node's cache (below).
    mode "quick" (for every start-up after the first on a node): the manifest, every file's size,
    dtype and length (the .npy headers) and the document offsets, for every shard; the sha256 and
    the token-id range only for shards this node has not verified before, by file identity
    (`verified_cache`). One process per node hashes at a time (a lock on the cache), so the ranks of
    a node that start together hash each shard once, not once each.
    Each result says whether the shard was hashed now (`hashed`).
    """
    if mode not in VERIFY_MODES:
        raise DataError(f"shard verification mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    if tokenizer is not None:
        check_tokenizer(root, manifest, tokenizer)
    vocab = int(manifest["tokenizer"]["vocab_size"])
    threads = threads or min(8, os.cpu_count() or 1)
    with VerifiedCache(cache_dir, hold_lock=mode == "quick") as cache:
        def check(sh):
            if mode == "quick" and hashes and cache.known(root, sh, vocab):
                return {**check_shard(root, sh, manifest["dtype"], vocab, manifest["tokenizer"]["sha256"], False,
                                      token_range=False), "hashed": False}
            before = cache.identities(root, sh)  # what was hashed is the file as it was before hashing
            result = check_shard(root, sh, manifest["dtype"], vocab, manifest["tokenizer"]["sha256"], hashes)
            if hashes:
                cache.add(root, sh, result["max_token"], before)
            return {**result, "hashed": hashes}

        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(check, sh) for sh in manifest["shards"]]
            results, first_error = [], None
            for f in futures:
                try:
                    results.append(f.result())
                except DataError as e:
                    first_error = first_error or e
    if first_error:
        raise first_error
    by_source = {}
    for sh in manifest["shards"]:
        by_source.setdefault(sh["source"], [0, 0])
        by_source[sh["source"]][0] += sh["tokens"]
        by_source[sh["source"]][1] += sh["documents"]
    for s in manifest["sources"]:
        if by_source.get(s["name"]) != [s["tokens"], s["documents"]]:
            raise DataError(f"{root / 'manifest.json'}: source {s['name']!r}: shard counts {by_source.get(s['name'])}"
                            f" do not add up to the source's [{s['tokens']}, {s['documents']}]")
    return results


def load_stores(root: Path, manifest: dict) -> list[DocStore]:
    """One DocStore of token ids per source, its chunks memory-mapped shards."""
    stores = []
    for spec in manifest_specs(manifest):
        chunks, cid, starts, ends, files = [], [], [], [], []
        for sh in manifest["shards"]:
            if sh["source"] != spec.name:
                continue
            files.append(sh["file"])
            tokens = np.load(root / sh["file"], mmap_mode="r", allow_pickle=False)
            offsets = np.load(root / sh["offsets_file"], allow_pickle=False)
            chunks.append(tokens.view(np.ndarray))  # plain views: slicing a np.memmap is slow
            cid.append(np.full(len(offsets) - 1, len(chunks) - 1, np.int32))
            starts.append(offsets[:-1])
            ends.append(offsets[1:])
        stores.append(DocStore(name=spec.name, kind="tokens", chunks=chunks, chunk=np.concatenate(cid),
                               start=np.concatenate(starts), end=np.concatenate(ends), files=tuple(files)))
    return stores


def read_speed(root: Path, manifest: dict, seconds: float = 3.0) -> tuple[float, float]:
    """(tokens/s, bytes/s) reading shards through their memory maps (page cache as it is)."""
    n_tok = n_bytes = 0
    t0 = time.time()
    while True:
        for sh in manifest["shards"]:
            arr = np.load(root / sh["file"], mmap_mode="r", allow_pickle=False)
            for lo in range(0, len(arr), 1 << 24):
                np.asarray(arr[lo:lo + (1 << 24)]).sum()
            n_tok += len(arr)
            n_bytes += arr.nbytes
        if time.time() - t0 >= seconds:
            break
    dt = time.time() - t0
    return n_tok / dt, n_bytes / dt
