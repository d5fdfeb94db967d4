"""A rank's stream of packed batches from a weighted mix of sources, and its exact state.

Mixing is by TOKENS: the next document always comes from the source with the fewest tokens
taken so far relative to its weight (smallest tokens_taken / weight, ties to the first source;
weighted fair queueing). Deterministic, no sampling noise, and every source stays within one
document of its share. Documents count with their EOS. The schedule is computed in vectorised
blocks that reproduce the one-document-at-a-time rule exactly.

Each local source's documents are split across ranks (document i goes to rank i % world) and
visited in a fresh seeded permutation every epoch (seed, source, epoch, rank). When a source
runs out, its `on_exhausted` policy applies: "restart" begins its next epoch (a new permutation),
"stop" ends the stream: the driver stops the whole run, on every rank, at the last step every
rank could fill (never a hang, never a repeated document). Streamed sources (hub datasets) are
read in order, without shuffling, through `datasets` + `split_dataset_by_node`; their position is
the IterableDataset's own `state_dict()` plus a count of documents into the current block.

`state_dict()` holds everything needed to continue exactly: per source the epoch, position and
tokens taken (the permutations are recomputed from the seed, so there is no RNG state to save),
the streamed sources' dataset states, and the packer's carry-over.

SFT sources (dataio/sources/sft.py) go through the same path: their documents are signed token arrays
(the loss mask in the sign), tokenized with the mask in `load_data` (local) or per block
(streamed), never cut into pieces; `make_batch` turns the sign into labels. A mix with an SFT
source is "token-weighted" (`token_weighted`): its loss is the mean over the global batch's
labelled tokens (`trainable_tokens` counts them per micro-batch), not a mean of micro-batch means.

Why one file of ~500 lines: it is one concern, a rank's stream and its exact state. The schedule, the packer's
carry-over and the worker hand-off all write the one `state_dict()` a resume must reproduce bit for bit, and
read in order here; the parts that stand alone have their own modules: the mix format, readers, the document
store, pieces, shards, SFT records, and each source's cursor on this rank (zerotrain.dataio.pipeline.cursors).
"""
from __future__ import annotations

import hashlib
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from zerotrain.dataio.format import shards
from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.mix import Mix, SourceSpec, check_bos, parse_mix
from zerotrain.dataio.format.packing import check_packing, make_packer, to_torch, with_bos
from zerotrain.dataio.format.pieces import make_pieces
from zerotrain.dataio.pipeline.cursors import IndexedSource, StreamedSource
from zerotrain.dataio.sources.holdout import split_holdout
from zerotrain.dataio.sources.hub import materialise
from zerotrain.dataio.sources.readers import load_text_source, record_where
from zerotrain.dataio.sources.sft import is_sft, tokenize_store


class Exhausted(Exception):
    """A source with on_exhausted "stop" has no documents left on this rank."""


@dataclass
class Data:
    """Everything loaded and checked before training starts, shared by all ranks' streams."""
    kind: str  # "mix" or "shards"
    path: str
    specs: tuple[SourceSpec, ...]
    tokenizer: object
    stores: list  # DocStore per source (its documents cut into pieces), or None for a streamed source
    warn_epochs: float = 4.0
    manifest: dict = field(default_factory=dict)
    piece_len: int | None = None  # the piece bound asked for (load_data); a source may be cut finer
    world: int = 1  # ranks, and data workers per rank (0: none), the pieces were made for
    workers: int = 0
    eval_stores: list | None = None  # held-out DocStores per source (dataio/sources/holdout.py), None: no holdout
    seq_len: int | None = None  # the row length SFT records must fit (load_data); None: records kept whole

    @property
    def token_weighted(self) -> bool:
        """Whether the loss is the mean over the global batch's labelled tokens (a mix with an SFT
        source) rather than today's mean of per-micro-batch means (pretraining mixes, unchanged)."""
        return token_weighted(self.specs)

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.specs]

    def epochs(self, run_tokens: int) -> list[tuple[str, float, int]]:
        """Per source of known size: (name, epochs a run of `run_tokens` tokens reads of it, its tokens)."""
        return [(spec.name, run_tokens * spec.weight / size, size)
                for spec, (size, _) in zip(self.specs, self.source_tokens()) if size]

    def source_tokens(self) -> list[tuple[int | None, bool]]:
        """Per source (tokens incl. EOS and a "bos" source's BOS, exact?) over the whole source; None when
        unknown."""
        out = []
        for spec, store in zip(self.specs, self.stores):
            ends = len(store) * (1 + spec.bos) if store is not None else 0  # an EOS (and a BOS) per document
            if store is None:
                out.append((None, False))
            elif store.kind == "tokens" or self.tokenizer.name == "bytes":
                out.append((int(store.lengths.sum()) + ends, True))
            else:  # estimate from a sample of documents
                sample = np.linspace(0, len(store) - 1, min(len(store), 200)).astype(int)
                texts = [store.text(int(d)) for d in sample]
                n_tok = sum(len(t) for t in self.tokenizer.encode_batch(texts))
                n_bytes = sum(int(store.lengths[d]) for d in sample)
                out.append((int(store.lengths.sum() * n_tok / max(1, n_bytes)) + ends, False))
        return out


