"""Mix files and the sources they name: parsing, validation, and loading documents as byte buffers.

A mix file is JSON (examples in dataio/mixes/):

    {"description": "...",                  optional
     "on_exhausted": "restart",             restart | stop   (default restart; per source too)
     "bad_records": "stop",                 stop | skip      (default stop; per source too)
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
  load_dataset): a hub snapshot as `huggingface-cli download` / `snapshot_download` leave it, read
  like `load_dataset(DIR, config, data_dir=..., data_files=...)` (its README.md configs apply),
  with `split` (default "train"). Offline (`HF_HUB_OFFLINE=1` or `HF_DATASETS_OFFLINE=1`) a hub
  name is read from its snapshot in the Hugging Face hub cache if one is there (datasets alone
  would only look in its own Arrow cache), else from datasets' Arrow cache of an earlier
  `load_dataset`; nothing is downloaded.

Local sources (`path`, `hf` directories) are read file by file with `datasets.load_dataset`
(the file's builder: parquet, json, arrow, csv), which converts each file once into its Arrow
cache (`HF_DATASETS_CACHE`, default ~/.cache/huggingface/datasets: room for the uncompressed
text is needed there) and memory-maps it; documents are views of those mapped buffers, so a
source far larger than RAM costs a few bytes of index per document. .txt files are memory-mapped
by our own reader (below). One file at a time also means every error names its file.
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

Supervised fine-tuning records (dataio/sft.py has the rendering, the mask and the rules):

    {"name": "qa",   "weight": 0.2, "path": "qa.jsonl", "format": "sft",
     "prompt_field": "question", "response_field": "answer", "separator": "\\n", "overflow": "drop"},
    {"name": "chat", "weight": 0.3, "hf": "/nvme/hf/ultrachat", "format": "chat", "messages_field": "messages"}

- `format`: "text" (the default: documents, as above), "sft" (prompt/response records) or "chat"
  (records holding a list of {"role", "content"} messages).
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

Weights are shares of TOKENS (not documents); they need not sum to 1. See zerotrain.dataio.loader.

Loading never unpickles: local files go through `datasets`' Arrow readers or our own text
reader, and hub sources through `datasets` streaming.

The layers, for whoever adds a record kind: `parse_mix` (the JSON) -> `find_files` (a local
source's files, by datasets) -> `load_text_source` (each file's Arrow table -> `_docstore_from_table`,
which turns records into document text: `text_field` or `template`) -> one DocStore per source.
Streamed sources: `open_streamed` -> records -> `record_text`. SFT records branch off in
`_docstore_from_table` (`_sft_docstore`: text + response spans) and `zerotrain.dataio.loader.load_data`
tokenizes them with their mask (`zerotrain.dataio.sft.tokenize_store`).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from zerotrain.dataio.errors import DataError
from zerotrain.dataio.sft import FORMATS, OVERFLOWS, ChatRenderer, is_sft, render_record

# The datasets builder that reads each data file format (.txt: our own reader, see _load_txt).
BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".txt": "text", ".parquet": "parquet",
            ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # json lines only: datasets decompresses them
# Files a directory or glob is searched for: datasets' tabular and text formats. Anything else
# (README.md, LICENSE, images) is not data and is skipped, as load_dataset(DIR) skips it; a .csv
# next to parquet shards is found, so it is refused as a second format rather than dropped.
DATA_EXTENSIONS = [".arrow", ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".parquet", ".txt", ".xml", ".lance"]
GLOB_CHARS = "*?["
SAVED = "save_to_disk"  # the "format" of a directory written by datasets' save_to_disk
SOURCE_KEYS = {"name", "path", "hf", "config", "split", "text_field", "template", "weight", "sample_by",
               "on_exhausted", "bad_records", "streaming", "data_dir", "data_files",
               "format", "prompt_field", "response_field", "separator", "messages_field", "overflow"}
SFT_KEYS = {"sft": {"prompt_field", "response_field", "separator", "overflow"}, "chat": {"messages_field", "overflow"}}
TEXT_ONLY_KEYS = ("text_field", "template", "sample_by")  # what makes a document of a text record
MIX_KEYS = {"description", "sources", "on_exhausted", "bad_records", "warn_epochs"}
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
    format: str = "text"  # text | sft | chat (dataio/sft.py)
    prompt_field: str = "prompt"  # sft
    response_field: str = "response"  # sft
    separator: str = "\n"  # sft: between prompt and response
    messages_field: str = "messages"  # chat
    overflow: str = "truncate_prompt"  # sft, chat: a record longer than --seq-len

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
    if not mix_path.is_file():
        raise DataError(f"{where}: no such file")
    try:
        raw = json.loads(mix_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or not raw["sources"]:
        raise DataError(f"{where}: expected an object with a non-empty 'sources' list")
    unknown = set(raw) - MIX_KEYS
    if unknown:
        raise DataError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    default_exhausted = _choice(raw.get("on_exhausted", "restart"), ON_EXHAUSTED, "on_exhausted", where)
    default_bad = _choice(raw.get("bad_records", "stop"), BAD_RECORDS, "bad_records", where)
    warn_epochs = raw.get("warn_epochs", 4.0)
    if isinstance(warn_epochs, bool) or not isinstance(warn_epochs, (int, float)) or not warn_epochs > 0:
        raise DataError(f"{where}: warn_epochs must be a positive number, got {warn_epochs!r}")
    specs, names = [], set()
    for i, src in enumerate(raw["sources"]):
        specs.append(_parse_source(src, i, names, mix_path, where, default_exhausted, default_bad))
    total = sum(s.weight for s in specs)
    specs = tuple(SourceSpec(**{**s.to_dict(), "weight": s.weight / total}) for s in specs)
    return Mix(path=str(mix_path), sources=specs, warn_epochs=float(warn_epochs),
               description=raw.get("description", ""))


def _parse_source(src, i: int, names: set, mix_path: Path, where: str, default_exhausted: str,
                  default_bad: str) -> SourceSpec:
    """One entry of a mix's "sources" list (its name is added to `names`, to refuse a duplicate)."""
    if not isinstance(src, dict):
        raise DataError(f"{where}: source #{i} is not an object")
    name = src.get("name", f"#{i}")
    at = f"{where}: source {name!r}"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise DataError(f"{at}: name must be letters, digits, '_', '-' or '.'")
    unknown = set(src) - SOURCE_KEYS
    if unknown:
        raise DataError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}")
    if name in names:
        raise DataError(f"{at}: duplicate source name")
    names.add(name)
    w = src.get("weight")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
        raise DataError(f"{at}: weight must be a positive number, got {w!r}")
    if ("path" in src) == ("hf" in src):
        raise DataError(f"{at}: give exactly one of 'path' (local files: a file, glob, directory or list)"
                        " or 'hf' (a hub dataset name or a local dataset directory)")
    for key in ("hf", "config", "split", "text_field", "template", "data_dir"):
        if key in src and not (isinstance(src[key], str) and src[key]):
            raise DataError(f"{at}: {key} must be a non-empty string, got {src[key]!r}")
    if "template" in src and "text_field" in src:
        raise DataError(f"{at}: give text_field or template, not both")
    fmt = _choice(src.get("format", "text"), FORMATS, "format", at)
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
    streaming = src.get("streaming", False)
    if not isinstance(streaming, bool):
        raise DataError(f"{at}: streaming must be true or false, got {streaming!r}")
    if streaming and any(not _has_glob(e) and file_format(e) == "text" for e in (path or ())):
        raise DataError(f"{at}: streaming applies to jsonl/parquet/arrow/hub sources, not .txt")
    if fmt != "text" and any(not _has_glob(e) and file_format(e) == "text" for e in (path or ())):
        raise DataError(f"{at}: format {fmt} reads records (jsonl, json, parquet, arrow, a dataset), not .txt")
    return SourceSpec(
        name=name, weight=float(w), path=path[0] if isinstance(src.get("path"), str) else path, hf=hf,
        config=src.get("config"), split=src.get("split", "train"), text_field=src.get("text_field", "text"),
        template=src.get("template"), sample_by=sample_by, streaming=streaming, data_dir=src.get("data_dir"),
        data_files=src.get("data_files"), format=fmt, prompt_field=src.get("prompt_field", "prompt"),
        response_field=src.get("response_field", "response"), separator=src.get("separator", "\n"),
        messages_field=src.get("messages_field", "messages"), overflow=overflow,
        on_exhausted=_choice(src.get("on_exhausted", default_exhausted), ON_EXHAUSTED, "on_exhausted", at),
        bad_records=_choice(src.get("bad_records", default_bad), BAD_RECORDS, "bad_records", at))


