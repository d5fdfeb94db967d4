"""Packed-sequence rows: whole documents laid into rows of `seq_len` tokens, with exact state.

Each document is `tokens + [EOS]`. Two packers, chosen with `--packing` (measured in
benchmarks/run.py on the demo mix):

- "best-fit" (the default): a document that fits in a row is never cut. It goes into the open
  row with the least room that still holds it; up to open_rows_for(seq_len) rows are open; when none
  has room, the fullest row is closed and padded. A document longer than `seq_len` fills whole
  rows and its remainder is placed like a document. Padding is EOS with label -100.
  Demo mix: 99.5% of row slots hold real tokens at seq_len 256, 99.8% at 2048.
- "greedy": documents end to end, a document that does not fit in what is left of a row fills
  it and continues in the next row. 100% of slots hold real tokens, but 14% (seq 2048) to 32%
  (seq 256) of the documents that would fit in one row get cut at a row edge.

Best-fit holds back up to ~OPEN_TOKENS tokens per rank in open rows: the token shares of the
emitted rows lag the mix schedule by at most that much, and when a "stop" source runs out the
open rows are not emitted.

Position ids restart at 0 at every document start and at every row start (a document continued
from the previous row starts again at 0), and padding is its own segment; they are the single
source of document boundaries: attention masks and `cu_seqlens` are derived from them. Labels
follow the Hugging Face convention (the model shifts them) and are -100 wherever the position is
0 and on padding, so no document is trained to predict across a boundary.

Supervised fine-tuning documents (dataio/sources/sft.py) arrive as SIGNED token arrays: a token that
takes no loss (a prompt token) is stored as -(id + 1). The packers move tokens without looking
at them, so the mask travels with the tokens through open rows, carry-over and saved states;
`make_batch` decodes it (input_ids: the ids; labels: -100 where the sign was set). Pretraining
tokens are never negative, so their batches are exactly what they were. SFT documents must not be
cut at row edges (a response would lose its prompt): greedy packing is refused for them
(`check_packing`); best-fit never cuts a document that fits a row, and zerotrain.dataio.sources.sft makes every
SFT document fit.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Callable

import numpy as np
import torch

from zerotrain.dataio.format.errors import DataError

def with_bos(docs: list, bos_id: int | None) -> list:
    """Documents (token arrays) with `bos_id` put before each (None: as they are): a source's "bos": true
    (zerotrain.dataio.format.mix). One copy of each document; the packers then treat BOS as a token like any."""
    if bos_id is None:
        return docs
    head = np.array([bos_id], np.int64)
    return [np.concatenate((head, np.asarray(d, np.int64))) for d in docs]


OPEN_TOKENS = 16384  # best-fit: rows open at once = clamp(OPEN_TOKENS // seq_len, 8, 64)
PACKINGS = ("best-fit", "greedy")


class Packer:
    """micro_batch x seq_len tokens at a time from a `next_documents(n_tokens)` callable.

    `next_documents(n)` returns a list of token arrays (documents without EOS) whose lengths plus
    one EOS each add up to at least n.
    """

    def __init__(self, seq_len: int, eos_id: int, micro_batch: int = 1):
        self.seq_len, self.eos_id, self.micro_batch = seq_len, eos_id, micro_batch
        self.carry = np.zeros(0, np.int64)  # the part of a document past the previous batch's end
        self._eos = np.array([eos_id], np.int64)
        n = seq_len * micro_batch
        self._index = np.arange(n, dtype=np.int64)
        self._row_starts = np.zeros(n, bool)
        self._row_starts[::seq_len] = True

    def next_tokens(self, next_documents: Callable[[int], list]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document start offsets) for one batch, flat, length micro_batch * seq_len."""
        n = self.seq_len * self.micro_batch
        pieces, doc_starts, filled = [], [], 0
        if len(self.carry):
            pieces.append(self.carry[:n])
            filled = len(pieces[0])
        rest = self.carry[n:]
        if filled < n:
            docs = next_documents(n - filled)
            lengths = np.fromiter((len(d) + 1 for d in docs), np.int64, len(docs))
            doc_starts = filled + np.cumsum(lengths) - lengths
            for d in docs:
                pieces.append(d)
                pieces.append(self._eos)
        flat = np.concatenate(pieces).astype(np.int64, copy=False) if pieces else np.zeros(0, np.int64)
        self.carry = flat[n:] if len(rest) == 0 else rest
        return flat[:n], np.asarray(doc_starts, np.int64)

    def next_batch(self, next_documents: Callable[[int], list]) -> dict[str, np.ndarray]:
        tokens, doc_starts = self.next_tokens(next_documents)
        return make_batch(tokens, doc_starts, self.seq_len, self._index, self._row_starts)

    def state_dict(self) -> dict:
        return {"packing": "greedy", "carry": self.carry.astype(np.int32)}

    def load_state_dict(self, state: dict) -> None:
        _check_packing(state, "greedy")
        self.carry = np.asarray(state["carry"], np.int64)


