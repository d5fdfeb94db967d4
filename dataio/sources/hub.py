"""Hugging Face hub names, resolved the way `transformers` and `datasets` resolve them: through
`huggingface_hub`, so its cache (HF_HOME, HF_HUB_CACHE), its token (HF_TOKEN, or `hf auth login`) and
offline mode (HF_HUB_OFFLINE=1; for datasets also HF_DATASETS_OFFLINE=1) apply exactly as they do to
`AutoTokenizer.from_pretrained(name, revision=...)` and `load_dataset(name)`: offline only the cache is
read; online the revision is looked up on the hub and only the files missing from the cache are fetched.

    tokenizer_snapshot("org/name[@revision]")  -> (directory, "org/name@<commit>", how it was found)
    model_snapshot("org/name[@revision]")      -> the same for a model (`--init-from`, `model=`): config,
                                                  safetensors and tokenizer files only
    materialise(specs, fetch)                  -> the mix's sources, each `"download": true` one as its
                                                  local snapshot directory (downloaded once into the hub
                                                  cache, only its config's files); a hub source offline
                                                  with nothing cached is refused here, in one line
    hub_lines(specs, tokenizer)                -> what `--dry-run` says about every hub name: cached,
                                                  reachable, or (DataError) neither

A downloaded source is a local dataset directory from then on (zerotrain.dataio.sources.readers): counted,
held out, cut into pieces and re-split on another world size like local files. A streamed one is read
in order from the hub (zerotrain.dataio.sources.streamed): size unknown, no held-out documents, no epochs.

Not here: reading the files (readers, streamed), what a mix may say (mix). `huggingface_hub` and
`datasets` are imported inside the functions that use them (seconds to import).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

from zerotrain.dataio.format.errors import DataError, DataNotHere, first_line
from zerotrain.dataio.format.mix import SourceSpec
from zerotrain.dataio.sources.readers import dataset_dir_args, find_files, quiet_datasets
from zerotrain.dataio.sources.streamed import hub_location, open_streamed, records

# What AutoTokenizer.from_pretrained reads for a fast tokenizer; `zerotrain export` copies the same files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja")
# What `--init-from ORG/NAME` reads (modeling/hf.py): the config, safetensors weights (never *.bin pickles), the tokenizer.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               *TOKENIZER_FILES)
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_REVISION = re.compile(r"[\w./-]+")


def split_name(name: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) for a hub name `org/name[@revision]`, else None."""
    repo, at, revision = name.partition("@")
    if name.startswith((".", "/", "~")) or not _REPO.fullmatch(repo) or (at and not _REVISION.fullmatch(revision)):
        return None
    return repo, revision or None