def _has_glob(entry: str) -> bool:
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
        if not _has_glob(e):
            if not p.exists():
                raise DataError(f"{at}: data file {p} does not exist")
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


# --------------------------------------------------------------------------------------------
# A local source's data files, found by datasets
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SourceFiles:
    """A local source's data files (sorted) and how each is read.

    fmt: the datasets builder that reads every file ("parquet", "json", "arrow", "csv", ...),
    "text" (our .txt reader) or SAVED (save_to_disk directories, read with load_from_disk).
    dataset: for an `hf` directory, the directory handed to `load_dataset` with the source's
    config (its README configs apply to every file); None: the builder `fmt` reads each file.
    """
    files: tuple[str, ...]
    fmt: str
    dataset: str | None = None


def find_files(spec: SourceSpec) -> SourceFiles:
    """The files of a local source (`path`, or an `hf` directory): globs and directories resolved
    by datasets, de-duplicated and sorted; one format. Nothing is read. DataError (one line) else."""
    if spec.local_hf:
        return _dataset_dir_files(spec)
    found = set()
    for entry in spec.paths:
        found.update(_expand(spec, entry))
    files = tuple(sorted(found))
    by_format: dict[str, list[str]] = {}
    for f in files:
        fmt = SAVED if os.path.isdir(f) else file_format(f)
        if fmt is None:
            raise DataError(f"{spec.where()}: {f}: unsupported file type (use {', '.join(BUILDERS)};"
                            f" json lines may be compressed: {', '.join(COMPRESSED)})")
        by_format.setdefault(fmt, []).append(f)
    if len(by_format) > 1:
        kinds = ", ".join(f"{len(v)} {k} (e.g. {v[0]})" for k, v in by_format.items())
        raise DataError(f"{spec.where()}: {spec.location()} holds files of more than one format: {kinds};"
                        " one format per source (make one source per format, or narrow the path)")
    return SourceFiles(files, next(iter(by_format)))


