"""Mix files and the sources they name: parsing, validation, and loading documents as byte buffers.

A mix file is JSON (examples in dataio/mixes/):

    {"description": "...",                  optional
     "on_exhausted": "restart",             restart | stop   (default restart; per source too)
     "bad_records": "stop",                 stop | skip      (default stop; per source too)
     "warn_epochs": 4,                      warn before training when a source would repeat more
     "sources": [
       {"name": "web",  "weight": 0.7, "path": "data/web.jsonl"},
       {"name": "code", "weight": 0.3, "path": "data/code.txt", "sample_by": "paragraph"},
       {"name": "edu",  "weight": 0.5, "hf": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT"},
       {"name": "qa",   "weight": 0.1, "hf": "GBaker/MedQA-USMLE-4-options",
        "template": "Question: {question}\\nAnswer: {answer}"}]}

A source has exactly one of `path` (a local .jsonl / .json / .parquet / .arrow / .txt file, or a
directory written by `datasets.save_to_disk`) or `hf` (a hub dataset, always streamed with
`datasets` `streaming=True`; optional `config`, `split`). Documents are the `text_field` column
("text" by default), or `template` rendered with `str.format_map` on each record. Relative paths
resolve against the mix file. `"streaming": true` reads a local file through the same streaming
path as a hub dataset (no random access, no shuffling).

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

Weights are shares of TOKENS (not documents); they need not sum to 1. See dataio.loader.

Loading never unpickles: local files go through `datasets`' Arrow readers or our own text
reader, and hub sources through `datasets` streaming.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dataio.errors import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".arrow": "arrow"}
SOURCE_KEYS = {"name", "path", "hf", "config", "split", "text_field", "template", "weight", "sample_by",
               "on_exhausted", "bad_records", "streaming"}
MIX_KEYS = {"description", "sources", "on_exhausted", "bad_records", "warn_epochs"}
ON_EXHAUSTED = ("restart", "stop")
BAD_RECORDS = ("stop", "skip")


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float  # normalised: the weights of a mix sum to 1
    path: str | None = None
    hf: str | None = None
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    template: str | None = None
    sample_by: str = "paragraph"
    on_exhausted: str = "restart"
    bad_records: str = "stop"
    streaming: bool = False

    @property
    def streamed(self) -> bool:
        return self.hf is not None or self.streaming

    def where(self) -> str:
        return f"source {self.name!r}"

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
            raise DataError(f"{at}: give exactly one of 'path' (local file or directory) or 'hf' (hub dataset)")
        for key in ("path", "hf", "config", "split", "text_field", "template"):
            if key in src and not (isinstance(src[key], str) and src[key]):
                raise DataError(f"{at}: {key} must be a non-empty string, got {src[key]!r}")
        if "template" in src and "text_field" in src:
            raise DataError(f"{at}: give text_field or template, not both")
        if "hf" in src and not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", src["hf"]):
            raise DataError(f"{at}: hf must be a hub dataset name like 'owner/name', got {src['hf']!r}")
        path = None
        if "path" in src:
            p = Path(src["path"])
            p = p if p.is_absolute() else mix_path.parent / p
            if not p.exists():
                raise DataError(f"{at}: data file {p} does not exist")
            if p.is_file() and p.suffix not in BUILDERS:
                raise DataError(f"{at}: unsupported file type {p.suffix!r} (use {', '.join(BUILDERS)})")
            path = str(p)
        sample_by = _choice(src.get("sample_by", "paragraph"), ("paragraph", "line", "document"), "sample_by", at)
        streaming = src.get("streaming", False)
        if not isinstance(streaming, bool):
            raise DataError(f"{at}: streaming must be true or false, got {streaming!r}")
        if streaming and path and Path(path).suffix == ".txt":
            raise DataError(f"{at}: streaming applies to jsonl/parquet/arrow/hub sources, not .txt")
        specs.append(SourceSpec(
            name=name, weight=float(w), path=path, hf=src.get("hf"), config=src.get("config"),
            split=src.get("split", "train"), text_field=src.get("text_field", "text"), template=src.get("template"),
            sample_by=sample_by, streaming=streaming,
            on_exhausted=_choice(src.get("on_exhausted", default_exhausted), ON_EXHAUSTED, "on_exhausted", at),
            bad_records=_choice(src.get("bad_records", default_bad), BAD_RECORDS, "bad_records", at)))
    total = sum(s.weight for s in specs)
    specs = tuple(SourceSpec(**{**s.to_dict(), "weight": s.weight / total}) for s in specs)
    return Mix(path=str(mix_path), sources=specs, warn_epochs=float(warn_epochs),
               description=raw.get("description", ""))


# --------------------------------------------------------------------------------------------
# Documents as byte buffers
# --------------------------------------------------------------------------------------------

@dataclass
class DocStore:
    """A source's documents, in their natural order: document d is `chunks[chunk[d]][start[d]:end[d]]`.

    `kind` is "text" (UTF-8 bytes) or "tokens" (token ids, from prepared shards). Chunks are
    numpy views of Arrow buffers, of the memory-mapped text file, or of memory-mapped shards:
    nothing is copied per document. After `make_pieces` the entries are pieces (each a document
    for the loader) and `whole_documents` / `whole_max` describe the documents they came from.
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