def hub_offline(datasets: bool = False) -> bool:
    """huggingface_hub's offline mode (HF_HUB_OFFLINE); for datasets, also HF_DATASETS_OFFLINE."""
    if datasets:
        return bool(quiet_datasets().config.HF_HUB_OFFLINE)
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _cached_snapshot(repo: str, repo_type: str, revision: str | None, allow: list[str] | None) -> str | None:
    """The cached snapshot directory of `repo` at `revision` (refs/ resolved), or None. No network."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, repo_type=repo_type, revision=revision, allow_patterns=allow,
                                 local_files_only=True)
    except Exception:  # LocalEntryNotFoundError, or a malformed cache: not cached, as huggingface_hub sees it
        return None


def fetch_command(repo: str, repo_type: str = "model", revision: str | None = None,
                  files: tuple[str, ...] = MODEL_FILES) -> str:
    """The `hf download` command that puts what zerotrain reads of `repo` into the cache (patterns quoted: a shell
    would expand `*.safetensors` against the current directory)."""
    get = (f"hf download --repo-type dataset {repo}" if repo_type == "dataset" else
           f"hf download {repo} --include {' '.join(shlex.quote(f) for f in files)}")
    return get + (f" --revision {revision}" if revision else "")


def _problem(e: Exception, repo: str, repo_type: str, revision: str | None, offline: bool,
             files: tuple[str, ...] = TOKENIZER_FILES) -> str:
    """One line for huggingface_hub's refusal of `repo` (a model's: `files`, the patterns it needs)."""
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    get = fetch_command(repo, repo_type, revision, files)
    if isinstance(e, GatedRepoError):
        return "gated on the hub: accept its terms on its page and set HF_TOKEN (or `hf auth login`)"
    if isinstance(e, RevisionNotFoundError):
        return f"no revision {revision!r} on the hub"
    if isinstance(e, RepositoryNotFoundError):
        return (f"no {'dataset' if repo_type == 'dataset' else 'model'} repository of that name on the hub (a"
                " private one needs HF_TOKEN or `hf auth login`)")
    if isinstance(e, LocalEntryNotFoundError):
        if offline:
            return (f"not in the Hugging Face cache ({_cache_dir()}) and offline mode is on: `{get}` on a machine"
                    " with network into the same HF_HOME / HF_HUB_CACHE, or unset HF_HUB_OFFLINE")
        return f"the hub cannot be reached and it is not in the Hugging Face cache ({_cache_dir()})"
    return first_line(e)


# -- tokenizers ----------------------------------------------------------------------------------

def tokenizer_snapshot(name: str) -> tuple[Path, str, str]:
    """(directory holding tokenizer.json, "org/name@<commit>", how it was found) for a hub tokenizer.

    The name returned pins the commit: recorded in the run's config.json, it is what `zerotrain export`
    and a resume on another machine resolve again (offline too, from the same cache). DataError (one
    line) when it is neither cached nor reachable, or has no tokenizer.json (a slow-only tokenizer).
    """
    directory, pinned, how = _snapshot(name, "tokenizer", TOKENIZER_FILES)
    if not (directory / "tokenizer.json").is_file():
        raise DataError(f"tokenizer {name}: the hub repository has no tokenizer.json (a slow-only tokenizer:"
                        " save it with transformers' AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)"
                        " and pass --tokenizer DIR)")
    return directory, pinned, how


def _snapshot(name: str, what: str, files: tuple[str, ...]) -> tuple[Path, str, str]:
    """(snapshot directory of the model repository `name` holding `files`, "org/name@<commit>", how it was
    found): the cache, else (online) downloaded into it. DataError (one line, `what` NAME: ...)."""
    from huggingface_hub import snapshot_download

    repo, revision = split_name(name)
    offline = hub_offline()
    cached = _cached_snapshot(repo, "model", revision, list(files))
    try:
        directory = Path(snapshot_download(repo, revision=revision, allow_patterns=list(files)))
    except Exception as e:
        raise DataError(f"{what} {name}: {_problem(e, repo, 'model', revision, offline, files)}") from None
    how = (repo + (f"@{revision}" if revision else "") + f", commit {directory.name[:12]}, "
           + ("from the Hugging Face cache" if cached and Path(cached) == directory else "downloaded into the"
              " Hugging Face cache") + (" (offline)" if offline else "") + f": {directory}")
    return directory, f"{repo}@{directory.name}", how


# -- models ---------------------------------------------------------------------------------------

def model_snapshot(name: str) -> tuple[Path, str, str]:
    """(snapshot directory, "org/name@<commit>", how it was found) for a hub model `org/name[@revision]`, as
    `from_pretrained` finds it: offline (HF_HUB_OFFLINE=1) from the cache only; online the revision is looked up
    and the files of MODEL_FILES missing from the cache are fetched (no pickles, no other formats). DataError
    (one line) when it is neither cached nor reachable; what the directory holds is modeling/hf.py's to check."""
    return _snapshot(name, "model", MODEL_FILES)


# -- mix sources -----------------------------------------------------------------------------------

def materialise(specs, fetch: bool = True) -> tuple[SourceSpec, ...]:
    """The sources with every `"download": true` hub source replaced by its local snapshot directory
    (spec.hf = the directory, spec.hub = the hub name): from the cache, else (fetch) downloaded now.
    With fetch=False (a dry run) a source not cached stays a hub name. Offline, a hub source (downloaded
    or streamed) with nothing in the caches is a DataError: the run would fail on its first batch."""
    out = []
    for spec in specs:
        if spec.hf is not None and not spec.local_hf:
            if spec.download:
                directory = dataset_snapshot(spec, fetch)
                spec = spec if directory is None else replace(spec, hf=directory, hub=spec.hf)
            elif hub_offline(datasets=True):
                streamed_offline(spec)
        out.append(spec)
    return tuple(out)