def open_data(path: str, tokenizer, fetch: bool = True) -> Data:
    """Parse a mix file or a prepared shard directory (nothing is read yet). A mix's `"download": true`
    hub sources become their local snapshot directories: cached, else downloaded now unless fetch=False
    (a dry run); offline, a hub source with nothing cached is refused (zerotrain.dataio.sources.hub.materialise)."""
    p = Path(path)
    if p.is_dir():
        manifest = shards.read_manifest(p)
        shards.check_tokenizer(p, manifest, tokenizer)
        return Data(kind="shards", path=str(p), specs=shards.manifest_specs(manifest), tokenizer=tokenizer,
                    stores=[], warn_epochs=manifest["mix"].get("warn_epochs", 4.0), manifest=manifest)
    if p.suffix == ".bin":  # a flat token file says neither its id type nor its end-of-text id: a mix does
        raise DataError(f"{path}: a flat token file is read through a mix that names its dtype and eos_id, e.g."
                        f' {{"sources": [{{"path": "{p.name}", "format": "tokens", "dtype": "uint16", "eos_id": 50256}}]}}')
    mix: Mix = parse_mix(p)
    return Data(kind="mix", path=str(p), specs=materialise(mix.sources, fetch), tokenizer=tokenizer, stores=[],
                warn_epochs=mix.warn_epochs)


def load_data(data: Data, piece_len: int | None = None, world: int = 1, workers: int = 0,
              holdout: tuple[int, int] | None = None, seq_len: int | None = None, verify: str = "full") -> Data:
    """Read every local source (or verify and map every shard), cut long documents into pieces,
    and check that every source can be split across the ranks; all checks happen here, before
    any model is built, and give the same result on every rank (nothing depends on the rank).

    piece_len: the piece bound in the loader's units (tokens for shards, bytes for text; see
    zerotrain.dataio.format.pieces); the driver passes `--piece-len` or `default_piece_len(seq_len)`; None: no
    bound (documents are cut only where a source has fewer than world x workers of them).
    world, workers: the ranks and the data workers per rank (the profile's zerotrain.dataloader
    workers, 0 for none) that the documents will be split across, as in `Batches`.
    seq_len: the row length; SFT records longer than it follow their source's `overflow` policy
    (zerotrain.dataio.sources.sft; counted in the summary). None: SFT records are kept whole, however long.
    verify: prepared shards' check, zerotrain.dataio.format.shards.verify's mode ("full", or "quick": hashes once
    per node).
    """
    data.seq_len = seq_len
    check_bos(data.specs, data.tokenizer, data.path)
    if data.kind == "shards":
        shards.verify(Path(data.path), data.manifest, data.tokenizer, mode=verify)
        stores = shards.load_stores(Path(data.path), data.manifest)
    else:
        stores = [None if s.streamed else load_text_source(s, data.tokenizer) for s in data.specs]
        # SFT records -> signed tokens (the mask in the sign), overflow applied: exact counts before training.
        stores = [tokenize_store(st, s, data.tokenizer, seq_len, lambda d, st=st: record_where(st, d))
                  if st is not None and is_sft(s) else st for s, st in zip(data.specs, stores)]
    if holdout is not None:  # (seed, eval_tokens): whole documents held out for evaluation, before any cutting
        stores, data.eval_stores = split_holdout(stores, data.specs, *holdout, data.tokenizer)
    return cut_data(data, stores, piece_len, world, workers)