class BadRecords:
    """Counts bad records of one source and applies its policy (stop: DataError; skip: count)."""

    def __init__(self, spec: SourceSpec, file: str):
        self.spec, self.file, self.count, self.first = spec, file, 0, ""

    def __call__(self, record: str, why: str) -> None:
        msg = f"{self.spec.where()}: {self.file} {record}: {why}"
        if self.spec.bad_records == "stop":
            raise DataError(msg + " (set \"bad_records\": \"skip\" in the mix to skip and count such records)")
        self.count += 1
        self.first = self.first or f"{record}: {why}"


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()  # the driver shows one progress bar, the training one
    datasets.logging.set_verbosity_error()
    return datasets


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def load_text_source(spec: SourceSpec) -> DocStore:
    """All documents of a local (not streamed) source, validated; bad records per the policy."""
    p = Path(spec.path)
    if p.is_file() and p.stat().st_size == 0:
        raise DataError(f"{spec.where()}: {p} is empty: holds no documents")
    if p.suffix == ".txt":
        return _load_txt(spec, p)
    datasets = _quiet_datasets()
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if spec.split not in ds:
                    raise DataError(f"{spec.where()}: {p} has no split {spec.split!r} (splits: {', '.join(ds)})")
                ds = ds[spec.split]
        elif p.suffix in (".jsonl", ".json") and (bad_lines := _non_utf8_lines(p)):
            return _jsonl_without(spec, p, bad_lines)
        else:
            ds = datasets.load_dataset(BUILDERS[p.suffix], data_files=str(p), split="train")
    except DataError:
        raise
    except Exception as e:  # datasets wraps parser errors in many types
        raise DataError(f"{spec.where()}: cannot read {p}: {_locate_jsonl_problem(p) or _first_line(e)}") from None
    return _docstore_from_table(spec, ds.data.table if hasattr(ds.data, "table") else ds.data, str(p))


def _non_utf8_lines(p: Path) -> list[tuple[int, int, int]]:
    """(line number, start, end) of every line that is not valid UTF-8 (one C pass when none is)."""
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
        return []
    except UnicodeDecodeError:
        pass
    out, start = [], 0
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            out.append((lineno, start, start + len(line)))
        start += len(line) + 1
    return out


def _jsonl_without(spec: SourceSpec, p: Path, bad_lines) -> DocStore:
    """`datasets` would silently replace invalid bytes: apply the bad-record policy instead."""
    import io

    import pyarrow.json as pj

    bad = BadRecords(spec, str(p))
    for lineno, _, _ in bad_lines:
        bad(f"line {lineno}", "not valid UTF-8")
    raw, keep, pos = p.read_bytes(), [], 0
    for _, a, b in bad_lines:
        keep.append(raw[pos:a])
        pos = b + 1
    keep.append(raw[pos:])
    try:
        table = pj.read_json(io.BytesIO(b"".join(keep)))
    except Exception as e:
        raise DataError(f"{spec.where()}: cannot read {p}: {_first_line(e)}") from None
    store = _docstore_from_table(spec, table, str(p))
    store.bad_records += bad.count
    store.first_bad = bad.first
    return store


def _locate_jsonl_problem(p: Path) -> str | None:
    """On a failed json load, find the first bad line ourselves so the message can name it."""
    if p.suffix not in (".jsonl", ".json") or not p.is_file():
        return None
    with open(p, "rb") as f:
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
                if lineno == 1 and p.suffix == ".json":
                    return None  # a single JSON document, not jsonl
                return f"line {lineno}: invalid JSON ({e.msg})"
    return None


