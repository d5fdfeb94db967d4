"""The mix file format: its keys, what they mean, and `parse_mix`, which reads and validates a mix into
a `Mix` of `SourceSpec`s. Nothing here reads data: a spec names files, a reader opens them.

A mix file is JSON (examples in dataio/mixes/):

    {"description": "...",                  optional
     "on_exhausted": "restart",             restart | stop   (default restart; per source too)
     "bad_records": "stop",                 stop | skip      (default stop; per source too)
     "bos": false,                          true: every document starts with the tokenizer's BOS (per source too)
     "warn_epochs": 4,                      warn before training when a source would repeat more
     "sources": [
       {"name": "web",  "weight": 0.7, "path": "data/web.jsonl"},
       {"name": "code", "weight": 0.3, "path": "data/code.txt", "sample_by": "paragraph"},
       {"name": "pdfs", "weight": 0.2, "path": ["pdfs/*.jsonl.gz", "more-pdfs/"]},
       {"name": "fw",   "weight": 0.5, "hf": "/nvme/fineweb-edu", "config": "sample-10BT"},
       {"name": "edu",  "weight": 0.5, "hf": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT"},
       {"name": "qa",   "weight": 0.1, "hf": "GBaker/MedQA-USMLE-4-options",
        "template": "Question: {question}\\nAnswer: {answer}"}]}

A source has exactly one of `path` or `hf`; its data files, however many, are ONE source with
one weight, its documents split across ranks over the whole source:

- `path`: a file, a glob, a directory, or a list of these (relative to the mix file). Files are
  .parquet, .arrow, .jsonl / .json / .ndjson (also compressed: .jsonl.gz, .bz2, .xz, .zst) or
  .txt, one format per source. A glob (`*`, `?`, `[...]`, `**` for any depth) is expanded by
  `datasets`' own resolver (`datasets.data_files.resolve_pattern`, as in `load_dataset(...,
  data_files=GLOB)`: hidden files are skipped); a directory holds the files `load_dataset(DIR)`
  would take for `split` (datasets' file-name conventions: `train-*`, `test/`, ...; otherwise all
  its data files), or is a `datasets.save_to_disk` directory. Non-data files (README.md, images)
  are ignored; the files found are de-duplicated and sorted, so the order is deterministic.
- `hf`: a hub dataset name (`owner/name`, streamed with `datasets` `streaming=True`) or a local
  directory (relative to the mix file; one that exists there wins over a hub name, as in
  load_dataset): a hub snapshot as `hf download` / `snapshot_download` leave it, read
  like `load_dataset(DIR, config, data_dir=..., data_files=...)` (its README.md configs apply),
  with `split` (default "train"). Offline (`HF_HUB_OFFLINE=1` or `HF_DATASETS_OFFLINE=1`) a hub
  name is read from its snapshot in the Hugging Face hub cache if one is there (datasets alone
  would only look in its own Arrow cache), else from datasets' Arrow cache of an earlier
  `load_dataset`; nothing is downloaded. A streamed hub source has no known size (no epochs, no
  `on_exhausted` warning before training), no held-out documents (evaluate with --eval-data) and is
  read in order; its resume position is the stream's own state.
- `"download": true` with a hub name: the source is materialised once instead of streamed: its
  config's files (and README.md) are downloaded into the Hugging Face hub cache by
  `huggingface_hub.snapshot_download` (HF_HOME / HF_HUB_CACHE, HF_TOKEN; offline: the cache only) when
  the run starts, then read as that local snapshot directory: counted, held out for evaluation, visited
  in epochs and re-split on another world size like local files (zerotrain.dataio.sources.hub).
  `zerotrain prepare` is the other way: it tokenizes a streamed source into shards.

Local sources (`path`, `hf` directories) are read file by file with `datasets.load_dataset`
(the file's builder: parquet, json, arrow, csv), which converts each file once into its Arrow
cache (`HF_DATASETS_CACHE`, default ~/.cache/huggingface/datasets: room for the uncompressed
text is needed there) and memory-maps it; documents are views of those mapped buffers, so a
source far larger than RAM costs a few bytes of index per document. .txt files are memory-mapped
by our own reader (zerotrain.dataio.sources.readers). One file at a time also means every error names its file.
`"streaming": true` reads a local source through the streamed path of a hub dataset instead (no
random access, no shuffling, size unknown). Documents are the `text_field` column ("text" by
default), or `template` rendered with `str.format_map` on each record.

`sample_by` (.txt files): "paragraph" (the default) splits at blank lines, "line" makes every line
a document (what `datasets`' own text loader does), "document" takes the file whole. The default
stays "paragraph": prose, poetry and source code keep their context across line breaks, where
"line" would silently cut it at every newline (a Python file would become one-line documents).
A file with one record per line and no blank lines is one document under "paragraph": it still
trains (long documents are cut into pieces, below), and the summary printed before training warns
and suggests `"sample_by": "line"`. Changing this default would also change what existing mix
files mean.

Long documents are cut into pieces (each a document of its own) before the documents are split
across ranks: by `--piece-len` (default 8 x --seq-len), not by a mix key; zerotrain.dataio.format.pieces
says how, and why the bound is part of the data's identity.

Supervised fine-tuning records (dataio/sources/sft.py has the rendering, the mask and the rules):

    {"name": "qa",   "weight": 0.2, "path": "qa.jsonl", "format": "sft",
     "prompt_field": "question", "response_field": "answer", "separator": "\\n", "overflow": "drop"},
    {"name": "chat", "weight": 0.3, "hf": "/nvme/hf/ultrachat", "format": "chat", "messages_field": "messages"}

- `format`: "text" (the default: documents, as above), "sft" (prompt/response records) or "chat"
  (records holding a list of {"role", "content"} messages); "tokens" is a flat token file (below).
- "sft": `prompt_field` (default "prompt"), `response_field` (default "response"), `separator`
  (default "\\n"): the document is prompt + separator + response, loss on the response and the EOS.
- "chat": `messages_field` (default "messages"); rendered with the tokenizer's chat template, else
  the plain ChatML template; loss on every assistant turn, its end-of-turn token included.
- `overflow` (sft and chat): a record longer than --seq-len is "truncate_prompt" (default: its start
  is cut, the last response kept whole), "drop" or "error"; counted in the summary before training.
A record without a response (missing or empty), a chat whose roles do not alternate (optional
system, then user / assistant in turn) or that has no assistant turn is a bad record
(`bad_records`: stop names the source, file and line; skip counts it). SFT records come from
json lines, json, parquet, arrow, save_to_disk or hub datasets (not .txt); they are never cut
into pieces (one record = one document) and `zerotrain prepare` does not take them. Token
shares count all tokens of a record (prompt, response and EOS): SFT and text sources mix freely.

Flat token files (zerotrain.dataio.format.tokenfile has the layout, the document split and the cache):

    {"name": "owt", "weight": 0.8, "path": "DATASET/train.bin", "format": "tokens", "dtype": "uint16", "eos_id": 50256}

- "tokens": `path` is ONE file of token ids (`dtype` uint16 or uint32, as nanoGPT's prepare.py writes
  them), documents separated by the end-of-text id `eos_id` (required); memory-mapped and read in place,
  no `zerotrain prepare`. It takes only `weight` and `on_exhausted` besides; its size must be a whole
  number of ids. The run's --tokenizer must be the one that made it (checked: its vocabulary covers the
  file's largest id, its end-of-text id is `eos_id`).

Weights are shares of TOKENS (not documents); they need not sum to 1. See zerotrain.dataio.pipeline.loader.

Not here: reading the files a spec names (zerotrain.dataio.sources.readers: local sources -> DocStore;
zerotrain.dataio.sources.streamed: hub and streamed sources -> records -> text), cutting documents into
pieces (zerotrain.dataio.format.pieces), mixing them into batches (zerotrain.dataio.pipeline.loader). Loading never
unpickles: local files go through `datasets`' Arrow readers or our own text reader, and hub sources
through `datasets` streaming.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from zerotrain.dataio.format.errors import DataError, DataNotHere
from zerotrain.reading import read_json

# A source's `format` and, for sft/chat sources, what to do with a record longer than seq_len
# (zerotrain.dataio.sources.sft renders and cuts them)
FORMATS = ("text", "sft", "chat", "tokens")
OVERFLOWS = ("truncate_prompt", "drop", "error")

# The datasets builder that reads each data file format (.txt: our own reader, readers._load_txt).
BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".txt": "text", ".parquet": "parquet",
            ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # json lines only: datasets decompresses them
GLOB_CHARS = "*?["
SOURCE_KEYS = {"name", "path", "hf", "config", "split", "text_field", "template", "weight", "sample_by",
               "on_exhausted", "bad_records", "streaming", "download", "data_dir", "data_files",
               "format", "prompt_field", "response_field", "separator", "messages_field", "overflow", "dtype",
               "eos_id", "bos"}
SFT_KEYS = {"sft": {"prompt_field", "response_field", "separator", "overflow"}, "chat": {"messages_field", "overflow"}}
TEXT_ONLY_KEYS = ("text_field", "template", "sample_by")  # what makes a document of a text record
TOKEN_KEYS = ("dtype", "eos_id")  # a flat token file's (zerotrain.dataio.format.tokenfile)
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}  # bytes per id
MIX_KEYS = {"description", "sources", "on_exhausted", "bad_records", "warn_epochs", "bos"}
ON_EXHAUSTED = ("restart", "stop")
BAD_RECORDS = ("stop", "skip")
HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float  # normalised: the weights of a mix sum to 1
    path: str | tuple[str, ...] | None = None  # absolute file / glob / directory; a tuple when the mix gave a list
    hf: str | None = None  # a hub name, or an absolute local directory (a snapshot)
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    template: str | None = None
    sample_by: str = "paragraph"
    on_exhausted: str = "restart"
    bad_records: str = "stop"
    streaming: bool = False
    data_dir: str | None = None  # with hf, as in load_dataset
    data_files: str | list | dict | None = None  # with hf, as in load_dataset (relative to the dataset)
    format: str = "text"  # text | sft | chat (dataio/sources/sft.py)
    prompt_field: str = "prompt"  # sft
    response_field: str = "response"  # sft
    separator: str = "\n"  # sft: between prompt and response
    messages_field: str = "messages"  # chat
    overflow: str = "truncate_prompt"  # sft, chat: a record longer than --seq-len
    # a hub name: downloaded once into the hub cache and read as local files (dataio/sources/hub.py)
    download: bool = False
    hub: str | None = None  # a downloaded source: the hub name; `hf` is then its local snapshot directory
    dtype: str | None = None  # format tokens: the file's id type (TOKEN_DTYPES)
    eos_id: int | None = None  # format tokens: the end-of-text id that separates its documents
    # every document (and piece) of the source starts with the tokenizer's BOS, as transformers' encode puts it
    # before a text for a Llama; not for sft/chat (their chat template decides). The loader adds it.
    bos: bool = False

    @property
    def paths(self) -> tuple[str, ...]:
        """`path` as a tuple of entries (files, globs, directories); () for an hf source."""
        if self.path is None:
            return ()
        return (self.path,) if isinstance(self.path, str) else tuple(self.path)

    @property
    def local_hf(self) -> bool:
        """An `hf` source that is a local directory (parse_mix made it absolute; hub names never are)."""
        return self.hf is not None and os.path.isabs(self.hf)

    @property
    def streamed(self) -> bool:
        return self.streaming or (self.hf is not None and not self.local_hf)

    def where(self) -> str:
        return f"source {self.name!r}"

    def location(self) -> str:
        """What the mix named, for messages and the summary."""
        if self.hub is not None:
            return f"{self.hub}, downloaded: {self.hf}"
        return self.hf or ", ".join(self.paths) or self.name

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Mix:
    path: str
    sources: tuple[SourceSpec, ...]
    warn_epochs: float = 4.0
    description: str = ""


def _choice(value, allowed, what: str, at: str) -> str:
    if value not in allowed:
        raise DataError(f"{at}: {what} must be {' or '.join(allowed)}, got {value!r}")
    return value


def parse_mix(mix_path: str | Path) -> Mix:
    """Read and validate a mix file; every problem is a DataError naming the file and the source."""
    mix_path = Path(mix_path)
    where = f"mix {mix_path}"
    if mix_path.is_dir():  # a `zerotrain prepare` directory, given where a mix of sources is read
        raise DataError(f"{where}: a directory; this takes a mix .json file (its sources' text; docs/data.md)")
    if not mix_path.is_file():
        raise DataError(f"{where}: no such file")
    try:
        raw = read_json(mix_path, where, DataError)
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or not raw["sources"]:
        raise DataError(f"{where}: expected an object with a non-empty 'sources' list")
    unknown = set(raw) - MIX_KEYS
    if unknown:
        raise DataError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    default_exhausted = _choice(raw.get("on_exhausted", "restart"), ON_EXHAUSTED, "on_exhausted", where)
    default_bad = _choice(raw.get("bad_records", "stop"), BAD_RECORDS, "bad_records", where)
    default_bos = _flag(raw.get("bos", False), "bos", where)
    warn_epochs = raw.get("warn_epochs", 4.0)
    if isinstance(warn_epochs, bool) or not isinstance(warn_epochs, (int, float)) or not warn_epochs > 0:
        raise DataError(f"{where}: warn_epochs must be a positive number, got {warn_epochs!r}")
    specs, names = [], set()
    for i, src in enumerate(raw["sources"]):
        try:
            specs.append(_parse_source(src, i, names, mix_path, where, default_exhausted, default_bad, default_bos))
        except DataNotHere as e:  # the mix's own description says what writes its files (the demo mix: `zerotrain demo`)
            if not isinstance(raw.get("description"), str) or not raw["description"]:
                raise
            raise DataNotHere(f"{e} (the mix: {raw['description']})") from None
    total = sum(s.weight for s in specs)
    specs = tuple(SourceSpec(**{**s.to_dict(), "weight": s.weight / total}) for s in specs)
    return Mix(path=str(mix_path), sources=specs, warn_epochs=float(warn_epochs),
               description=raw.get("description", ""))


def _parse_source(src, i: int, names: set, mix_path: Path, where: str, default_exhausted: str,
                  default_bad: str, default_bos: bool = False) -> SourceSpec:
    """One entry of a mix's "sources" list (its name is added to `names`, to refuse a duplicate)."""
    if not isinstance(src, dict):
        raise DataError(f"{where}: source #{i} is not an object")
    name = src.get("name", f"#{i}")
    at = f"{where}: source {name!r}"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise DataError(f"{at}: name must be ASCII letters, digits, '_', '-' or '.'")
    unknown = set(src) - SOURCE_KEYS
    if unknown:
        raise DataError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}")
    if name in names:
        raise DataError(f"{at}: duplicate source name")
    names.add(name)
    w = src.get("weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise DataError(f"{at}: weight must be a positive number, got {w!r}")
    bos = _flag(src.get("bos", default_bos), "bos", at)
    if src.get("format") == "tokens" or any(k in src for k in TOKEN_KEYS):
        return _parse_token_source(src, name, float(w), at, mix_path, default_exhausted, default_bad, bos)
    if ("path" in src) == ("hf" in src):
        raise DataError(f"{at}: give exactly one of 'path' (local files: a file, glob, directory or list)"
                        " or 'hf' (a hub dataset name or a local dataset directory)")
    for key in ("hf", "config", "split", "text_field", "template", "data_dir"):
        if key in src and not (isinstance(src[key], str) and src[key]):
            raise DataError(f"{at}: {key} must be a non-empty string, got {src[key]!r}")
    if "template" in src and "text_field" in src:
        raise DataError(f"{at}: give text_field or template, not both")
    fmt = _choice(src.get("format", "text"), FORMATS, "format", at)
    if bos and fmt in SFT_KEYS:
        if "bos" in src:
            raise DataError(f"{at}: bos goes with format text or tokens; a format {fmt} source renders its records"
                            " itself (a chat template writes its own BOS)")
        bos = False  # the mix's default: its text sources
    for key in ("prompt_field", "response_field", "messages_field"):
        if key in src and not (isinstance(src[key], str) and src[key]):
            raise DataError(f"{at}: {key} must be a non-empty string, got {src[key]!r}")
    if "separator" in src and not isinstance(src["separator"], str):
        raise DataError(f"{at}: separator must be a string, got {src['separator']!r}")
    misplaced = sorted(k for k in set().union(*SFT_KEYS.values()) if k in src and k not in SFT_KEYS.get(fmt, ()))
    if misplaced:
        goes = " or ".join(f for f, keys in SFT_KEYS.items() if misplaced[0] in keys)
        raise DataError(f"{at}: {misplaced[0]} goes with format {goes}, this source is format {fmt}")
    if fmt != "text" and any(k in src for k in TEXT_ONLY_KEYS):
        key = next(k for k in TEXT_ONLY_KEYS if k in src)
        raise DataError(f"{at}: {key} goes with format text; a format {fmt} source renders its records itself")
    overflow = _choice(src.get("overflow", "truncate_prompt"), OVERFLOWS, "overflow", at)
    path = _parse_path(src["path"], mix_path, at) if "path" in src else None
    hf = _parse_hf(src["hf"], mix_path, at) if "hf" in src else None
    for key in ("data_dir", "data_files"):
        if key in src and hf is None:
            raise DataError(f"{at}: {key} goes with 'hf' (a dataset directory or hub name); 'path' takes the"
                            " files themselves (a glob, a directory or a list)")
    if "data_dir" in src and (os.path.isabs(src["data_dir"]) or ".." in Path(src["data_dir"]).parts):
        raise DataError(f"{at}: data_dir must be a directory inside the dataset, got {src['data_dir']!r}")
    if "data_files" in src and not _data_files_ok(src["data_files"]):
        raise DataError(f"{at}: data_files must be a pattern, a list of patterns, or an object of"
                        f" split -> pattern(s), got {src['data_files']!r}")
    sample_by = _choice(src.get("sample_by", "paragraph"), ("paragraph", "line", "document"), "sample_by", at)
    streaming, download = _flag(src.get("streaming", False), "streaming", at), _flag(src.get("download", False),
                                                                                     "download", at)
    if download and (hf is None or os.path.isabs(hf) or streaming):
        raise DataError(f"{at}: download goes with a hub dataset name in 'hf' (not a local directory or 'path'),"
                        " and not with streaming")
    if streaming and any(not has_glob(e) and file_format(e) == "text" for e in (path or ())):
        raise DataError(f"{at}: streaming applies to jsonl/parquet/arrow/hub sources, not .txt")
    if fmt != "text" and any(not has_glob(e) and file_format(e) == "text" for e in (path or ())):
        raise DataError(f"{at}: format {fmt} reads records (jsonl, json, parquet, arrow, a dataset), not .txt")
    return SourceSpec(
        name=name, weight=float(w), path=path[0] if isinstance(src.get("path"), str) else path, hf=hf,
        config=src.get("config"), split=src.get("split", "train"), text_field=src.get("text_field", "text"),
        template=src.get("template"), sample_by=sample_by, streaming=streaming, data_dir=src.get("data_dir"),
        data_files=src.get("data_files"), format=fmt, prompt_field=src.get("prompt_field", "prompt"),
        response_field=src.get("response_field", "response"), separator=src.get("separator", "\n"),
        messages_field=src.get("messages_field", "messages"), overflow=overflow, download=download,
        on_exhausted=_choice(src.get("on_exhausted", default_exhausted), ON_EXHAUSTED, "on_exhausted", at),
        bad_records=_choice(src.get("bad_records", default_bad), BAD_RECORDS, "bad_records", at), bos=bos)


def check_bos(specs, tokenizer, where: str) -> None:
    """A "bos": true source needs a tokenizer with a BOS token (training, `zerotrain prepare`)."""
    for spec in specs:
        if spec.bos and tokenizer.bos_id is None:
            raise DataError(f"{where}: {spec.where()}: bos: true, but tokenizer {tokenizer.name} has no BOS token")


def _flag(value, key: str, at: str) -> bool:
    if not isinstance(value, bool):
        raise DataError(f"{at}: {key} must be true or false, got {'null' if value is None else repr(value)}")
    return value


def _parse_token_source(src: dict, name: str, weight: float, at: str, mix_path: Path, default_exhausted: str,
                        default_bad: str, bos: bool = False) -> SourceSpec:
    """A flat token file (`"format": "tokens"`, zerotrain.dataio.format.tokenfile): one file of `dtype` ids whose
    size is a whole number of ids, documents separated by `eos_id`. Nothing is read but its size."""
    fmt = src.get("format", "text")
    if fmt != "tokens":
        key = next(k for k in TOKEN_KEYS if k in src)
        raise DataError(f"{at}: {key} goes with format tokens (a flat token file), this source is format {fmt}")
    extra = sorted(set(src) - {"name", "weight", "path", "format", "on_exhausted", "bos", *TOKEN_KEYS})
    if extra:
        raise DataError(f"{at}: {extra[0]} does not go with format tokens (a flat token file takes path, dtype,"
                        " eos_id, weight, on_exhausted)")
    if not isinstance(src.get("path"), str) or not src["path"] or has_glob(src["path"]):
        raise DataError(f"{at}: format tokens takes one file in 'path' (e.g. \"DATASET/train.bin\"),"
                        f" got {src.get('path')!r}")
    dtype = src.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"{at}: dtype must be {' or '.join(TOKEN_DTYPES)} (the file's token id type), got {dtype!r}")
    eos = src.get("eos_id")
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < 1 << (8 * TOKEN_DTYPES[dtype]):
        raise DataError(f"{at}: eos_id must be the end-of-text id that separates the file's documents (an integer"
                        f" that fits {dtype}; 50256 for GPT-2 BPE), got {eos!r}")
    p = Path(src["path"]).expanduser()
    p = Path(os.path.abspath(p if p.is_absolute() else mix_path.parent / p))
    if not p.exists():
        raise DataNotHere(f"{at}: data file {p} does not exist")
    if not p.is_file():
        raise DataError(f"{at}: format tokens takes one file, {p} is not a file")
    size = p.stat().st_size
    if size % TOKEN_DTYPES[dtype]:
        raise DataError(f"{at}: {p} holds {size:,} bytes, not a whole number of {dtype} ids"
                        f" ({TOKEN_DTYPES[dtype]} bytes each): wrong dtype, or a truncated file")
    return SourceSpec(name=name, weight=weight, path=str(p), format="tokens", dtype=dtype, eos_id=eos,
                      on_exhausted=_choice(src.get("on_exhausted", default_exhausted), ON_EXHAUSTED, "on_exhausted", at),
                      bad_records=default_bad, bos=bos)