def _patterns(value, split: str) -> list[str]:
    """The file patterns of `split` in a data_files value: a pattern or a list of them (every split),
    {split: pattern(s)}, or the README configs' [{"split": ..., "path": ...}] form."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        if "path" in value:
            return _patterns(value["path"], split) if value.get("split", split) == split else []
        return _patterns(value.get(split, []), split)
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _patterns(v, split)]
    return []


def _allow_patterns(spec: SourceSpec, readme_dir: str) -> list[str] | None:
    """The files of the source's config (its data_dir / data_files, else its README config's), with the
    README; None: every file (a dataset without configs, as load_dataset would read it)."""
    args = dataset_dir_args(readme_dir, spec)
    patterns = _patterns(args.get("data_files"), spec.split)
    if args.get("data_dir"):
        base = args["data_dir"].strip("/")
        patterns = [f"{base}/{p}" for p in patterns] if patterns else [f"{base}/*"]
    return ["README.md", *patterns] if patterns else None


def dataset_snapshot(spec: SourceSpec, fetch: bool = True) -> str | None:
    """The snapshot directory of a `"download": true` source, holding its config's files: the cached one
    when there is one (the hub is not asked again: a resume, and every rank, read the same files), else
    downloaded now (online, fetch). None: not cached and fetch=False (a dry run)."""
    from huggingface_hub import snapshot_download

    offline = hub_offline(datasets=True)
    where = f"{spec.where()}: hub dataset {spec.hf!r}"
    cached = _cached_snapshot(spec.hf, "dataset", None, None)
    if cached is not None and _has_files(spec, cached):
        return cached
    if offline:
        problem = "its snapshot in the cache lacks this config's files" if cached else "nothing cached"
        raise DataNotHere(f"{where} (\"download\": true): {problem} and offline mode is on ({_cache_dir()}):"
                        f" `hf download --repo-type dataset {spec.hf}` on a machine with network into the same"
                        " HF_HOME / HF_HUB_CACHE, or unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE")
    if not fetch:
        return None
    try:  # the README first: its configs say which files this source's config needs
        readme_dir = snapshot_download(spec.hf, repo_type="dataset", allow_patterns=["README.md"])
        directory = snapshot_download(spec.hf, repo_type="dataset", revision=Path(readme_dir).name,
                                      allow_patterns=_allow_patterns(spec, readme_dir))
    except Exception as e:
        raise DataError(f"{where}: {_problem(e, spec.hf, 'dataset', None, offline)}") from None
    if not _has_files(spec, directory):
        raise DataError(f"{where}: downloaded to {directory}, but no data files of split {spec.split!r}"
                        + (f", config {spec.config!r}" if spec.config else "") + " are there")
    return directory


def _has_files(spec: SourceSpec, directory: str) -> bool:
    """Whether the split's data files are in `directory` (as datasets resolves them for the config)."""
    try:
        return bool(find_files(replace(spec, hf=directory)).files)
    except DataError:
        return False


def streamed_offline(spec: SourceSpec) -> str:
    """Offline, where a streamed hub source will be read from (its hub-cache snapshot, else datasets'
    own cache of an earlier load_dataset); DataError (one line) when neither has it."""
    location = hub_location(spec.hf)
    if location != spec.hf:
        return f"the Hugging Face cache's snapshot {location}"
    try:  # not in the hub cache: datasets' own cache may still hold it (the stream itself says)
        next(records(open_streamed(spec, 0, 1)), None)
    except DataError:
        raise DataNotHere(f"{spec.where()}: hub dataset {spec.hf!r} (streamed): nothing cached and offline mode is"
                        f" on ({_cache_dir()}): `hf download --repo-type dataset {spec.hf}` on a machine with network"
                        " into the same HF_HOME / HF_HUB_CACHE, or unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE") \
            from None
    return "datasets' cache of an earlier load_dataset"


def _reachable(repo: str, repo_type: str) -> str:
    """An online dry run's check of a hub name: 'reachable on the hub, commit abc123456789'; DataError
    when the hub answers that it cannot be used (no such repository, gated); 'not checked (...)' when
    the hub cannot be reached from here. A dry run is often made away from the machines that train (a
    laptop, a login node, CI without network): an unreachable hub is a warning there, not a refusal;
    the run itself, and pre-flight on the cluster, still stop in one line if it cannot read the source."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().repo_info(repo, repo_type=repo_type)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise DataError(f"hub {repo_type} {repo!r}: {_problem(e, repo, repo_type, None, False)}") from None
    except Exception as e:  # connection refused, DNS, proxy, timeout: the hub said nothing about the name
        return f"not checked: the hub cannot be reached from here ({first_line(e)[:120]})"
    return f"reachable on the hub, commit {str(info.sha)[:12]}"


def hub_lines(specs, tokenizer) -> list[str]:
    """What a dry run says about each hub name (the tokenizer's, every hub source's): where it comes
    from, cached or reachable. Raises DataError (one line) for one that is neither: the run would fail
    on its first batch, hours later on the cluster."""
    lines = []
    if getattr(tokenizer, "origin", None):
        lines.append(f"hub: tokenizer {tokenizer.origin}")
    for spec in specs:
        at = f"hub: source {spec.name!r}"
        if spec.hub is not None:
            lines.append(f"{at}: {spec.hub} downloaded (\"download\": true) in {spec.hf}: sized, held out and"
                         " re-split like local files")
        elif spec.hf is None or spec.local_hf:
            continue
        elif spec.download:  # a dry run, not cached yet (offline materialise has refused already)
            lines.append(f"{at}: {spec.hf} (\"download\": true) is not in the cache yet;"
                         f" {_reachable(spec.hf, 'dataset')}; the run downloads its files into {_cache_dir()}"
                         " before training")
        elif hub_offline(datasets=True):
            lines.append(f"{at}: {spec.hf} streamed, offline, from {streamed_offline(spec)}")
        else:
            lines.append(f"{at}: {spec.hf} streamed; {_reachable(spec.hf, 'dataset')}"
                         " (size unknown, no held-out documents: \"download\": true to count and hold out)")
    return lines