def _check_packing(state: dict, kind: str) -> None:
    if state.get("packing", "greedy") != kind:
        raise DataError(f"loader state was saved with {state.get('packing')!r} packing, this run packs {kind!r}")


class BestFitPacker:
    """Best-fit packing (see the module docstring); same interface and batch format as Packer.

    A row is [pieces, piece starts, used]: pieces are views of the documents (and the shared EOS
    array), concatenated once per batch, so placing a document copies nothing.
    """

    def __init__(self, seq_len: int, eos_id: int, micro_batch: int = 1, open_rows: int | None = None,
                 pull_tokens: int | None = None):
        self.seq_len, self.eos_id, self.micro_batch = seq_len, eos_id, micro_batch
        self.max_open = open_rows or open_rows_for(seq_len)
        # Documents are pulled OPEN_TOKENS at a time (fewer, cheaper scheduling calls); a caller
        # whose stream may end ("stop" sources) pulls one batch at a time so the end is not early.
        self.pull_tokens = max(seq_len * micro_batch, pull_tokens or OPEN_TOKENS)
        self.open: dict[int, list] = {}  # row id -> [pieces, piece starts, used]
        self.rooms: list[tuple[int, int]] = []  # (room left, row id) of the open rows, sorted
        self.ready: deque = deque()  # finished rows, [pieces, piece starts, used]
        self.next_id = 0
        self._eos = np.array([eos_id], np.int64)
        n = seq_len * micro_batch
        self._index = np.arange(n, dtype=np.int64)
        self._row_starts = np.zeros(n, bool)
        self._row_starts[::seq_len] = True

    def _place(self, pieces: list, size: int) -> None:
        i = bisect.bisect_left(self.rooms, (size, -1))  # the least room that still fits, oldest first
        if i < len(self.rooms):
            room, rid = self.rooms.pop(i)
            row = self.open[rid]
            row[0].extend(pieces)
            row[1].append(row[2])
            row[2] += size
        else:
            if len(self.open) >= self.max_open:
                self.ready.append(self.open.pop(self.rooms.pop(0)[1]))  # close the fullest row
            rid, room = self.next_id, self.seq_len
            self.next_id += 1
            self.open[rid] = [list(pieces), [0], size]
        if room - size:
            bisect.insort(self.rooms, (room - size, rid))
        else:
            self.ready.append(self.open.pop(rid))

    def add_document(self, doc) -> None:
        T, n = self.seq_len, len(doc)
        total = n + 1  # with its EOS
        n_full = total // T
        for k in range(n_full):  # a document longer than a row: whole rows first
            a, b = k * T, (k + 1) * T
            self.ready.append([[doc[a:b]] if b <= n else [doc[a:n], self._eos], [0], T])
        rest = total - n_full * T
        if rest:
            self._place([doc[n_full * T:], self._eos] if rest > 1 else [self._eos], rest)

    def next_batch(self, next_documents: Callable[[int], list]) -> dict[str, np.ndarray]:
        B, T = self.micro_batch, self.seq_len
        while len(self.ready) < B:
            for d in next_documents(self.pull_tokens):
                self.add_document(d)
        pieces, starts, pad = [], [], None
        for b in range(B):
            row_pieces, row_starts, used = self.ready.popleft()
            pieces.extend(row_pieces)
            starts.extend(b * T + st for st in row_starts)
            if used < T:
                pieces.append(np.full(T - used, self.eos_id, np.int64))
                starts.append(b * T + used)  # padding is a segment of its own
                if pad is None:
                    pad = np.zeros(B * T, bool)
                pad[b * T + used:(b + 1) * T] = True
        tokens = np.concatenate(pieces).astype(np.int64, copy=False)
        return make_batch(tokens, np.asarray(starts, np.int64), T, self._index, self._row_starts, pad)

    @staticmethod
    def _row_state(row) -> list:
        pieces, starts, used = row
        return [np.concatenate(pieces).astype(np.int32), list(starts), used]

    def state_dict(self) -> dict:
        return {"packing": "best-fit", "next_id": self.next_id,
                "open": [[rid, *self._row_state(row)] for rid, row in self.open.items()],
                "ready": [self._row_state(row) for row in self.ready]}

    def load_state_dict(self, state: dict) -> None:
        _check_packing(state, "best-fit")
        self.next_id = int(state["next_id"])
        self.open, self.rooms = {}, []
        for rid, tokens, starts, used in state["open"]:
            self.open[int(rid)] = [[np.asarray(tokens, np.int64)], list(starts), int(used)]
            self.rooms.append((self.seq_len - int(used), int(rid)))
        self.rooms.sort()
        self.ready = deque([[np.asarray(t, np.int64)], list(st), int(used)] for t, st, used in state["ready"])


