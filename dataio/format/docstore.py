"""DocStore: a source's documents as index arrays over byte or token buffers, the one shape every
reader hands on (zerotrain.dataio.sources.readers: local mix sources; zerotrain.dataio.format.shards: prepared
shards) and every later stage takes (zerotrain.dataio.format.pieces, zerotrain.dataio.sources.holdout,
zerotrain.dataio.sources.sft, zerotrain.dataio.pipeline.loader).

Not here: reading files into a DocStore (the readers), cutting its documents into pieces (pieces).
It imports nothing of the project, so any stage can name it without pulling in a reader.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DocStore:
    """A source's documents, in their natural order: document d is `chunks[chunk[d]][start[d]:end[d]]`.

    `kind` is "text" (UTF-8 bytes) or "tokens" (token ids, from prepared shards). Chunks are
    numpy views of Arrow buffers, of the memory-mapped text file, or of memory-mapped shards:
    nothing is copied per document. A source of several files holds their documents in file
    order (`files`, sorted). After `make_pieces` the entries are pieces (each a document for the
    loader) and `whole_documents` / `whole_max` describe the documents they came from.
    """
    name: str
    kind: str
    chunks: list
    chunk: np.ndarray  # (n_docs,) int32
    start: np.ndarray  # (n_docs,) int64
    end: np.ndarray  # (n_docs,) int64
    bad_records: int = 0
    first_bad: str = ""
    empty_records: int = 0
    note: str = ""  # the reader's warning for the summary (a .txt file that gave few documents)
    whole_documents: int | None = None  # documents before cutting into pieces (None: never cut)
    whole_max: int = 0  # the longest document before cutting
    cut_documents: int = 0  # documents that were cut into pieces
    piece_len: int | None = None  # the bound the pieces were cut at (None: not cut)
    files: tuple = ()  # the files the documents were read from, in order (shards: the shard files)
    # SFT sources (dataio/sources/sft.py). Rendered records: their response spans, (ptr (n + 1,), bounds (m, 2))
    # in bytes from each document's start, and where each record came from (file index, record number).
    spans: tuple | None = None
    records: np.ndarray | None = None  # (n,) record number within its file, from 1
    record_file: np.ndarray | None = None  # (n,) index into `files`
    # Tokenized (signed tokens, zerotrain.dataio.sources.sft): records truncated / dropped for overflow
    # (zerotrain.dataio.sources.sft.fit).
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.start)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start

    @property
    def documents(self) -> int:
        """Documents of the source, counted before any cutting into pieces."""
        return len(self) if self.whole_documents is None else self.whole_documents

    @property
    def longest(self) -> int:
        """The longest document's length (before cutting), in the store's units."""
        if self.whole_documents is not None:
            return self.whole_max
        return int(self.lengths.max()) if len(self) else 0

    def doc(self, d: int) -> np.ndarray:
        return self.chunks[self.chunk[d]][self.start[d]:self.end[d]]

    def text(self, d: int) -> str:
        return self.doc(d).tobytes().decode("utf-8")

    def spans_of(self, d: int) -> np.ndarray:
        """(k, 2) byte offsets of document d's responses (an SFT store of rendered records)."""
        ptr, bounds = self.spans
        return bounds[ptr[d]:ptr[d + 1]]