def _saved_dataset(p: Path) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def _expand(spec: SourceSpec, entry: str) -> list[str]:
    """One `path` entry as files: itself, a glob's matches, or a directory's data files."""
    from datasets.data_files import DataFilesList, get_data_patterns, resolve_pattern

    if _has_glob(entry):
        try:  # datasets' own globbing (fsspec; `**` for any depth; hidden files skipped)
            return resolve_pattern(entry, base_path="", allowed_extensions=DATA_EXTENSIONS)
        except FileNotFoundError:
            raise DataError(f"{spec.where()}: path {entry} matches no data file") from None
    p = Path(entry)
    if not p.exists():
        raise DataError(f"{spec.where()}: data file {p} does not exist")
    if p.is_file() or _saved_dataset(p):
        return [entry]
    # A directory of data files: the files load_dataset(DIR) takes for the split (datasets' naming
    # conventions tell splits apart: train-*.parquet, test/, ...; without them every file is "train").
    try:
        patterns = {str(k): v for k, v in get_data_patterns(str(p)).items()}
    except Exception:  # datasets raises EmptyDatasetError (a FileNotFoundError) for a directory of no data files
        patterns = {}
    if spec.split not in patterns:
        if not patterns:
            raise DataError(f"{spec.where()}: directory {p} holds no data files ({', '.join(BUILDERS)})")
        raise DataError(f"{spec.where()}: directory {p} has no split {spec.split!r} (its files name the splits"
                        f" {', '.join(map(str, patterns))}); set \"split\" in the mix")
    try:
        return list(DataFilesList.from_patterns(patterns[spec.split], base_path=str(p),
                                                allowed_extensions=DATA_EXTENSIONS))
    except FileNotFoundError:
        raise DataError(f"{spec.where()}: directory {p} holds no data files ({', '.join(BUILDERS)})") from None


def _dataset_dir_files(spec: SourceSpec) -> SourceFiles:
    """An `hf` directory: the split's files as load_dataset(DIR, config, data_dir=, data_files=) sees them."""
    d = Path(spec.hf)
    if _saved_dataset(d):
        return SourceFiles((spec.hf,), SAVED)
    datasets = _quiet_datasets()
    try:
        builder = datasets.load_dataset_builder(spec.hf, spec.config, **dataset_dir_args(spec.hf, spec))
    except Exception as e:  # no data files, an unknown config, a bad data_dir: datasets' own words
        raise DataError(f"{spec.where()}: cannot open {spec.hf}: {_first_line(e)}") from None
    splits = {str(k): v for k, v in (builder.config.data_files or {}).items()}
    if spec.split not in splits:
        given = f" with data_files {spec.data_files!r}" if spec.data_files else ""
        raise DataError(f"{spec.where()}: {spec.hf}{given} has no split {spec.split!r}"
                        f" (splits: {', '.join(splits) or 'none'}); set \"split\" in the mix")
    return SourceFiles(tuple(sorted(splits[spec.split])), builder.name, spec.hf)


