"""What cuts long documents into pieces (`make_pieces`, `cut_pieces`), and the default bound
(`default_piece_len`).

Long documents are cut into pieces before the documents are split across ranks (`make_pieces`,
`cut_pieces`; pure index arithmetic on a DocStore, no text is copied). A document longer than
the piece bound `piece_len` is cut every `piece_len` units from its start (the last piece is
shorter), and each piece is a document of its own: its own EOS, positions restarting at 0,
attention never crossing into the next piece. Units are what the loader counts: tokens for
prepared shards, bytes for text. With a Hugging Face tokenizer a text source is still cut in
bytes of its UTF-8 text, before tokenizing (a piece of N bytes is roughly N/4 tokens), so a mix
and its prepared shards give the same stream under such a tokenizer only where nothing was cut.
Text (and byte-tokenizer shards) is cut only at UTF-8 character starts: a cut that falls inside
a character moves back to its first byte, so a text piece may be up to 3 bytes longer or shorter
than the bound. The default bound, `default_piece_len(seq_len)`, is 8 x seq_len: the packer
already restarts positions at every row, so a cut at a multiple of seq_len costs one EOS per
piece, while a long document no longer comes as one block of thousands of consecutive rows and
every rank gets a share of it. When a source would still have fewer pieces than the stream has
parts (ranks x data workers per rank), it is cut finer, deterministically (bound ceil(total /
parts), else total // parts), so that every part gets at least one piece; the summary says so.
Only a source with fewer units (characters) than parts is refused. The bound is part of the
data's identity: another bound gives other documents.

Not here: reading documents (zerotrain.dataio.sources.readers, zerotrain.dataio.format.shards), the split across ranks
and the mixing (zerotrain.dataio.pipeline.loader). SFT records are never cut (the loader keeps them whole).
"""
from __future__ import annotations

import numpy as np

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError

PIECE_ROWS = 8  # the default piece bound, in rows of seq_len


def default_piece_len(seq_len: int) -> int:
    """The piece bound used when none is given: 8 rows of seq_len (in the loader's units)."""
    return PIECE_ROWS * seq_len


def cut_pieces(store: DocStore, piece_len: int, utf8: bool) -> DocStore:
    """A new DocStore over the same chunks in which every document of `store` (an uncut store)
    longer than piece_len is cut at start + k * piece_len. Nothing is copied: only the
    chunk/start/end arrays change. With utf8 (text, or byte-tokenizer shards) a cut that falls
    inside a character moves back to the character's first byte, so every piece is valid UTF-8;
    cuts that then coincide (bounds under 4 bytes) make one piece, not an empty one."""
    if piece_len < 1:
        raise DataError(f"source {store.name!r}: piece length must be a positive integer, got {piece_len!r}")
    lengths = store.lengths
    counts = np.maximum(1, -(-lengths // piece_len))  # pieces per document
    n = int(counts.sum())
    first = np.cumsum(counts) - counts  # index of each document's first piece
    doc = np.repeat(np.arange(len(store)), counts)
    offset = (np.arange(n) - np.repeat(first, counts)) * piece_len  # of each piece from its document's start
    if utf8 and n > len(store):
        inner = np.flatnonzero(offset > 0)
        chunk_of = store.chunk[doc[inner]]
        for c in np.unique(chunk_of):
            idx, data = inner[chunk_of == c], store.chunks[c]
            for _ in range(3):  # a UTF-8 character is at most 4 bytes: at most 3 steps back
                at = store.start[doc[idx]] + offset[idx]
                idx = idx[(np.asarray(data[at]) & 0xC0) == 0x80]  # continuation bytes are 0b10xxxxxx
                if not len(idx):
                    break
                offset[idx] -= 1
        # Never behind the previous cut of the same document (only invalid UTF-8 could ask for it):
        # a running maximum within each cut document (documents renumbered so doc * span fits).
        cut = np.flatnonzero(counts[doc] > 1)
        nth = np.cumsum(counts > 1)[doc[cut]]
        span = int(lengths.max()) + 1
        offset[cut] = np.maximum.accumulate(offset[cut] + nth * span) - nth * span
    start = store.start[doc] + offset
    end = np.empty(n, np.int64)
    end[:-1] = start[1:]
    end[first + counts - 1] = store.end
    keep = end > start
    return DocStore(name=store.name, kind=store.kind, chunks=store.chunks, chunk=store.chunk[doc][keep],
                    start=start[keep], end=end[keep], bad_records=store.bad_records, first_bad=store.first_bad,
                    empty_records=store.empty_records, note=store.note, whole_documents=len(store),
                    whole_max=store.longest, cut_documents=int((counts > 1).sum()), piece_len=piece_len,
                    files=store.files)


def make_pieces(store: DocStore, piece_len: int | None, parts: int, utf8: bool, across: str) -> DocStore:
    """`store` cut at piece_len (None: no bound) and, when that leaves fewer pieces than `parts`
    (the ranks x data workers its documents are split across), cut finer (below) so that every
    part gets at least one piece. Deterministic in (store, piece_len, parts). Only a source with
    fewer than `parts` units (characters, for text) is refused: "cannot be split across {across}"."""
    out = store if piece_len is None else cut_pieces(store, piece_len, utf8)
    total = int(store.lengths.sum())
    # Finer bounds, tried in order: ceil(total / parts) (no sliver of a last piece when one
    # document is cut), total // parts (always enough pieces: sum(ceil(len / b)) >= total / b),
    # 1 (when multi-byte characters merged cuts: one piece per character).
    for finer in (-(-total // parts), total // parts, 1):
        if len(out) >= parts or finer < 1:
            break
        out = cut_pieces(store, finer, utf8)
    if len(out) < parts:
        unit = "bytes" if store.kind == "text" else "tokens"
        raise DataError(f"source {store.name!r}: {store.documents} document(s) of {total:,} {unit} in all"
                        f" cannot be split across {across}; add data or use fewer ranks")
    return out
