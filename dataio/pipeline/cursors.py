"""One source on one rank: the cursor the mix (zerotrain.dataio.pipeline.loader's MixedStream) takes documents
from, and its exact state.

`IndexedSource`: a local source's documents split across ranks (document i to rank i % world), visited in a fresh
seeded permutation every epoch and tokenized in blocks of TOKEN_BLOCK; its state is the epoch and the position (the
permutation is recomputed from the seed), plus the documents still pending from a world-size change
(zerotrain.dataio.pipeline.reshard). `StreamedSource`: a hub dataset read in order through `datasets` (this rank's
share by `split_dataset_by_node`), in blocks of TOKEN_BLOCK records; its state is the IterableDataset's own
`state_dict()` before the current block and a count of documents taken from it.
"""
from __future__ import annotations

import copy
from collections import deque

import numpy as np

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError, first_line
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.sources.sft import ChatRenderer, is_sft, stream_block
from zerotrain.dataio.sources.streamed import bad_record, no_text, open_streamed, record_text, records

TOKEN_BLOCK = 256  # documents tokenized together (HF tokenizers) / records pulled per streamed block

PENDING = -1  # the "epoch" of a span of pending documents (IndexedSource: left over from a world-size change)


class IndexedSource:
    """A local source's documents on this rank, visited in a seeded permutation per epoch.

    After a resume on another world size (zerotrain.dataio.pipeline.reshard) it first visits `pending`: documents
    (global ids) of the old ranks' unfinished epochs dealt to this part; its own schedule then
    continues from (epoch, pos), which the re-split sets to the end of an epoch.
    """

    def __init__(self, store: DocStore, spec: SourceSpec, tokenizer, index: int, rank: int, world: int, seed: int):
        self.store, self.spec, self.tokenizer = store, spec, tokenizer
        self.ids = np.arange(rank, len(store), world, dtype=np.int64)
        if len(self.ids) == 0:
            raise DataError(f"{spec.where()}: {len(store)} documents cannot be split across {world} ranks")
        self.key = (seed, index, rank, world)
        self.direct = store.kind == "tokens" or tokenizer.name == "bytes"  # bytes are the tokens
        self.lengths = store.lengths[self.ids] if self.direct else None
        self.epoch, self.pos = 0, 0
        self.pending, self.pending_pos = np.zeros(0, np.int64), 0
        self._orders: dict[int, np.ndarray] = {}
        self._blocks: dict[tuple[int, int], list] = {}  # (epoch, block) -> token arrays (HF tokenizers)

    @property
    def n(self) -> int:
        return len(self.ids)

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            seed, index, rank, world = self.key
            rng = np.random.default_rng([seed, index, epoch, rank, world])
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = rng.permutation(self.n)
        return self._orders[epoch]

    def _spans(self, k: int):
        """(epoch, start, stop) runs covering the next k documents (fewer if "stop" runs out);
        epoch PENDING: positions in `pending`, which comes first."""
        epoch, pos, spans = self.epoch, self.pos, []
        if k > 0 and self.pending_pos < len(self.pending):
            take = min(k, len(self.pending) - self.pending_pos)
            spans.append((PENDING, self.pending_pos, self.pending_pos + take))
            k -= take
        while k > 0:
            if pos >= self.n:
                if self.spec.on_exhausted == "stop":
                    break
                epoch, pos = epoch + 1, 0
            take = min(k, self.n - pos)
            spans.append((epoch, pos, pos + take))
            pos, k = pos + take, k - take
        return spans

    def _tokenized(self, epoch: int, start: int, stop: int) -> list:
        out = []
        for b in range(start // TOKEN_BLOCK, (stop - 1) // TOKEN_BLOCK + 1):
            if (epoch, b) not in self._blocks:
                if len(self._blocks) > 8:
                    self._blocks.pop(next(iter(self._blocks)))
                docs = self._doc_ids(epoch, b * TOKEN_BLOCK, (b + 1) * TOKEN_BLOCK)
                self._blocks[(epoch, b)] = self.tokenizer.encode_batch([self.store.text(int(d)) for d in docs])
            block = self._blocks[(epoch, b)]
            lo, hi = max(start, b * TOKEN_BLOCK) - b * TOKEN_BLOCK, min(stop, (b + 1) * TOKEN_BLOCK) - b * TOKEN_BLOCK
            out.extend(block[lo:hi])
        return out

    def _doc_ids(self, epoch: int, a: int, b: int) -> np.ndarray:
        return self.pending[a:b] if epoch == PENDING else self.ids[self.order(epoch)[a:b]]

    def peek_lengths(self, k: int) -> np.ndarray:
        parts = []
        for epoch, a, b in self._spans(k):
            if self.direct and epoch == PENDING:
                parts.append(self.store.lengths[self.pending[a:b]])
            elif self.direct:
                parts.append(self.lengths[self.order(epoch)[a:b]])
            else:
                parts.append(np.fromiter((len(t) for t in self._tokenized(epoch, a, b)), np.int64, b - a))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def take(self, k: int) -> list:
        out = []
        for epoch, a, b in self._spans(k):
            if self.direct:
                d = self._doc_ids(epoch, a, b)
                chunks, store = self.store.chunks, self.store
                out.extend(chunks[c][s:e] for c, s, e in zip(store.chunk[d].tolist(), store.start[d].tolist(),
                                                              store.end[d].tolist()))
            else:
                out.extend(self._tokenized(epoch, a, b))
            if epoch == PENDING:
                self.pending_pos = b
            else:
                self.epoch, self.pos = epoch, b
        return out

    def remaining(self) -> np.ndarray:
        """Global ids of the documents this part has still to visit before its next epoch starts:
        what is left of `pending`, then of the current epoch. What a world-size change re-splits."""
        rest = self.ids[self.order(self.epoch)[self.pos:]] if self.pos < self.n else np.zeros(0, np.int64)
        return np.concatenate([self.pending[self.pending_pos:], rest])

    def state_dict(self) -> dict:
        if self.pending_pos < len(self.pending):  # only after a world-size change: older states stay as they were
            return {"epoch": self.epoch, "pos": self.pos, "pending": self.pending[self.pending_pos:]}
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n") not in (None, self.n):
            raise DataError(f"{self.spec.where()}: the checkpoint's loader saw {state['n']} documents on this rank,"
                            f" the data now has {self.n}; the source changed since the checkpoint")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        pending = np.asarray(state.get("pending", ()), np.int64)
        if len(pending) and (pending.min() < 0 or pending.max() >= len(self.store)):
            raise DataError(f"{self.spec.where()}: the checkpoint's loader state names documents beyond the"
                            f" {len(self.store)} the source has; the source changed since the checkpoint")
        self.pending, self.pending_pos = pending, 0
        # Cached tokenized blocks of the old pending list are keyed by its positions: drop them.
        self._blocks = {key: v for key, v in self._blocks.items() if key[0] != PENDING}


class StreamedSource:
    """A streamed source on this rank: records in order, tokenized in blocks; exact state."""

    def __init__(self, spec: SourceSpec, tokenizer, rank: int, world: int, seq_len: int | None = None):
        self.spec, self.tokenizer = spec, tokenizer
        self.seq_len = seq_len  # SFT records: the overflow bound
        self.renderer = ChatRenderer(tokenizer) if is_sft(spec) else None
        self.ds = open_streamed(spec, rank, world)
        self.world = world
        self._fresh_epoch = False  # set when an epoch restarts; cleared by its first document
        self._initial = copy.deepcopy(self.ds.state_dict())
        self.epoch, self.bad_records = 0, 0
        self._it = None
        self._blocks: deque = deque()  # [dataset state before the block, token arrays, taken]
        self._resume: tuple | None = None  # (dataset state, docs to skip) to apply on the next read

    def _bad(self, why: str, record=None) -> None:
        if self.spec.bad_records == "stop":
            raise DataError(bad_record(self.spec, why, record))
        self.bad_records += 1

    def _pull_block(self) -> bool:
        if self._it is None:
            state, skip = self._resume or (self._initial, 0)
            self.ds.set_epoch(self.epoch)
            self.ds.load_state_dict(copy.deepcopy(state))
            self._it = records(self.ds)
        before = copy.deepcopy(self.ds.state_dict())
        texts = []  # SFT sources: the records themselves (rendered below)
        try:
            for record in self._it:
                text = record if self.renderer is not None else record_text(
                    self.spec, record, lambda why, record=record: self._bad(why, record))
                # an SFT record is judged when rendered, {} included; whitespace alone is no document (as read)
                if self.renderer is not None or not no_text(text):
                    texts.append(text)
                if len(texts) >= TOKEN_BLOCK:
                    break
        except DataError:
            raise
        except Exception as e:  # a corrupt shard met mid-stream: `datasets`/pyarrow raise many types
            raise DataError(f"{self.spec.where()}: reading the stream: {first_line(e)}") from None
        if not texts:  # the stream ended
            if self.spec.on_exhausted == "stop":
                return False
            if self._fresh_epoch:  # a whole epoch without one document: restarting would loop forever
                raise DataError(f"{self.spec.where()}: this rank's share of the stream holds no documents"
                                f" ({self.world} ranks); use fewer ranks or `zerotrain prepare` the source")
            self.epoch += 1
            self._it, self._resume = None, None
            self._fresh_epoch = True
            return self._pull_block()
        self._fresh_epoch = False
        if self.renderer is not None:  # SFT records: rendered, tokenized with their mask; overflow may drop some
            docs = stream_block(self.spec, texts, self.tokenizer, self.renderer, self.seq_len, self._bad)
        else:
            docs = self.tokenizer.encode_batch(texts)
        block = [before, docs, 0]
        if self._resume is not None:
            block[2] = self._resume[1]
            self._resume = None
        self._blocks.append(block)
        return True

    def _available(self, k: int) -> bool:
        while sum(len(b[1]) - b[2] for b in self._blocks) < k:
            if not self._pull_block():
                return False
        return True

    def peek_lengths(self, k: int) -> np.ndarray:
        self._available(k)
        lengths = [len(t) for b in self._blocks for t in b[1][b[2]:]][:k]
        return np.asarray(lengths, np.int64)

    def take(self, k: int) -> list:
        self._available(k)
        out = []
        while k > 0 and self._blocks:
            block = self._blocks[0]
            got = block[1][block[2]:block[2] + k]
            out.extend(got)
            block[2] += len(got)
            k -= len(got)
            if block[2] >= len(block[1]):
                self._blocks.popleft()
        return out

    def state_dict(self) -> dict:
        if self._blocks:
            return {"epoch": self.epoch, "dataset": copy.deepcopy(self._blocks[0][0]), "skip": self._blocks[0][2]}
        if self._resume is not None:
            return {"epoch": self.epoch, "dataset": copy.deepcopy(self._resume[0]), "skip": self._resume[1]}
        state = self.ds.state_dict() if self._it is not None else self._initial
        return {"epoch": self.epoch, "dataset": copy.deepcopy(state), "skip": 0}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self._blocks.clear()
        self._it, self._resume = None, (state["dataset"], int(state["skip"]))