def dataset_dir_args(directory: str, spec: SourceSpec) -> dict:
    """data_dir / data_files for load_dataset(directory, spec.config, ...): the source's own, or else
    those of the README config it names (or the default one). datasets infers the file format
    from the README's FIRST config, so a snapshot holding only the chosen config's files (as
    `huggingface-cli download --include 'sample/10BT/*' --include README.md` leaves it) would
    fail with "no data files" unless the chosen config's files are handed over."""
    if spec.data_dir is not None or spec.data_files is not None:
        return {"data_dir": spec.data_dir, "data_files": spec.data_files}
    readme = Path(directory) / "README.md"
    if not readme.is_file():
        return {}
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data)
    except Exception:  # a card datasets cannot parse either: let load_dataset say so
        return {}
    chosen = configs.get(spec.config or configs.get_default_config_name() or "")
    return {"data_files": chosen["data_files"]} if chosen and chosen.get("data_files") else {}


# --------------------------------------------------------------------------------------------
# Documents as byte buffers
# --------------------------------------------------------------------------------------------

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
    # SFT sources (dataio/sft.py). Rendered records: their response spans, (ptr (n + 1,), bounds (m, 2))
    # in bytes from each document's start, and where each record came from (file index, record number).
    spans: tuple | None = None
    records: np.ndarray | None = None  # (n,) record number within its file, from 1
    record_file: np.ndarray | None = None  # (n,) index into `files`
    # Tokenized (signed tokens, zerotrain.dataio.sft): records truncated / dropped for overflow (zerotrain.dataio.sft.fit).
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


class BadRecords:
    """Counts bad records of one file and applies its source's policy (stop: DataError; skip: count)."""

    def __init__(self, spec: SourceSpec, file: str):
        self.spec, self.file, self.count, self.first = spec, file, 0, ""

    def __call__(self, record: str, why: str) -> None:
        msg = f"{self.spec.where()}: {self.file} {record}: {why}"
        if self.spec.bad_records == "stop":
            raise DataError(msg + " (set \"bad_records\": \"skip\" in the mix to skip and count such records)")
        self.count += 1
        self.first = self.first or f"{Path(self.file).name} {record}: {why}"


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()  # the driver shows one progress bar, the training one
    datasets.logging.set_verbosity_error()
    # datasets 5.x pings the hub to count downloads on every local load_dataset (a 3 s timeout per file on
    # a node whose requests hang); local files are not downloads.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def load_text_source(spec: SourceSpec, tokenizer=None) -> DocStore:
    """All documents of a local (not streamed) source, file by file, validated; bad records per the
    policy. Errors name the file (one line). An SFT source's records are rendered (chats with the
    tokenizer's chat template, or the plain one without a tokenizer) and keep their response spans."""
    found = find_files(spec)
    if is_sft(spec) and found.fmt == "text":
        raise DataError(f"{spec.where()}: format {spec.format} reads records (jsonl, json, parquet, arrow, a dataset),"
                        f" not .txt files ({found.files[0]})")
    renderer = ChatRenderer(tokenizer) if is_sft(spec) else None
    parts = [_read_file(spec, found, f, alone=len(found.files) == 1, renderer=renderer) for f in found.files]
    return _merge(spec, found.files, parts)


def _read_file(spec: SourceSpec, found: SourceFiles, f: str, alone: bool, renderer=None) -> DocStore:
    """One file's documents (an empty store for an empty file of a multi-file source)."""
    p = Path(f)
    if p.is_file() and p.stat().st_size == 0:
        if alone:
            raise DataError(f"{spec.where()}: {p} is empty: holds no documents")
        return _finish(spec, f, "text", [], [], [], [], BadRecords(spec, f), 0)
    if found.fmt == "text":
        return _load_txt(spec, p)
    datasets = _quiet_datasets()
    try:
        if found.fmt == SAVED:
            ds = datasets.load_from_disk(f)
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise DataError(f"{spec.where()}: {p} has no split {spec.split!r} (splits: {', '.join(ds)})")
                ds = ds[spec.split]
        elif found.fmt == "json" and (bad_lines := _non_utf8_lines(p)):
            return _jsonl_without(spec, p, bad_lines, renderer)
        elif found.dataset is not None:  # one file of an hf directory, under its config
            ds = datasets.load_dataset(found.dataset, spec.config, data_files={spec.split: [f]}, split=spec.split)
        else:
            ds = datasets.load_dataset(found.fmt, data_files=[f], split="train")
    except DataError:
        raise
    except Exception as e:  # datasets wraps parser errors in many types
        raise DataError(f"{spec.where()}: cannot read {p}: {_locate_jsonl_problem(p) or _first_line(e)}") from None
    # Not ds.data.table.combine_chunks() or ds["text"]: both would copy the text into memory.
    return _docstore_from_table(spec, ds.data.table if hasattr(ds.data, "table") else ds.data, f, renderer)