def check_packing(packing: str, specs=()) -> str:
    """`packing` if known and right for the mix's sources (`specs`: SFT sources need best-fit)."""
    if packing not in PACKINGS:
        raise DataError(f"--packing {packing!r}: must be {' or '.join(PACKINGS)}")
    sft = [s.name for s in specs if getattr(s, "format", "text") != "text"]
    if packing == "greedy" and sft:
        raise DataError(f"--packing greedy: source {sft[0]!r} holds SFT records, which greedy packing would cut at row"
                        " edges (a response without its prompt); use --packing best-fit")
    return packing


def open_rows_for(seq_len: int) -> int:
    """Rows best-fit keeps open: about OPEN_TOKENS tokens, so >= 99% efficiency on the demo mix
    at every seq_len while the tokens held back (and the lag of emitted shares) stay bounded."""
    return max(8, min(64, OPEN_TOKENS // seq_len))


def make_packer(packing: str, seq_len: int, eos_id: int, micro_batch: int, stream_may_end: bool = False):
    if check_packing(packing) == "greedy":
        return Packer(seq_len, eos_id, micro_batch)
    return BestFitPacker(seq_len, eos_id, micro_batch, pull_tokens=1 if stream_may_end else None)


def make_batch(tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, index=None, row_starts=None,
               pad: np.ndarray | None = None) -> dict:
    """input_ids, labels, position_ids (B, T) and cu_seqlens / max_seqlen, all numpy.

    `doc_starts`: flat offsets where a document (or a padding run) starts; `pad`: padding mask.
    """
    n = len(tokens)
    if index is None:
        index = np.arange(n, dtype=np.int64)
        row_starts = np.zeros(n, bool)
        row_starts[::seq_len] = True
    starts = row_starts.copy()
    starts[doc_starts[doc_starts < n]] = True
    segment_start = np.maximum.accumulate(np.where(starts, index, 0))
    position_ids = index - segment_start
    no_label = starts if pad is None else starts | pad
    if n and tokens.min() < 0:  # SFT documents: the sign marks tokens without a label (zerotrain.dataio.sources.sft)
        untrained = tokens < 0
        tokens = np.where(untrained, -tokens - 1, tokens)
        no_label = no_label | untrained
    labels = np.where(no_label, -100, tokens)
    bounds = np.append(np.flatnonzero(starts), n).astype(np.int32)
    return {"input_ids": tokens.reshape(-1, seq_len), "labels": labels.reshape(-1, seq_len),
            "position_ids": position_ids.reshape(-1, seq_len), "cu_seqlens": bounds,
            "max_seqlen": int(np.diff(bounds).max()), "real_tokens": n - (0 if pad is None else int(pad.sum()))}


def to_torch(batch: dict) -> dict:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def best_fit_efficiency(lengths, seq_len: int, open_rows: int = 64) -> tuple[float, int]:
    """(efficiency, rows) of best-fit packing without splitting documents that fit in a row.

    Documents (lengths incl. EOS) arrive in order; one longer than seq_len is cut into full
    rows plus a remainder; each piece goes into the open row with the least room that still
    fits it; when none fits and `open_rows` are open, the fullest row is closed (padded).
    Used by the benchmark to justify greedy packing; not used for training.
    """
    rooms: list[int] = []  # remaining room of the open rows, sorted
    rows = tokens = 0
    for length in lengths:
        length = int(length)
        tokens += length
        rows += length // seq_len
        piece = length % seq_len
        if piece == 0:
            continue
        i = bisect.bisect_left(rooms, piece)
        if i < len(rooms):
            room = rooms.pop(i) - piece
        else:
            if len(rooms) >= open_rows:
                rooms.pop(0)  # the fullest row: close it
                rows += 1
            room = seq_len - piece
        if room:
            bisect.insort(rooms, room)
        else:
            rows += 1
    rows += len(rooms)
    return tokens / max(1, rows * seq_len), rows
