"""Tokenizers: the offline byte-level one, and Hugging Face `tokenizer.json` files on disk.

Both expose `encode(text) -> list[int]`, `decode(ids)`, `vocab_size`, `bos_id`, `eos_id`, `name`.
EOS separates documents in a packed row (see dataio.packing).
"""
from __future__ import annotations

import json
from pathlib import Path

from dataio.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256 and EOS=257. Needs nothing on disk."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`), loaded with the `tokenizers` library."""

    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer {path}: no tokenizer.json found")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"tokenizer {file}: cannot be loaded ({str(e).splitlines()[0]})") from None
        self.name = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {}
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            special = json.loads(cfg.read_text())
        self.eos_id = self._token_id(special.get("eos_token"), self.EOS_CANDIDATES)
        self.bos_id = self._token_id(special.get("bos_token"), ("<|begin_of_text|>", "<s>", "<bos>"))
        if self.eos_id is None:
            raise DataError(f"tokenizer {file}: has no end-of-text token (tried {', '.join(self.EOS_CANDIDATES)})")

    def _token_id(self, configured, candidates):
        if isinstance(configured, dict):
            configured = configured.get("content")
        for tok in ([configured] if configured else []) + list(candidates):
            tid = self._tok.token_to_id(tok)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str):
    if spec == "bytes":
        return ByteTokenizer()
    if not Path(spec).exists():
        raise DataError(f"tokenizer {spec}: no such file or directory (use 'bytes' or a tokenizer.json / directory)")
    return HFTokenizer(spec)