def _merge(spec: SourceSpec, files: tuple, parts: list[DocStore]) -> DocStore:
    """One DocStore of the files' documents, in file order (their chunks side by side)."""
    if len(parts) == 1:
        store = parts[0]
    else:
        offsets = np.cumsum([0] + [len(p.chunks) for p in parts])
        notes = [p.note for p in parts if p.note]
        note = notes[0] + (f" (and {len(notes) - 1} more file(s) like it)" if len(notes) > 1 else "") if notes else ""
        store = DocStore(
            name=spec.name, kind="text", chunks=[c for p in parts for c in p.chunks],
            chunk=np.concatenate([p.chunk + o for p, o in zip(parts, offsets)]).astype(np.int32),
            start=np.concatenate([p.start for p in parts]), end=np.concatenate([p.end for p in parts]),
            bad_records=sum(p.bad_records for p in parts), empty_records=sum(p.empty_records for p in parts),
            first_bad=next((p.first_bad for p in parts if p.first_bad), ""), note=note)
        if is_sft(spec):  # the records' spans and origins, side by side as their documents
            ptrs, bounds, base = [np.zeros(1, np.int64)], [], 0
            for p in parts:
                if p.spans is not None:
                    ptrs.append(p.spans[0][1:] + base)
                    bounds.append(p.spans[1])
                    base += len(p.spans[1])
            store.spans = (np.concatenate(ptrs), np.concatenate(bounds) if bounds else np.zeros((0, 2), np.int64))
            store.records = np.concatenate([p.records for p in parts if p.records is not None]
                                           or [np.zeros(0, np.int64)])
            store.record_file = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(parts)])
    store.files = tuple(files)
    if len(store) == 0:
        what = str(files[0]) if len(files) == 1 else f"its {len(files)} files ({spec.location()})"
        why = f" ({store.bad_records} bad records skipped, first: {store.first_bad})" if store.bad_records else ""
        raise DataError(f"{spec.where()}: {what} holds no documents{why}")
    return store


def _open_bytes(p: Path):
    """A binary file object of the file's content, decompressed (x.jsonl.gz) by fsspec."""
    import fsspec

    return fsspec.open(str(p), "rb", compression="infer").open()


def _non_utf8_lines(p: Path) -> list[tuple[int, int, int]]:
    """(line number, start, end) of every line that is not valid UTF-8 (in the decompressed bytes).
    Read in blocks: memory stays flat however large the file; lines are looked at only on failure."""
    import codecs

    with _open_bytes(p) as f:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            while block := f.read(1 << 24):
                decoder.decode(block)
            decoder.decode(b"", final=True)
            return []
        except UnicodeDecodeError:
            pass
    out, start = [], 0
    with _open_bytes(p) as f:
        for lineno, line in enumerate(f, 1):
            body = line[:-1] if line.endswith(b"\n") else line
            try:
                body.decode("utf-8")
            except UnicodeDecodeError:
                out.append((lineno, start, start + len(body)))
            start += len(line)
    return out


def _jsonl_without(spec: SourceSpec, p: Path, bad_lines, renderer=None) -> DocStore:
    """`datasets` would silently replace invalid bytes: apply the bad-record policy instead.
    (Rare: only a file with such lines comes here, and it is parsed in memory.)"""
    import io

    import pyarrow.json as pj

    bad = BadRecords(spec, str(p))
    for lineno, _, _ in bad_lines:
        bad(f"line {lineno}", "not valid UTF-8")
    with _open_bytes(p) as f:
        raw = f.read()
    keep, pos = [], 0
    for _, a, b in bad_lines:
        keep.append(raw[pos:a])
        pos = b + 1
    keep.append(raw[pos:])
    try:
        table = pj.read_json(io.BytesIO(b"".join(keep)))
    except Exception as e:
        raise DataError(f"{spec.where()}: cannot read {p}: {_first_line(e)}") from None
    store = _docstore_from_table(spec, table, str(p), renderer)
    store.bad_records += bad.count
    store.first_bad = bad.first
    return store


