"""Mix files and the sources they name, loaded through Hugging Face `datasets`.

A mix file is JSON:
    {"sources": [{"name": "web", "path": "data/web.jsonl", "weight": 0.7},
                 {"name": "code", "path": "data/code.txt", "weight": 0.3}]}
Each source has either `path` (a local jsonl / json / txt / parquet / arrow file) or `hf`
(a hub dataset name, with optional `config`, `split`); `text_field` defaults to "text".
Text files are split into documents by blank lines (`sample_by`: "paragraph", the default),
by line ("line") or taken whole ("document"). Relative paths resolve against the mix file.
Weights are shares of tokens; they need not sum to 1 (they are normalised).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dataio.errors import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".arrow": "arrow"}
SOURCE_KEYS = {"name", "path", "hf", "config", "split", "text_field", "weight", "sample_by"}


@dataclass(frozen=True)
class SourceSpec:
    name: str
    weight: float
    path: str | None = None
    hf: str | None = None
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    sample_by: str = "paragraph"
    extra: dict = field(default_factory=dict)


def parse_mix(mix_path: str | Path) -> list[SourceSpec]:
    """Read and validate a mix file; every problem is a DataError naming the file and the source."""
    mix_path = Path(mix_path)
    where = f"mix {mix_path}"
    if not mix_path.is_file():
        raise DataError(f"{where}: no such file")
    try:
        raw = json.loads(mix_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or not raw["sources"]:
        raise DataError(f"{where}: expected an object with a non-empty 'sources' list")
    specs, names = [], set()
    for i, src in enumerate(raw["sources"]):
        if not isinstance(src, dict):
            raise DataError(f"{where}: source #{i} is not an object")
        name = src.get("name", f"#{i}")
        at = f"{where}: source {name!r}"
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
            raise DataError(f"{at}: give exactly one of 'path' (local file) or 'hf' (hub dataset)")
        path = None
        if "path" in src:
            p = Path(src["path"])
            p = p if p.is_absolute() else mix_path.parent / p
            if not p.exists():
                raise DataError(f"{at}: data file {p} does not exist")
            if p.is_file() and p.suffix not in BUILDERS:
                raise DataError(f"{at}: unsupported file type {p.suffix!r} (use {', '.join(BUILDERS)})")
            path = str(p)
        sample_by = src.get("sample_by", "paragraph")
        if sample_by not in ("paragraph", "line", "document"):
            raise DataError(f"{at}: sample_by must be paragraph, line or document, got {sample_by!r}")
        specs.append(SourceSpec(name=name, weight=float(w), path=path, hf=src.get("hf"), config=src.get("config"),
                                split=src.get("split", "train"), text_field=src.get("text_field", "text"),
                                sample_by=sample_by))
    return specs


def load_source(spec: SourceSpec):
    """The source as a map-style `datasets.Dataset` with random access (local files only here)."""
    import datasets

    datasets.disable_progress_bars()  # the driver shows one progress bar, the training one
    datasets.logging.set_verbosity_error()
    at = f"source {spec.name!r}"
    if spec.hf is not None:
        raise DataError(f"{at}: hub dataset {spec.hf!r} needs network access; prepare it locally first")
    p = Path(spec.path)
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[spec.split]
        else:
            kwargs = {"sample_by": spec.sample_by} if BUILDERS[p.suffix] == "text" else {}
            ds = datasets.load_dataset(BUILDERS[p.suffix], data_files=str(p), split="train", **kwargs)
    except DataError:
        raise
    except Exception as e:  # datasets wraps parser errors in many types; report the first line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{at}: cannot read {p}: {msg}") from None
    if spec.text_field not in ds.column_names:
        raise DataError(f"{at}: {p} has no field {spec.text_field!r} (fields: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise DataError(f"{at}: {p} holds no documents")
    return ds.select_columns([spec.text_field])
