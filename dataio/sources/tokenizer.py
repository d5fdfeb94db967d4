"""Tokenizers: the offline byte-level one, Hugging Face tokenizers on disk or named on the hub
(`org/name[@revision]`, found as transformers finds it: zerotrain.dataio.sources.hub), and BPE training.

Both kinds expose `encode(text) -> list[int]`, `encode_batch(texts) -> list[np.ndarray]`,
`decode(ids)`, `special_text(id)`, `vocab_size`, `bos_id`, `eos_id`, `pad_id` (None when none), `name` and `sha256`
(identifies the exact vocabulary; prepared shards record it and training refuses shards made with
another one), and
`chat_template` (None for the byte tokenizer; a Hugging Face directory's template, from
tokenizer_config.json `chat_template` or chat_template.jinja) for SFT chats (dataio/sources/sft.py).

BOS/EOS: documents are encoded WITHOUT special tokens; the packer appends EOS after every
document (EOS separates documents in a packed row). A document start is marked by its position id 0,
and attention never crosses a document boundary; a BOS goes before each document only where the mix
asks for it (`"bos": true`, added by the loader; `adds_bos` says whether transformers would put one).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from zerotrain.dataio.format.errors import DataError, first_line
from zerotrain.dataio.sources.hub import split_name, tokenizer_snapshot

SPECIAL_TOKENS = ("<|endoftext|>", "<|begin_of_text|>")  # what `zerotrain tokenizer train` adds


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS=256 and EOS=257. Needs nothing on disk."""

    name = "bytes"
    chat_template = None  # SFT chats use the plain template (zerotrain.dataio.sources.sft.plain_chat)
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    pad_id = None
    origin = None
    sha256 = hashlib.sha256(b"zerotrain bytes tokenizer v1: ids 0-255 = UTF-8 bytes, 256 BOS, 257 EOS").hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def encode_as_transformers(self, text: str) -> list[int]:
        """What transformers' tokenizer.encode(text) gives (lm-eval's HF model): the bytes, nothing added."""
        return self.encode(text)

    adds_bos = False  # transformers puts nothing before a text

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def special_text(self, token_id: int) -> str | None:
        """A special token's text as transformers decodes it; None: BOS and EOS have no text here."""
        return None


class HFTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`), loaded with the `tokenizers` library.

    `name`: what the run records and `zerotrain export` resolves again: the tokenizer.json path, or for
    a hub tokenizer "org/name@<commit>" (`origin` then says where it was found); `directory`: where its
    files are (export copies them)."""

    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: str | Path, name: str | None = None, origin: str | None = None):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer {path}: no tokenizer.json found")
        raw = file.read_bytes()
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(f"tokenizer {file}: cannot be loaded ({first_line(e)})") from None
        # the absolute path (the run records it, export reads it again from another directory)
        self.name, self.origin, self.directory = name or str(file.resolve()), origin, file.parent
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {}
        cfg = file.parent / "tokenizer_config.json"
        if cfg.is_file():
            try:
                special = json.loads(cfg.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DataError(f"tokenizer {cfg}: invalid JSON") from None
        self.chat_template = _chat_template(special, file.parent, cfg)
        self._transformers = None  # the transformers tokenizer, loaded on the first chat rendered
        self.eos_id = self._token_id(special.get("eos_token"), self.EOS_CANDIDATES)
        self.bos_id = self._token_id(special.get("bos_token"), ("<|begin_of_text|>", "<s>", "<bos>"))
        self.pad_id = self._token_id(special.get("pad_token"), ())  # None: the tokenizer names no pad token
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

    def encode_as_transformers(self, text: str) -> list[int]:
        """What transformers' tokenizer.encode(text) gives (lm-eval's HF model tokenizes so): the tokenizer's own
        post-processor's special tokens added (a BOS where it adds one)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    @property
    def adds_bos(self) -> bool:
        """Whether transformers' encode(text) puts this tokenizer's BOS before a text (its post-processor does,
        for a Llama): the model it came with was trained with one at each document's start."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return self.bos_id is not None and ids[:1] == [self.bos_id] and ids[1:1 + len(plain)] == plain

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False) \
            if hasattr(self._tok, "encode_batch_fast") else self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def special_text(self, token_id: int) -> str | None:
        """A special token's text, as transformers' tokenizer.decode(token_id) gives it (specials not skipped)."""
        return self._tok.id_to_token(int(token_id))

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32, (n, 2) character offsets) per text, without special tokens added (SFT masks).
        encode_batch_fast computes no offsets, so this is the slower call."""
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2)) for e in encs]

    def apply_chat_template(self, conversations: list[list[dict]], add_generation_prompt: list[bool]) -> list[str]:
        """Each conversation rendered as text by transformers' `apply_chat_template` with this
        directory's template and special tokens (loaded once, on first use; nothing downloaded)."""
        if self._transformers is None:
            try:
                from transformers import AutoTokenizer

                self._transformers = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
            except Exception as e:
                raise DataError(f"tokenizer {self.name}: transformers cannot load it to apply its chat template"
                                f" ({first_line(e)})") from None
        out = []
        for gen in (False, True):  # apply_chat_template takes one add_generation_prompt per call
            batch = [c for c, g in zip(conversations, add_generation_prompt) if g == gen]
            if batch:
                texts = self._transformers.apply_chat_template(batch, chat_template=self.chat_template, tokenize=False,
                                                              add_generation_prompt=gen)
                out.append(iter(texts))
            else:
                out.append(iter(()))
        return [next(out[int(g)]) for g in add_generation_prompt]

    def __getstate__(self):  # data-loader workers get a copy: the transformers tokenizer is loaded again there
        return {**self.__dict__, "_transformers": None}


def _chat_template(config: dict, directory: Path, cfg_file: Path) -> str | None:
    """The tokenizer's chat template: tokenizer_config.json `chat_template` (a string, or a list of
    named templates: the "default" one), else chat_template.jinja (where transformers >= 4.43 saves it)."""
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if t is not None and not (isinstance(t, str) and t.strip()):
        raise DataError(f"tokenizer {cfg_file}: chat_template must be a non-empty string")
    jinja = directory / "chat_template.jinja"
    if t is None and jinja.is_file():
        t = jinja.read_text(encoding="utf-8")
    return t or None


def load_tokenizer(spec: str):
    """`bytes`, a tokenizer.json or a directory holding one, or a hub name `org/name[@revision]`: found
    through huggingface_hub as AutoTokenizer.from_pretrained finds it (cache, HF_TOKEN, HF_HUB_OFFLINE;
    zerotrain.dataio.sources.hub). A path that exists wins over a hub name, as in transformers."""
    if spec == "bytes":
        return ByteTokenizer()
    if Path(spec).exists():
        return HFTokenizer(spec)
    if split_name(spec) is None:
        raise DataError(f"tokenizer {spec}: no such file or directory (use 'bytes', a tokenizer.json / directory,"
                        " or a Hugging Face hub name ORG/NAME[@REVISION])")
    try:
        directory, name, origin = tokenizer_snapshot(spec)
    except DataError as e:
        if "/" in spec:
            raise
        # a bare word is a hub name to transformers too (gpt2), but more likely a path mistyped
        raise DataError(f"tokenizer {spec}: no such file or directory; as a hub name:"
                        f" {str(e).removeprefix(f'tokenizer {spec}: ')}") from None
    return HFTokenizer(directory, name=name, origin=origin)


def same_vocabulary(a, b) -> bool:
    """The two tokenizers map every token to the same id (the same file, or the same vocabulary and added
    tokens in two files); the byte tokenizer is only itself."""
    if a.sha256 == b.sha256:
        return True
    if ByteTokenizer.name in (a.name, b.name):
        return False
    return a._tok.get_vocab(with_added_tokens=True) == b._tok.get_vocab(with_added_tokens=True)


TRAINING_RECORD = "tokenizer_training.json"  # what train_bpe was asked for and what it obtained


def train_bpe(texts, vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on an iterator of documents; save it in the Hugging Face format.

    The directory loads with `tokenizers.Tokenizer.from_file(DIR/tokenizer.json)`,
    `transformers.AutoTokenizer.from_pretrained(DIR)` and zerotrain's `--tokenizer DIR`. DIR/TRAINING_RECORD
    records the vocabulary asked and the one obtained, with the documents and bytes it was trained on: BPE stops
    merging when no pair of tokens is left to merge, so too little text gives a smaller vocabulary than asked.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataError(f"--vocab-size {vocab_size}: must be at least {256 + len(SPECIAL_TOKENS)}"
                        " (256 byte tokens + the special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    seen = {"documents": 0, "bytes": 0}

    def counted():
        for text in texts:
            seen["documents"] += 1
            seen["bytes"] += len(text.encode("utf-8"))
            yield text

    tok.train_from_iterator(counted(), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / TRAINING_RECORD).write_text(json.dumps({
        "vocab_size_asked": vocab_size, "vocab_size_obtained": tok.get_vocab_size(with_added_tokens=True),
        **seen}, indent=2) + "\n")
    eos, bos = SPECIAL_TOKENS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos,
        "unk_token": None, "pad_token": eos, "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 1_000_000_000}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": eos, "bos_token": bos, "pad_token": eos}, indent=2) + "\n")
    return out