def _locate_jsonl_problem(p: Path) -> str | None:
    """On a failed json load, find the first bad line ourselves so the message can name it."""
    if file_format(p.name) != "json" or not p.is_file():
        return None
    single = p.name.lower().split(".")[-1] == "json"  # one JSON document, not json lines
    try:
        with _open_bytes(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"line {lineno}: not valid UTF-8 (byte {e.start})"
                try:
                    json.loads(text)
                except json.JSONDecodeError as e:
                    if lineno == 1 and single:
                        return None
                    return f"line {lineno}: invalid JSON ({e.msg})"
    except OSError as e:  # a corrupt .gz
        return _first_line(e)
    return None


def _text_column(spec: SourceSpec, table, bad: BadRecords, file: str):
    """The document text of every record of one file's table, as an Arrow string column:
    `text_field` itself (zero-copy), or `template` rendered. The place to add a record kind."""
    import pyarrow as pa

    if spec.template is not None:
        return render_template_column(spec, table, bad)
    if spec.text_field not in table.column_names:
        raise DataError(f"{spec.where()}: {file} has no field {spec.text_field!r}"
                        f" (fields: {', '.join(table.column_names)})")
    column = table.column(spec.text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{spec.where()}: {file} field {spec.text_field!r} holds {column.type}, not text")
    return column


def _docstore_from_table(spec: SourceSpec, table, file: str, renderer=None) -> DocStore:
    import pyarrow as pa

    bad = BadRecords(spec, file)
    if is_sft(spec):
        return _sft_docstore(spec, table, file, bad, renderer or ChatRenderer())
    column = _text_column(spec, table, bad, file)
    chunks, chunk_ids, starts, ends, base = [], [], [], [], 0
    for arr in column.chunks:
        n = len(arr)
        if n == 0:
            continue
        off_type = np.int64 if pa.types.is_large_string(arr.type) else np.int32
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, off_type)[arr.offset: arr.offset + n + 1].astype(np.int64)
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        keep = np.ones(n, bool)
        if arr.null_count:
            nulls = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))
            if spec.template is None:  # a template's failures were reported (and counted) as it rendered
                for j in nulls[:1] if spec.bad_records == "stop" else nulls:
                    bad(f"record {base + int(j) + 1}", f"no {spec.text_field!r} value")
            keep[nulls] = False
        lengths = offsets[1:] - offsets[:-1]
        keep &= lengths > 0
        idx = np.flatnonzero(keep)
        chunks.append(data)
        chunk_ids.append(np.full(len(idx), len(chunks) - 1, np.int32))
        starts.append(offsets[:-1][idx])
        ends.append(offsets[1:][idx])
        base += n
    empty = base - int(sum(c.null_count for c in column.chunks)) - sum(len(s) for s in starts)
    return _finish(spec, file, "text", chunks, chunk_ids, starts, ends, bad, empty)


def _sft_docstore(spec: SourceSpec, table, file: str, bad: BadRecords, renderer: ChatRenderer) -> DocStore:
    """One file's SFT records rendered (zerotrain.dataio.sft.render_record): their text in one in-memory chunk,
    their response spans, their record numbers. A bad record is named by its line in json lines."""
    texts, spans, numbers, n = [], [], [], 0
    for field in ((spec.prompt_field, spec.response_field) if spec.format == "sft" else (spec.messages_field,)):
        if field not in table.column_names:
            raise DataError(f"{spec.where()}: {file} has no field {field!r} (fields: {', '.join(table.column_names)};"
                            f" format {spec.format})")

    def on_bad(why: str, i: int) -> None:
        # The line is looked up (a read of the file) only for a message that will be shown.
        shown = spec.bad_records == "stop" or bad.count == 0
        bad(record_label(file, i) if shown else f"record {i}", why)

    for batch in table.to_batches(max_chunksize=RENDER_BATCH):
        for record in batch.to_pylist():
            n += 1
            out = render_record(spec, record, renderer, lambda why, i=n: on_bad(why, i))
            if out is not None:
                texts.append(out[0].encode("utf-8"))
                spans.append(out[1])
                numbers.append(n)
    lengths = np.fromiter((len(t) for t in texts), np.int64, len(texts))
    end = np.cumsum(lengths)
    store = _finish(spec, file, "text", [np.frombuffer(b"".join(texts), np.uint8)] if texts else [],
                    [np.zeros(len(texts), np.int32)], [end - lengths], [end], bad, 0)
    counts = np.fromiter((len(s) for s in spans), np.int64, len(spans))
    store.spans = (np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                   np.concatenate(spans) if spans else np.zeros((0, 2), np.int64))
    store.records = np.asarray(numbers, np.int64)
    store.record_file = np.zeros(len(texts), np.int32)
    return store


def record_label(file: str, i: int) -> str:
    """How to name record i (from 1) of a file: "line N" in json lines (blank lines skipped, as the
    reader skips them), else "record i"."""
    if file_format(file) != "json" or not os.path.isfile(file):
        return f"record {i}"
    try:
        with _open_bytes(Path(file)) as f:
            seen = 0
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    if seen == 0 and line.lstrip().startswith(b"["):
                        break  # one JSON array, not json lines: its lines are not its records
                    seen += 1
                    if seen == i:
                        return f"line {lineno}"
    except OSError:
        pass
    return f"record {i}"