def missing_bos(data: Data) -> list[str]:
    """The warning for a tokenizer that transformers puts a BOS before every text with (a Llama's: the model it
    came with was trained with one at each document's start, and evaluation harnesses encode so) when text
    sources of the mix train without it ("bos": true adds it). SFT sources are left to their chat template."""
    tok = data.tokenizer
    without = [s.name for s in data.specs if not s.bos and not is_sft(s)]
    if not without or not getattr(tok, "adds_bos", False):
        return []
    fix = (f"prepare the shards {data.path} again from a mix with \"bos\": true (theirs had none)"
           if data.kind == "shards" else f"set \"bos\": true in the mix {data.path}")
    return [f"tokenizer {tok.name} puts BOS {tok.special_text(tok.bos_id)!r} (id {tok.bos_id}) before every text"
            f" transformers encodes, and the model it came with was trained so; source(s) {', '.join(without)}"
            f" train without it: {fix} (docs/data.md)"]


def bos_differs(train: Data, evaluated: Data, where: str) -> list[str]:
    """The warning for an eval mix whose text sources put BOS before their documents where the training mix's do
    not, or the other way round: the rows would be scored on documents shaped otherwise than trained."""
    trained = {s.bos for s in train.specs if not is_sft(s)}
    if len(trained) != 1:  # no text source, or some with BOS and some without: nothing to compare with
        return []
    (bos,) = trained
    other = [s.name for s in evaluated.specs if not is_sft(s) and s.bos != bos]
    if not other:
        return []
    return [f"--eval-data {where}: source(s) {', '.join(other)} evaluate documents {'without' if bos else 'with'}"
            f" BOS, the training mix's documents are {'with' if bos else 'without'} it (\"bos\" in the mix:"
            " docs/data.md)"]


def cut_data(data: Data, stores: list, piece_len: int | None, world: int, workers: int = 0) -> Data:
    """`data` with `stores` (uncut, None for streamed sources) cut into pieces for world x workers."""
    if piece_len is not None and (isinstance(piece_len, bool) or not isinstance(piece_len, int) or piece_len < 1):
        raise DataError(f"piece length: must be a positive integer, got {piece_len!r}")
    parts = world * max(1, workers)
    across = f"{world} rank{'s' if world > 1 else ''}" + (f" x {workers} data worker(s)" if workers else "")
    # Text is cut at UTF-8 character starts; token ids (shards, flat token files) only where they are the
    # byte tokenizer's UTF-8 bytes, where the text itself would be cut.
    bytes_ids = data.tokenizer.name == "bytes"
    data.stores = [None if st is None else whole_records(st, spec, parts, across) if is_sft(spec) else
                   make_pieces(st, piece_len, parts, st.kind == "text" or bytes_ids, across)
                   for spec, st in zip(data.specs, stores)]
    data.piece_len, data.world, data.workers = piece_len, world, workers
    return data


def whole_records(store: DocStore, spec: SourceSpec, parts: int, across: str) -> DocStore:
    """An SFT source is never cut (one record = one document): it needs a record per part."""
    if len(store) < parts:
        raise DataError(f"{spec.where()}: {len(store)} SFT record(s) cannot be split across {across} (records are"
                        " never cut into pieces); add records or use fewer ranks")
    return store


def token_weighted(specs) -> bool:
    """A mix with an SFT source: loss = mean over the labelled tokens of the whole global batch."""
    return any(is_sft(s) for s in specs)


def trainable_tokens(batch: dict) -> int:
    """Tokens of a batch that carry a label: what the model's loss averages over (it predicts
    labels[:, 1:] from positions :-1, so the first column never counts)."""
    return int((batch["labels"][:, 1:] != -100).sum())


# --------------------------------------------------------------------------------------------
# The mix
# --------------------------------------------------------------------------------------------

