"""Local mix sources read into DocStores: a source's files found (`find_files`, by datasets' own resolver)
and each file read (`load_text_source`): parquet, arrow and json lines through `datasets`' Arrow readers,
.txt through our own memory-mapped reader, SFT records rendered; bad records per the source's policy.
Also the dataset-directory helpers the streamed path shares (`dataset_dir_files`, `dataset_dir_args`,
`quiet_datasets`), and `render_template`.

The layers, for whoever adds a record kind: `find_files` (a local source's files, by datasets) ->
`load_text_source` (each file's Arrow table -> `_docstore_from_table`, which turns records into
document text: `text_field` or `template`) -> one DocStore per source. SFT records branch off in
`_docstore_from_table` (`_sft_docstore`: text + response spans) and `zerotrain.dataio.pipeline.loader.load_data`
tokenizes them with their mask (`zerotrain.dataio.sources.sft.tokenize_store`). Loading never unpickles.

Not here: what a mix file may say (zerotrain.dataio.format.mix), hub and streamed sources
(zerotrain.dataio.sources.streamed), cutting documents into pieces (zerotrain.dataio.format.pieces). `datasets`,
`pyarrow`, `fsspec` and `huggingface_hub` are imported inside the functions that use them: they
take seconds to import, and parsing a mix or printing a summary needs none of them.
"""
from __future__ import annotations

import codecs
import io
import json
import mmap
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerotrain.dataio.format.docstore import DocStore
from zerotrain.dataio.format.errors import DataError, DataNotHere, first_line
from zerotrain.dataio.format.mix import BUILDERS, COMPRESSED, SourceSpec, file_format, has_glob
from zerotrain.dataio.format.textbytes import blank, first_invalid_utf8
from zerotrain.dataio.format.tokenfile import load_token_file
from zerotrain.dataio.sources.sft import ChatRenderer, is_sft, render_record

# Files a directory or glob is searched for: datasets' tabular and text formats. Anything else
# (README.md, LICENSE, images) is not data and is skipped, as load_dataset(DIR) skips it; a .csv
# next to parquet shards is found, so it is refused as a second format rather than dropped.
DATA_EXTENSIONS = [".arrow", ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".parquet", ".txt", ".xml", ".lance"]
SAVED = "save_to_disk"  # the "format" of a directory written by datasets' save_to_disk


def quiet_datasets():
    """`datasets`, imported (lazily: it takes seconds) and set up to read local files quietly."""
    import datasets

    datasets.disable_progress_bars()  # the driver shows one progress bar, the training one
    # its errors too: a file it cannot parse is logged ("Failed to load JSON from file ...") before it raises, and
    # what raises is said once, in our line naming the source and the record
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    # datasets 5.x pings the hub to count downloads on every local load_dataset (a 3 s timeout per file on
    # a node whose requests hang); local files are not downloads.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    return datasets


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
        return dataset_dir_files(spec)
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
    """One `path` entry as files: itself, a glob's matches, or a directory's data files. datasets is imported
    only for a glob or a directory: a plain file's path needs none of it (a .txt source is then read without it;
    its import costs a rank ~0.45 s)."""
    if has_glob(entry):
        from datasets.data_files import resolve_pattern

        try:  # datasets' own globbing (fsspec; `**` for any depth; hidden files skipped)
            return resolve_pattern(entry, base_path="", allowed_extensions=DATA_EXTENSIONS)
        except FileNotFoundError:
            raise DataNotHere(f"{spec.where()}: path {entry} matches no data file") from None
    p = Path(entry)
    if not p.exists():
        raise DataNotHere(f"{spec.where()}: data file {p} does not exist")
    if p.is_file() or _saved_dataset(p):
        return [entry]
    # A directory of data files: the files load_dataset(DIR) takes for the split (datasets' naming
    # conventions tell splits apart: train-*.parquet, test/, ...; without them every file is "train").
    from datasets.data_files import DataFilesList, get_data_patterns

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


def dataset_dir_files(spec: SourceSpec) -> SourceFiles:
    """An `hf` directory: the split's files as load_dataset(DIR, config, data_dir=, data_files=) sees them."""
    d = Path(spec.hf)
    if _saved_dataset(d):
        return SourceFiles((spec.hf,), SAVED)
    datasets = quiet_datasets()
    try:
        builder = datasets.load_dataset_builder(spec.hf, spec.config, **dataset_dir_args(spec.hf, spec))
    except Exception as e:  # no data files, an unknown config, a bad data_dir: datasets' own words
        raise DataError(f"{spec.where()}: cannot open {spec.hf}: {first_line(e)}") from None
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
    `hf download --include 'sample/10BT/*' --include README.md` leaves it) would
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
# A local source's documents, file by file
# --------------------------------------------------------------------------------------------

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