def record_where(store: DocStore, d: int) -> str:
    """ "FILE line N" for document d of an SFT store of rendered records."""
    file = store.files[int(store.record_file[d])] if store.record_file is not None else store.name
    return f"{file} {record_label(str(file), int(store.records[d]))}" if store.records is not None else str(file)


RENDER_BATCH = 8192  # records rendered per batch: a template source is not held as Python objects at once


def render_template_column(spec: SourceSpec, table, bad: BadRecords):
    """`template` rendered for every record (small instruction/QA sets: the rendered text is held
    in memory; the records are turned into Python dicts a batch at a time)."""
    import pyarrow as pa

    out, n = [], 0
    for batch in table.to_batches(max_chunksize=RENDER_BATCH):
        texts = []
        for record in batch.to_pylist():
            n += 1
            texts.append(render_template(spec, record, lambda why, i=n: bad(f"record {i}", why)))
        out.append(pa.array(texts, type=pa.large_string()))
    return pa.chunked_array(out, type=pa.large_string())


def render_template(spec: SourceSpec, record: dict, on_bad) -> str | None:
    try:
        return spec.template.format_map(record)
    except (KeyError, IndexError) as e:
        on_bad(f"template field {e.args[0]!r} missing")
    except (ValueError, TypeError, AttributeError) as e:
        on_bad(f"template cannot be rendered ({_first_line(e)})")
    return None


def _load_txt(spec: SourceSpec, p: Path) -> DocStore:
    """Our own reader: memory-mapped, split with a C regex, UTF-8 checked in blocks; the document
    bounds are kept as 8-byte integers (not Python objects), so memory stays ~16 bytes a document."""
    import mmap
    from array import array

    bad = BadRecords(spec, str(p))
    try:
        with open(p, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if p.stat().st_size else b""
    except OSError as e:
        raise DataError(f"{spec.where()}: cannot read {p}: {e.strerror}") from None
    sep = {"paragraph": rb"\n(?:[ \t\r]*\n)+", "line": rb"\r?\n", "document": None}[spec.sample_by]
    starts_a, ends_a = array("q", [0]), array("q")
    if sep is not None:
        for m in re.finditer(sep, raw):
            ends_a.append(m.start())
            starts_a.append(m.end())
    end = len(raw)
    while sep is not None and end > starts_a[-1] and raw[end - 1:end] in (b"\n", b"\r"):
        end -= 1  # the file's final newline is no text
    ends_a.append(end)
    starts, ends = np.frombuffer(starts_a, np.int64), np.frombuffer(ends_a, np.int64)
    keep = ends > starts
    # Whitespace-only pieces (e.g. a trailing newline) are not documents.
    for j in np.flatnonzero(keep & (ends - starts < 8)):
        if not raw[starts[j]:ends[j]].strip():
            keep[j] = False
    data = np.frombuffer(raw, np.uint8) if len(raw) else np.zeros(0, np.uint8)
    pos = 0
    while (at := _first_invalid_utf8(raw, pos)) is not None:  # only on failure find the offending document
        j = min(int(np.searchsorted(ends, at, side="right")), len(ends) - 1)
        what = {"paragraph": "paragraph", "line": "line", "document": "document"}[spec.sample_by]
        line = raw[:at].count(b"\n") + 1
        bad(f"{what} {j + 1} (line {line})", f"not valid UTF-8 (byte {at})")
        keep[j] = False
        pos = max(int(ends[j]), at + 1)
    idx = np.flatnonzero(keep)
    store = _finish(spec, str(p), "text", [data], [np.zeros(len(idx), np.int32)], [starts[idx]], [ends[idx]], bad, 0)
    if len(store) < FEW_DOCUMENTS:
        store.note = _few_documents_note(spec, p, data, len(store))
    return store


UTF8_BLOCK = 1 << 24  # bytes decoded at a time when checking a .txt file


def _first_invalid_utf8(raw, pos: int) -> int | None:
    """The offset of the first byte at or after `pos` that is not valid UTF-8, or None; decoded a
    block at a time (a whole-file decode would hold the file twice more in memory)."""
    import codecs

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


FEW_DOCUMENTS = 10  # a .txt file that yields fewer is named in the summary, with a sample_by hint


def _few_documents_note(spec: SourceSpec, p: Path, data: np.ndarray, n: int) -> str:
    """e.g. "b.txt: 1 document (sample_by paragraph: no blank lines found); use sample_by line? (3,000 lines)"."""
    note = f"{p.name}: {n} document{'' if n == 1 else 's'} (sample_by {spec.sample_by}"
    if spec.sample_by != "paragraph":
        return note + ")"
    note += ": no blank lines found)" if n == 1 else ")"
    step = 1 << 26  # count newlines in slices: a whole-file comparison would allocate the file's size again
    lines = sum(int(np.count_nonzero(data[i:i + step] == 10)) for i in range(0, len(data), step))
    lines += bool(len(data)) and data[-1] != 10  # a last line without its newline
    return note + (f"; use sample_by line? ({lines:,} lines)" if lines > n else "")


def _finish(spec, file, kind, chunks, chunk_ids, starts, ends, bad: BadRecords, empty: int) -> DocStore:
    """One file's DocStore (possibly empty: _merge decides whether the source has documents)."""
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt))
    return DocStore(name=spec.name, kind=kind, chunks=chunks, chunk=cat(chunk_ids, np.int32),
                    start=cat(starts, np.int64), end=cat(ends, np.int64), bad_records=bad.count,
                    first_bad=bad.first, empty_records=empty, files=(file,))


