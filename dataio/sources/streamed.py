"""Streamed sources: hub datasets, and local sources with `"streaming": true`, opened as this rank's part
of a `datasets.IterableDataset` (`open_streamed`), read in order through `records` (which closes what is left
open before the interpreter exits), never shuffled, size unknown; and the
text of one streamed record (`record_text`). Offline, a hub name is read from its snapshot in the
Hugging Face hub cache when one is there (`hub_location`).

Not here: what a mix may say (zerotrain.dataio.format.mix), local sources read whole into DocStores
(zerotrain.dataio.sources.readers, whose dataset-directory helpers this module shares), the position in a
stream and its state (StreamedSource, zerotrain.dataio.pipeline.cursors). `datasets` and `huggingface_hub` are
imported inside the functions that use them (seconds to import).
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import weakref

from zerotrain.dataio.format.errors import DataError, first_line
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.format.textbytes import WHITESPACE_CHARS
from zerotrain.dataio.sources.readers import (SAVED, SourceFiles, dataset_dir_args, dataset_dir_files, find_files,
                                      quiet_datasets, render_template)
from zerotrain.dataio.sources.sft import is_sft, text_value
from zerotrain.dataio.sources.sft import record_text as sft_record_text


def open_streamed(spec: SourceSpec, rank: int, world: int):
    """This rank's part of a streamed source as a `datasets.IterableDataset` (nothing read yet)."""
    datasets = quiet_datasets()
    from datasets.distributed import split_dataset_by_node

    what = spec.location()
    try:
        if spec.hf is not None:
            where = spec.hf
            if spec.local_hf:
                _check_streamable(spec, dataset_dir_files(spec))  # checks the split; names the builder
            else:
                where = hub_location(spec.hf)
                what = f"hub dataset {spec.hf!r}" + (f" (local snapshot {where})" if where != spec.hf else "")
            args = dataset_dir_args(where, spec) if os.path.isdir(where) else {
                "data_dir": spec.data_dir, "data_files": spec.data_files}
            ds = datasets.load_dataset(where, spec.config, split=spec.split, streaming=True, **args)
        else:
            found = find_files(spec)
            _check_streamable(spec, found)
            # The files in our sorted order; datasets gives each rank whole files when their number
            # divides by the ranks, else every rank reads all and keeps its share of the records.
            ds = datasets.load_dataset(found.fmt, data_files=list(found.files), split="train", streaming=True)
    except DataError:
        raise
    except Exception as e:
        hint = ""
        if spec.hf is not None and not spec.local_hf and datasets.config.HF_HUB_OFFLINE:
            hint = (f"; offline, it must be in the local Hugging Face cache: `hf download --repo-type"
                    f" dataset {spec.hf}` on a machine with network (or point hf at a downloaded directory)")
        raise DataError(f"{spec.where()}: cannot open {what} for streaming: {first_line(e)}{hint}") from None
    return split_dataset_by_node(ds, rank=rank, world_size=world) if world > 1 else ds


# Every stream being read, closed before the interpreter tears pyarrow down: a parquet stream left
# half-read (a run stops mid-epoch) or in a reference cycle is otherwise finalised during the last
# garbage collection, after Arrow's C++ runtime is gone, and the process aborts ("terminate called without
# an active exception", exit -6) once its work is done (apache/arrow#45214, huggingface/datasets#7566).
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKED = []  # the atexit hook, once registered


def _close_streams() -> None:
    for it in list(_LIVE):
        it.close()
    gc.collect()


def records(ds):
    """The records of a streamed source (from `open_streamed`), in order: iterate with this, not `iter(ds)`,
    so that the stream is closed at exit while pyarrow still stands."""
    if not _HOOKED:  # registered after datasets' import: atexit runs it before pyarrow's own hooks
        _HOOKED.append(atexit.register(_close_streams))
    it = _read(ds)
    _LIVE.add(it)
    return it


def _read(ds):
    yield from ds


def _check_streamable(spec: SourceSpec, found: SourceFiles) -> None:
    """datasets streams data files and hub datasets; .txt (our own reader) and save_to_disk are not streamed."""
    if found.fmt in ("text", SAVED):
        raise DataError(f"{spec.where()}: streaming applies to jsonl/parquet/arrow data files and hub"
                        f" datasets, not to {'.txt files' if found.fmt == 'text' else 'save_to_disk'}")


def hub_location(name: str) -> str:
    """Where a hub dataset is read from: offline (HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1), its
    snapshot in the Hugging Face hub cache when one is there (`hf download`; datasets
    by itself, offline, looks only in its own Arrow cache); otherwise the name itself (datasets
    streams it from the hub, or offline from its Arrow cache of an earlier load_dataset)."""
    datasets = quiet_datasets()
    if not datasets.config.HF_HUB_OFFLINE:
        return name
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the hub cache: datasets' own cache may still have it
        return name


def bad_record(spec: SourceSpec, why: str, record=None) -> str:
    """The line for a bad streamed record. A stream has no line numbers to give: the record (when at hand) is named
    by its first 80 characters of JSON, on one line, enough to find it with grep."""
    if record is None:
        return f"{spec.where()}: streamed record: {why}"
    text = json.dumps(record, ensure_ascii=False, default=str)
    return f"{spec.where()}: streamed record {text if len(text) <= 80 else text[:77] + '...'}: {why}"


def no_text(text: str | None) -> bool:
    """A streamed record's text that makes no document: none, empty, or ASCII whitespace alone (what
    textbytes.blank drops from a local source, so a source streamed or read gives the same documents)."""
    return not text or not text.strip(WHITESPACE_CHARS)


def record_text(spec: SourceSpec, record: dict, on_bad) -> str | None:
    """The document text of one streamed record, or None (after on_bad) when it has none. An SFT
    record's rendered text (the plain chat template: for tokenizer training; training itself
    renders streamed SFT records with zerotrain.dataio.sources.sft.stream_block)."""
    if is_sft(spec):
        return sft_record_text(spec, record, on_bad)
    if spec.template is not None:
        return render_template(spec, record, on_bad)
    return text_value(record, spec.text_field, on_bad)