def load_text_source(spec: SourceSpec, tokenizer=None) -> DocStore:
    """All documents of a local (not streamed) source, file by file, validated; bad records per the
    policy. Errors name the file (one line). An SFT source's records are rendered (chats with the
    tokenizer's chat template, or the plain one without a tokenizer) and keep their response spans. A flat
    token file (format tokens) is memory-mapped as it is (zerotrain.dataio.format.tokenfile; with a tokenizer, its ids
    are checked against it)."""
    if spec.format == "tokens":
        return load_token_file(spec, tokenizer)
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
    datasets = quiet_datasets()
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
        raise DataError(f"{spec.where()}: cannot read {p}: {_locate_jsonl_problem(p) or first_line(e)}") from None
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
        raise DataError(f"{spec.where()}: cannot read {p}: {first_line(e)}") from None
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
        return first_line(e)
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
        keep[keep] = ~blank(data, offsets[:-1][keep], offsets[1:][keep])  # whitespace only: no document either
        idx = np.flatnonzero(keep)
        chunks.append(data)
        chunk_ids.append(np.full(len(idx), len(chunks) - 1, np.int32))
        starts.append(offsets[:-1][idx])
        ends.append(offsets[1:][idx])
        base += n
    empty = base - int(sum(c.null_count for c in column.chunks)) - sum(len(s) for s in starts)
    return _finish(spec, file, "text", chunks, chunk_ids, starts, ends, bad, empty)


def _sft_docstore(spec: SourceSpec, table, file: str, bad: BadRecords, renderer: ChatRenderer) -> DocStore:
    """One file's SFT records rendered (zerotrain.dataio.sources.sft.render_record): their text in one in-memory chunk,
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

    records = record_reader(table.schema)
    for batch in table.to_batches(max_chunksize=RENDER_BATCH):
        for record in records(batch):
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


def record_reader(schema):
    """batch -> the batch's records as Python dicts, as `datasets` gives its rows, for tables of `schema` (the
    features read once per table). A field whose records hold values of more than one type (an answer a string in
    one record and a number in the next; chat messages with a key only some have) is stored by `datasets` as its
    Json feature: Arrow's `arrow.json` extension, JSON text, which pyarrow's to_pylist leaves as text (a template
    rendered '"Paris"' with its quotes; a message a string, not an object). Such columns are decoded by the
    features' own `decode_batch`; others are read as they are."""
    from datasets import Features
    from datasets.features.features import require_decoding

    features = Features.from_arrow_schema(schema)
    if not any(require_decoding(f) for f in features.values()):
        return lambda batch: batch.to_pylist()

    def decoded(batch) -> list[dict]:
        columns = features.decode_batch(batch.to_pydict())
        return [dict(zip(columns, values)) for values in zip(*columns.values())]
    return decoded


RENDER_BATCH = 8192  # records rendered per batch: a template source is not held as Python objects at once


def render_template_column(spec: SourceSpec, table, bad: BadRecords):
    """`template` rendered for every record (small instruction/QA sets: the rendered text is held
    in memory; the records are turned into Python dicts a batch at a time)."""
    import pyarrow as pa

    out, n = [], 0
    records = record_reader(table.schema)
    for batch in table.to_batches(max_chunksize=RENDER_BATCH):
        texts = []
        for record in records(batch):
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
        on_bad(f"template cannot be rendered ({first_line(e)})")
    return None


def _load_txt(spec: SourceSpec, p: Path) -> DocStore:
    """Our own reader: memory-mapped, split with a C regex, UTF-8 checked in blocks; the document
    bounds are kept as 8-byte integers (not Python objects), so memory stays ~16 bytes a document."""
    bad = BadRecords(spec, str(p))
    try:
        with open(p, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if p.stat().st_size else b""
    except OSError as e:
        raise DataError(f"{spec.where()}: cannot read {p}: {e.strerror}") from None
    # a CRLF file's paragraph ends before its \r, as a line does
    sep = {"paragraph": rb"\r?\n(?:[ \t\r]*\n)+", "line": rb"\r?\n", "document": None}[spec.sample_by]
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
    data = np.frombuffer(raw, np.uint8) if len(raw) else np.zeros(0, np.uint8)
    keep[keep] = ~blank(data, starts[keep], ends[keep])  # whitespace-only pieces (a line of spaces) are no documents
    pos = 0
    while (at := first_invalid_utf8(raw, pos)) is not None:  # only on failure find the offending document
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