# --------------------------------------------------------------------------------------------
# Pieces: long documents cut before the split across ranks (see the module docstring)
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Streamed sources (hub datasets, or local files with "streaming": true)
# --------------------------------------------------------------------------------------------

def open_streamed(spec: SourceSpec, rank: int, world: int):
    """This rank's part of a streamed source as a `datasets.IterableDataset` (nothing read yet)."""
    datasets = _quiet_datasets()
    from datasets.distributed import split_dataset_by_node

    what = spec.location()
    try:
        if spec.hf is not None:
            where = spec.hf
            if spec.local_hf:
                found = _dataset_dir_files(spec)  # checks the split; names the builder
                if found.fmt in ("text", SAVED):
                    raise DataError(f"{spec.where()}: streaming applies to jsonl/parquet/arrow data files and hub"
                                    f" datasets, not to {'.txt files' if found.fmt == 'text' else 'save_to_disk'}")
            else:
                where = hub_location(spec.hf)
                what = f"hub dataset {spec.hf!r}" + (f" (local snapshot {where})" if where != spec.hf else "")
            args = dataset_dir_args(where, spec) if os.path.isdir(where) else {
                "data_dir": spec.data_dir, "data_files": spec.data_files}
            ds = datasets.load_dataset(where, spec.config, split=spec.split, streaming=True, **args)
        else:
            found = find_files(spec)
            if found.fmt in ("text", SAVED):
                raise DataError(f"{spec.where()}: streaming applies to jsonl/parquet/arrow data files and hub"
                                f" datasets, not to {'.txt files' if found.fmt == 'text' else 'save_to_disk'}")
            # The files in our sorted order; datasets gives each rank whole files when their number
            # divides by the ranks, else every rank reads all and keeps its share of the records.
            ds = datasets.load_dataset(found.fmt, data_files=list(found.files), split="train", streaming=True)
    except DataError:
        raise
    except Exception as e:
        hint = ""
        if spec.hf is not None and not spec.local_hf and datasets.config.HF_HUB_OFFLINE:
            hint = (f"; offline, it must be in the local Hugging Face cache: `huggingface-cli download --repo-type"
                    f" dataset {spec.hf}` on a machine with network (or point hf at a downloaded directory)")
        raise DataError(f"{spec.where()}: cannot open {what} for streaming: {_first_line(e)}{hint}") from None
    return split_dataset_by_node(ds, rank=rank, world_size=world) if world > 1 else ds


def hub_location(name: str) -> str:
    """Where a hub dataset is read from: offline (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1), its
    snapshot in the Hugging Face hub cache when one is there (`huggingface-cli download`; datasets
    by itself, offline, looks only in its own Arrow cache); otherwise the name itself (datasets
    streams it from the hub, or offline from its Arrow cache of an earlier load_dataset)."""
    datasets = _quiet_datasets()
    if not datasets.config.HF_HUB_OFFLINE:
        return name
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the hub cache: datasets' own cache may still have it
        return name


def record_text(spec: SourceSpec, record: dict, on_bad) -> str | None:
    """The document text of one streamed record, or None (after on_bad) when it has none. An SFT
    record's rendered text (the plain chat template: for tokenizer training; training itself
    renders streamed SFT records with zerotrain.dataio.sft.stream_block)."""
    if is_sft(spec):
        from zerotrain.dataio.sft import record_text as sft_text

        return sft_text(spec, record, on_bad)
    if spec.template is not None:
        return render_template(spec, record, on_bad)
    text = record.get(spec.text_field)
    if text is None:
        on_bad(f"no {spec.text_field!r} value")
        return None
    if not isinstance(text, str):
        on_bad(f"{spec.text_field!r} is {type(text).__name__}, not text")
        return None
    return text