def _docstore_from_table(spec: SourceSpec, table, file: str) -> DocStore:
    import pyarrow as pa

    bad = BadRecords(spec, file)
    if spec.template is not None:
        column = render_template_column(spec, table, bad)
    else:
        if spec.text_field not in table.column_names:
            raise DataError(f"{spec.where()}: {file} has no field {spec.text_field!r}"
                            f" (fields: {', '.join(table.column_names)})")
        column = table.column(spec.text_field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise DataError(f"{spec.where()}: {file} field {spec.text_field!r} holds {column.type}, not text")
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
    empty = base - bad.count - sum(len(s) for s in starts)
    return _finish(spec, file, "text", chunks, chunk_ids, starts, ends, bad, empty)


def render_template_column(spec: SourceSpec, table, bad: BadRecords):
    """`template` rendered for every record (small instruction/QA sets: done once at load)."""
    import pyarrow as pa

    out = []
    for i, record in enumerate(table.to_pylist()):
        out.append(render_template(spec, record, lambda why: bad(f"record {i + 1}", why)))
    return pa.chunked_array([pa.array(out, type=pa.large_string())])


def render_template(spec: SourceSpec, record: dict, on_bad) -> str | None:
    try:
        return spec.template.format_map(record)
    except (KeyError, IndexError) as e:
        on_bad(f"template field {e.args[0]!r} missing")
    except (ValueError, TypeError, AttributeError) as e:
        on_bad(f"template cannot be rendered ({_first_line(e)})")
    return None


def _load_txt(spec: SourceSpec, p: Path) -> DocStore:
    """Our own reader: memory-mapped, split with a C regex, UTF-8 checked per document."""
    import mmap

    bad = BadRecords(spec, str(p))
    try:
        with open(p, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if p.stat().st_size else b""
    except OSError as e:
        raise DataError(f"{spec.where()}: cannot read {p}: {e.strerror}") from None
    sep = {"paragraph": rb"\n(?:[ \t\r]*\n)+", "line": rb"\r?\n", "document": None}[spec.sample_by]
    if sep is None:
        bounds = [(0, len(raw))]
    else:
        bounds, pos = [], 0
        for m in re.finditer(sep, raw):
            bounds.append((pos, m.start()))
            pos = m.end()
        end = len(raw)
        while end > pos and raw[end - 1:end] in (b"\n", b"\r"):  # the file's final newline is no text
            end -= 1
        bounds.append((pos, end))
    starts = np.fromiter((b[0] for b in bounds), np.int64, len(bounds))
    ends = np.fromiter((b[1] for b in bounds), np.int64, len(bounds))
    keep = ends > starts
    # Whitespace-only pieces (e.g. a trailing newline) are not documents.
    for j in np.flatnonzero(keep & (ends - starts < 8)):
        if not raw[starts[j]:ends[j]].strip():
            keep[j] = False
    # UTF-8: one C-speed pass over the whole file; only on failure find the offending document.
    data = np.frombuffer(raw, np.uint8) if len(raw) else np.zeros(0, np.uint8)
    pos = 0
    while pos < len(raw):
        try:
            bytes(raw[pos:]).decode("utf-8") if pos else _decode_all(raw)
            break
        except UnicodeDecodeError as e:
            at = pos + e.start
            j = int(np.searchsorted(ends, at, side="right"))
            j = min(j, len(bounds) - 1)
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


def _decode_all(raw) -> None:
    memoryview(raw).tobytes().decode("utf-8")


def _finish(spec, file, kind, chunks, chunk_ids, starts, ends, bad: BadRecords, empty: int) -> DocStore:
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt, copy=False) if parts else np.zeros(0, dt))
    store = DocStore(name=spec.name, kind=kind, chunks=chunks, chunk=cat(chunk_ids, np.int32),
                     start=cat(starts, np.int64), end=cat(ends, np.int64), bad_records=bad.count,
                     first_bad=bad.first, empty_records=empty)
    if len(store) == 0:
        why = f" ({bad.count} bad records skipped, first: {bad.first})" if bad.count else ""
        raise DataError(f"{spec.where()}: {file} holds no documents{why}")
    return store


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
                    whole_max=store.longest, cut_documents=int((counts > 1).sum()), piece_len=piece_len)


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

    try:
        if spec.hf is not None:
            ds = datasets.load_dataset(spec.hf, spec.config, split=spec.split, streaming=True)
        else:
            p = Path(spec.path)
            ds = datasets.load_dataset(BUILDERS[p.suffix], data_files=str(p), split="train", streaming=True)
    except Exception as e:
        what = f"hub dataset {spec.hf!r}" if spec.hf else spec.path
        raise DataError(f"{spec.where()}: cannot open {what} for streaming: {_first_line(e)}") from None
    return split_dataset_by_node(ds, rank=rank, world_size=world) if world > 1 else ds


def record_text(spec: SourceSpec, record: dict, on_bad) -> str | None:
    """The document text of one streamed record, or None (after on_bad) when it has none."""
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