def has_glob(entry: str) -> bool:
    """A `path` entry that is a glob (expanded when the source is read, by datasets)."""
    return any(c in entry for c in GLOB_CHARS)


def file_format(name: str) -> str | None:
    """The builder for a data file name ("parquet", "arrow", "json", "text"), or None if unsupported.
    Compressed json lines (x.jsonl.gz) are "json"; other compressed files are unsupported."""
    base = name.lower()
    compressed = base.endswith(COMPRESSED)
    if compressed:
        base = base[:base.rindex(".")]
    fmt = BUILDERS.get(os.path.splitext(base)[1])
    return fmt if fmt == "json" or not compressed else None


def _parse_path(value, mix_path: Path, at: str) -> tuple[str, ...]:
    """`path` as absolute entries. Entries without a glob must exist (a supported file or a directory);
    globs are expanded when the source is read (find_files), by datasets."""
    entries = value if isinstance(value, list) else [value]
    if not entries or not all(isinstance(e, str) and e for e in entries):
        raise DataError(f"{at}: path must be a file, glob or directory (or a non-empty list of them), got {value!r}")
    out = []
    for e in entries:
        p = Path(e).expanduser()
        p = Path(os.path.abspath(p if p.is_absolute() else mix_path.parent / p))
        if not has_glob(e):
            if not p.exists():
                raise DataNotHere(f"{at}: data file {p} does not exist")
            if p.is_file() and file_format(p.name) is None:
                raise DataError(f"{at}: unsupported file type {''.join(p.suffixes[-2:]) or p.name!r}"
                                f" (use {', '.join(BUILDERS)}; json lines may be compressed: {', '.join(COMPRESSED)})")
        out.append(str(p))
    return tuple(out)


def _parse_hf(value: str, mix_path: Path, at: str) -> str:
    """A local directory (relative to the mix file; returned absolute) or a hub dataset name."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else mix_path.parent / p
    if p.is_dir():
        return os.path.abspath(p)
    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        raise DataError(f"{at}: hf {value!r}: no such directory ({os.path.abspath(p)})")
    if not HUB_NAME.fullmatch(value):
        raise DataError(f"{at}: hf must be a hub dataset name like 'owner/name' or a local directory, got {value!r}")
    return value


def _data_files_ok(value) -> bool:
    def patterns(v):
        return (isinstance(v, str) and bool(v)) or (isinstance(v, list) and bool(v) and
                                                    all(isinstance(x, str) and x for x in v))
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and k and patterns(v) for k, v in value.items())
    return patterns(value)