class MixedStream:
    """Documents from all sources in token-share order (see the module docstring)."""

    def __init__(self, data: Data, rank: int, world: int, seed: int):
        self.names = [s.name for s in data.specs]
        self.weights = np.asarray(data.weights, np.float64)
        self.sources = [StreamedSource(spec, data.tokenizer, rank, world, data.seq_len) if store is None else
                        IndexedSource(store, spec, data.tokenizer, i, rank, world, seed)
                        for i, (spec, store) in enumerate(zip(data.specs, data.stores))]
        # "bos": true sources: the tokenizer's BOS before each document, counted in its length and its tokens
        self.bos = [data.tokenizer.bos_id if spec.bos else None for spec in data.specs]
        self.tokens = [0] * len(self.sources)  # tokens taken per source, EOS (and BOS) included
        self.documents = [0] * len(self.sources)
        self._block = 64

    def next_documents(self, need: int) -> list:
        """Documents (token arrays, no EOS) whose lengths + 1 add up to at least `need`."""
        out, got = [], 0
        while got < need:
            k = self._block
            lens = [s.peek_lengths(k) + 1 + (bos is not None) for s, bos in zip(self.sources, self.bos)]
            vt, src, horizon = [], [], []
            for i, ln in enumerate(lens):
                end = np.cumsum(ln)
                vt.append((self.tokens[i] + end - ln) / self.weights[i])  # virtual start time of each doc
                src.append(np.full(len(ln), i))
                horizon.append(((self.tokens[i] + (int(end[-1]) if len(ln) else 0)) / self.weights[i], i))
            h_time, h_src = min(horizon)  # nothing at or after this point is known yet
            vt, src, ln = np.concatenate(vt), np.concatenate(src), np.concatenate(lens)
            ok = (vt < h_time) | ((vt == h_time) & (src < h_src))
            if not ok.any():
                raise Exhausted(self.names[h_src])
            order = np.flatnonzero(ok)[np.lexsort((src[ok], vt[ok]))]
            cum = np.cumsum(ln[order])
            m = min(len(order), int(np.searchsorted(cum, need - got)) + 1)
            chosen = src[order[:m]]
            counts = np.bincount(chosen, minlength=len(self.sources))
            taken = [iter(with_bos(self.sources[i].take(int(c)), self.bos[i])) if c else None
                     for i, c in enumerate(counts)]
            out.extend(next(taken[i]) for i in chosen.tolist())
            for i, c in enumerate(counts):
                if c:
                    self.tokens[i] += int(ln[order[:m]][chosen == i].sum())
                    self.documents[i] += int(c)
            got += int(cum[m - 1])
            # Size the next look-ahead from how many documents this one needed.
            self._block = int(min(4096, max(16, 2 * m // len(self.sources) + 8)))
        return out

    def token_shares(self) -> dict[str, float]:
        total = sum(self.tokens) or 1
        return {n: t / total for n, t in zip(self.names, self.tokens)}

    def state_dict(self) -> dict:
        return {"tokens": list(self.tokens), "documents": list(self.documents),
                "sources": [{**s.state_dict(), **({"n": s.n} if isinstance(s, IndexedSource) else {})}
                            for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["sources"]) != len(self.sources):
            raise DataError(f"loader state has {len(state['sources'])} sources, the data has {len(self.sources)}")
        self.tokens, self.documents = list(state["tokens"]), list(state["documents"])
        for s, st in zip(self.sources, state["sources"]):
            s.load_state_dict(st)


class PackedLoader:
    """micro_batch rows of seq_len tokens per call; None once a "stop" source has run out.

    `carried`: documents (token arrays, EOS not included) that go to the packer before anything
    new from the stream. Only a resume on another world size fills it, with what other ranks'
    packers held (their tokens were counted by the stream when taken; they are not counted again).
    """

    def __init__(self, stream: MixedStream, seq_len: int, micro_batch: int, eos_id: int, stop_possible: bool = True,
                 packing: str = "best-fit"):
        self.stream = stream
        self.packer = make_packer(packing, seq_len, eos_id, micro_batch, stream_may_end=stop_possible)
        self.stop_possible = stop_possible
        self.exhausted: str | None = None
        self.carried: deque = deque()

    def _next_documents(self, need: int) -> list:
        out = []
        while self.carried and need > 0:
            out.append(self.carried.popleft())
            need -= len(out[-1]) + 1
        return out + self.stream.next_documents(need) if need > 0 else out

    def next_batch(self):
        if self.exhausted:
            return None
        before = self.state_dict() if self.stop_possible else None
        try:
            take = self._next_documents if self.carried else self.stream.next_documents
            return to_torch(self.packer.next_batch(take))
        except Exhausted as e:
            self.load_state_dict(before)  # the partial batch is not consumed
            self.exhausted = str(e)
            return None

    def state_dict(self) -> dict:
        state = {"stream": self.stream.state_dict(), "packer": self.packer.state_dict()}
        if self.carried:  # only after a world-size change: older states stay as they were
            state["carried"] = [d.astype(np.int32) for d in self.carried]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.packer.load_state_dict(state["packer"])
        self.carried = deque(np.asarray(d, np.int64) for d in state.get("carried", ()))


def make_loader(data: Data, rank: int, world: int, seed: int, seq_len: int, micro_batch: int,
                packing: str = "best-fit") -> PackedLoader:
    stop = any(s.on_exhausted == "stop" for s in data.specs)
    check_packing(packing, data.specs)
    return PackedLoader(MixedStream(data, rank, world, seed), seq_len, micro_batch, data.tokenizer.eos_id, stop,
                        packing)


def plain(state):
    """A loader state as plain lists/ints (what goes into the checkpoint's client_state)."""
    if isinstance(state, np.ndarray):
        return state.tolist()
    if isinstance(state, dict):
        return {k: plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [plain(v) for v in state]
    return state


# --------------------------------------------------------------------------------------------
# Background workers (the profile's zerotrain.dataloader section)
# --------------------------------------------------------------------------------------------

DATALOADER_DEFAULTS = {"workers": 0, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}
# (the driver adds "packing" to the settings it hands to Batches; it is not a profile key)


def dataloader_settings(section, where: str) -> dict:
    """The profile's `zerotrain.dataloader` section, validated, with defaults."""
    section = section or {}
    if not isinstance(section, dict):
        raise DataError(f"{where}: zerotrain.dataloader must be an object")
    unknown = set(section) - set(DATALOADER_DEFAULTS)
    if unknown:
        raise DataError(f"{where}: zerotrain.dataloader: unknown key(s) {', '.join(sorted(unknown))}")
    out = {**DATALOADER_DEFAULTS, **section}
    for key in ("workers", "prefetch_factor"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "workers" else 1):
            raise DataError(f"{where}: zerotrain.dataloader.{key} must be an integer >= "
                            f"{0 if key == 'workers' else 1}, got {v!r}")
    for key in ("pin_memory", "persistent_workers"):
        if not isinstance(out[key], bool):
            raise DataError(f"{where}: zerotrain.dataloader.{key} must be true or false, got {out[key]!r}")
    return out


class _WorkerBatches(torch.utils.data.IterableDataset):
    """Worker w yields (batch, w, its loader state after the batch, exhausted source or None)."""

    def __init__(self, data, rank, world, seed, seq_len, micro_batch, packing, workers, states):
        self.args = (data, rank, world, seed, seq_len, micro_batch, packing)
        self.workers, self.states = workers, states

    def __iter__(self):
        w = torch.utils.data.get_worker_info().id
        data, rank, world, seed, seq_len, micro_batch, packing = self.args
        loader = make_loader(data, rank * self.workers + w, world * self.workers, seed, seq_len, micro_batch, packing)
        if self.states is not None:
            loader.load_state_dict(self.states[w])
        while True:
            batch = loader.next_batch()
            yield batch, w, _pending_as_count(loader.state_dict()), loader.exhausted


def _leave_signals_to_the_rank(worker_id: int) -> None:
    """A worker ignores SIGTERM and SIGINT. `zerotrain launch`, a scheduler's preemption and Ctrl-C signal the
    whole process group: a worker that died of it made its rank's next fetch a RuntimeError ("DataLoader worker
    is killed by signal: Terminated", exit 143) instead of the rank's save and exit 6. The rank decides
    (guards.SignalStop) and shuts its workers down as at any end; torch's workers also end when their rank dies."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_is(item):
    return item  # batches are tensors already; states stay numpy (the default would convert them)


def _pending_as_count(state: dict) -> dict:
    """A worker's loader state with each source's pending documents (zerotrain.dataio.pipeline.reshard) replaced by
    how many are left. After a world-size change there can be millions of them; the list only
    ever shrinks from the front, so Batches rebuilds it from the one it loaded (_pending_back)
    instead of receiving it again with every batch."""
    sources = state["stream"]["sources"]
    if not any("pending" in s for s in sources):
        return state
    sources = [{**{k: v for k, v in s.items() if k != "pending"}, "pending_left": len(s["pending"])}
               if "pending" in s else s for s in sources]
    return {**state, "stream": {**state["stream"], "sources": sources}}


def _pending_arrays(state: dict) -> dict:
    """A loaded part's state with its pending documents as numpy arrays (converted once)."""
    sources = [{**s, "pending": np.asarray(s["pending"], np.int64)} if "pending" in s else s
               for s in state["stream"]["sources"]]
    return {**state, "stream": {**state["stream"], "sources": sources}}


def _pending_back(state: dict, loaded: dict) -> dict:
    """Undo _pending_as_count with the part's state as it was loaded (pending as numpy arrays)."""
    sources = state["stream"]["sources"]
    if not any("pending_left" in s for s in sources):
        return state
    out = []
    for s, at_load in zip(sources, loaded["stream"]["sources"]):
        if "pending_left" in s:
            full = at_load["pending"]
            s = {**{k: v for k, v in s.items() if k != "pending_left"},
                 "pending": full[len(full) - s["pending_left"]:]}
        out.append(s)
    return {**state, "stream": {**state["stream"], "sources": out}}


class Batches:
    """The driver's view: `next()` -> batch dict (torch) or None once data is exhausted.

    workers == 0: batches are built in the training process. workers == W > 0: W background
    processes per rank, each a disjoint part of the rank's documents (rank*W + w of world*W),
    consumed round-robin; each batch carries its worker's state, so `state_dict()` is exactly
    the state after the last batch handed out, however far the workers have read ahead.
    The number of workers is part of the data order: a resume with another count is refused.
    A resume on another world size loads states re-split by zerotrain.dataio.pipeline.reshard.
    """

    def __init__(self, data: Data, rank: int, world: int, seed: int, seq_len: int, micro_batch: int,
                 settings: dict | None = None, packing: str = "best-fit"):
        self.settings = {**DATALOADER_DEFAULTS, **(settings or {})}
        self.workers = self.settings["workers"]
        self.args = (data, rank, world, seed, seq_len, micro_batch, packing)
        self.exhausted: str | None = None
        self._states = None
        self._loaded = None  # the parts' states as loaded, pending documents as arrays (_pending_back)
        self._it = None
        if self.workers == 0:
            self.loader = make_loader(*self.args)

    def _start(self):
        ds = _WorkerBatches(*self.args, self.workers, self._states)
        pin = self.settings["pin_memory"] and torch.cuda.is_available()
        dl = torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=_as_is, num_workers=self.workers,
                                         prefetch_factor=self.settings["prefetch_factor"], pin_memory=pin,
                                         persistent_workers=self.settings["persistent_workers"],
                                         worker_init_fn=_leave_signals_to_the_rank)
        self._it = iter(dl)
        if self._states is None:
            self._states = [None] * self.workers

    def next(self):
        if self.workers == 0:
            batch = self.loader.next_batch()
            self.exhausted = self.loader.exhausted
            return batch
        if self.exhausted:
            return None
        if self._it is None:
            self._start()
        batch, w, state, exhausted = next(self._it)
        if exhausted:
            self.exhausted = exhausted
            return None
        self._states[w] = _pending_back(state, self._loaded[w]) if self._loaded else state
        return batch

    def state_dict(self) -> dict:
        """Plain lists and numbers: what goes into the checkpoint."""
        if self.workers == 0:
            return plain({"workers": 0, "parts": [self.loader.state_dict()]})
        if self._states is None or any(s is None for s in self._states):
            # Not every worker has produced a batch yet: build the missing states from scratch.
            data, rank, world, seed, seq_len, micro_batch, packing = self.args
            fresh = [make_loader(data, rank * self.workers + w, world * self.workers, seed, seq_len, micro_batch,
                                 packing).state_dict() for w in range(self.workers)]
            states = self._states or [None] * self.workers
            return plain({"workers": self.workers, "parts": [s if s is not None else f for s, f in zip(states, fresh)]})
        return plain({"workers": self.workers, "parts": list(self._states)})

    def load_state_dict(self, state: dict) -> None:
        if state["workers"] != self.workers:
            raise DataError(f"checkpoint: its loader used {state['workers']} worker(s) per rank, this run has"
                            f" {self.workers}; the document order depends on it (set zerotrain.dataloader.workers"
                            f" back to {state['workers']})")
        if len(state["parts"]) != max(1, self.workers):
            raise DataError(f"checkpoint: its loader state has {len(state['parts'])} part(s) for"
                            f" {self.workers} worker(s); the checkpoint is damaged")
        if self.workers == 0:
            self.loader.load_state_dict(state["parts"][0])
        else:
            self._states = [_pending_arrays(p) for p in state["parts"]]
            self._loaded = list(self._states)
            self._it = None

    def tokens_per_source(self) -> list[int]:
        if self.workers == 0:
            return list(self.loader.stream.tokens)
        parts = self.state_dict()["parts"]
        return [sum(p["stream"]["tokens"][i] for p in parts) for i in range(len(parts[0]["stream"]["tokens"]))]

    def close(self) -> None:
        self._it = None


def batch_digest(batches: list) -> int:
    """A 63-bit digest of the token ids and positions of one rank's batches for one step."""
    h = hashlib.blake2b(digest_size=8)
    for b in batches:
        h.update(b["input_ids"].numpy().tobytes())
        h.update(b["position_ids"].numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


MODEL_KEYS = ("input_ids", "position_ids", "labels")  # what the model's forward takes from a batch
