"""Checks on the bytes of text, without decoding it whole: which byte ranges hold ASCII whitespace only (no
document: the .txt reader's and a table's records, `blank`), and where the first invalid UTF-8 byte is
(`first_invalid_utf8`). Streamed records are judged on the same characters (`WHITESPACE_CHARS`)."""
from __future__ import annotations

import codecs

import numpy as np

WHITESPACE_CHARS = " \t\n\r\x0b\x0c"  # what bytes.strip() removes (str.strip() removes more: Unicode spaces)
WHITESPACE = np.zeros(256, bool)
WHITESPACE[list(WHITESPACE_CHARS.encode())] = True


def blank(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which of the non-empty byte ranges [starts, ends) of `data` hold ASCII whitespace only. Only a range that
    begins and ends with whitespace can be (few do), so only those are read whole."""
    out = np.zeros(len(starts), bool)
    if len(starts):
        for j in np.flatnonzero(WHITESPACE[data[starts]] & WHITESPACE[data[ends - 1]]).tolist():
            out[j] = not bytes(data[starts[j]:ends[j]]).strip()
    return out


UTF8_BLOCK = 1 << 24  # bytes decoded at a time when checking a .txt file


def first_invalid_utf8(raw, pos: int) -> int | None:
    """The offset of the first byte at or after `pos` that is not valid UTF-8, or None; decoded a
    block at a time (a whole-file decode would hold the file twice more in memory)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    while pos < len(raw):
        block = raw[pos:pos + UTF8_BLOCK]
        held = len(decoder.getstate()[0])  # bytes of a character begun in the previous block
        try:
            decoder.decode(block, final=pos + len(block) >= len(raw))
        except UnicodeDecodeError as e:  # e.start counts from the held bytes
            return pos - held + e.start
        pos += len(block)
    return None
