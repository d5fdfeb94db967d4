"""Loader states for a resume on another world size: the old ranks' states re-split over the new ranks.

A rank's stream is made of parts (rank * W + w of world * W, W = data workers per rank, at least 1;
W stays the same across the change, the profile's count). Per local source, part p visits the
documents p, p + parts, ... in a seeded permutation per epoch (zerotrain.dataio.pipeline.cursors.IndexedSource), so the
old states say exactly which documents every old part has still to visit in its current epoch
(`IndexedSource.remaining()`, pending documents from an earlier change included). The union of
those, sorted, shuffled with a seed keyed by (seed, source, epoch, old parts, new parts) and dealt
round-robin, becomes each new part's `pending` list: it visits them first, then its own regular
schedule starts at the next epoch (a "stop" source ends after them). No document is repeated or
skipped across the change. The new epoch number is the largest old one (parts drift apart by a
document at a time, so some may still be finishing the epoch before it; numbers only seed the
permutations).

What the old packers held (taken from the stream, not yet emitted) is emitted exactly once: the
old part j's packer goes to new part j % new parts. A new part that receives one packer loads it
as it was (the same rows, the same bytes); one that receives several (fewer parts than before)
takes their finished rows as finished rows, and the documents of their open rows (best-fit) or
the tail of their cut document (greedy) as `carried` documents, placed before anything new.
Token and document counts (the token-share schedule) are summed per source over the old parts
and split evenly over the new ones, so the totals, and the shares logged, carry on.

Streamed sources cannot be re-split: their position is the `datasets` stream's own state for one
rank of the old world. A mix with one is refused (`check_reshard`), before anything is built.
"""
from __future__ import annotations

import copy

import numpy as np

from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.format.packing import make_packer
from zerotrain.dataio.pipeline.cursors import IndexedSource
from zerotrain.dataio.pipeline.loader import Data, plain

RESHARD_KEY = 0x7E5A4D  # mixed into the seed of the re-split, apart from the epoch permutations


def check_reshard(data: Data, old_world: int, new_world: int) -> None:
    """Refuse, with one line, a change of world size that the data cannot follow exactly. Cheap:
    it reads the mix only, so it can run right after `open_data`, before anything is built."""
    if old_world == new_world:
        return
    for i, spec in enumerate(data.specs):
        if spec.streamed or (i < len(data.stores) and data.stores[i] is None):
            raise DataError(f"{spec.where()} is streamed: its position is the datasets stream's own state for one"
                            f" rank of {old_world}, which cannot be re-split exactly; cannot change world size"
                            f" ({old_world} -> {new_world})")


def documents_split(states: list[dict]) -> list[int | None]:
    """Per source, how many documents the saved loaders (one `Batches` state per data-parallel rank, as the
    checkpoint holds them) split between their parts: what the data must still hold for the states to mean
    anything. None for a streamed source (its position is the stream's own). Small: it goes into the
    checkpoint's meta, so a resume checks the data (`check_documents`) before anything is built or written."""
    parts = [part for state in states for part in state["parts"]]
    counts = []
    for i in range(len(parts[0]["stream"]["sources"]) if parts else 0):
        saw = [part["stream"]["sources"][i].get("n") for part in parts]
        counts.append(None if None in saw else sum(saw))
    return counts


def check_documents(data: Data, documents: list[int | None], where: str) -> None:
    """Refuse, with one line naming `where` and the source, data whose document count is not the one a
    checkpoint's loaders split (`documents_split`): a source edited, grown or cut into pieces otherwise."""
    if len(documents) != len(data.specs):
        raise DataError(f"{where}: its loaders read {len(documents)} source(s), the data has {len(data.specs)}")
    for spec, store, saw in zip(data.specs, data.stores, documents):
        if saw is not None and store is not None and saw != len(store):
            raise DataError(f"{where}: its loaders split {saw} documents of {spec.where()} (held-out ones not"
                            f" counted, long ones cut into pieces), the data now gives {len(store)}: the source"
                            " changed since the checkpoint; restore it, or start a new --run-id")


def reshard_loader_states(data: Data, states: list[dict], new_world: int, seed: int, seq_len: int,
                          micro_batch: int, packing: str) -> list[dict]:
    """One `Batches` state per new rank, continuing the old ranks' `states` (a list by old rank,
    as saved in the checkpoint) exactly: see the module docstring. With the same world size the
    states come back unchanged. `data` is loaded (`load_data`); `seed`, `seq_len`, `micro_batch`
    and `packing` are the run's (unchanged across the change)."""
    old_world = len(states)
    if old_world < 1 or new_world < 1:
        raise DataError(f"checkpoint: cannot re-split the loader states of {old_world} rank(s) over {new_world}")
    check_reshard(data, old_world, new_world)
    if new_world == old_world:
        return copy.deepcopy(states)
    if len(data.stores) != len(data.specs):
        raise ValueError("reshard_loader_states needs the data loaded (zerotrain.dataio.pipeline.loader.load_data)")
    try:
        return _reshard(data, states, new_world, seed, seq_len, micro_batch, packing)
    except DataError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:  # not what Batches.state_dict writes
        raise DataError(f"checkpoint: the loader states are not in the format this version reads"
                        f" ({type(e).__name__}: {e}); cannot change world size") from None


def _reshard(data: Data, states: list[dict], new_world: int, seed: int, seq_len: int, micro_batch: int,
             packing: str) -> list[dict]:
    old_world = len(states)
    workers = {s.get("workers") for s in states}
    if len(workers) != 1 or not isinstance(next(iter(workers)), int):
        raise DataError(f"checkpoint: the ranks' loader states disagree on the number of workers"
                        f" ({', '.join(sorted(map(str, workers)))})")
    workers = workers.pop()
    per_rank = max(1, workers)
    old = [part for s in states for part in s["parts"]]  # old part r * per_rank + w
    if len(old) != old_world * per_rank or any(len(s["parts"]) != per_rank for s in states):
        raise DataError(f"checkpoint: the loader states do not hold {per_rank} part(s) per rank;"
                        f" the checkpoint is damaged")
    n_sources = len(data.specs)
    for part in old:
        if len(part["stream"]["sources"]) != n_sources:
            raise DataError(f"loader state has {len(part['stream']['sources'])} sources, the data has {n_sources}")
    old_parts, new_parts = len(old), new_world * per_rank

    sources = [_reshard_source(data, i, old, seed, new_parts) for i in range(n_sources)]
    tokens = [_split(sum(int(p["stream"]["tokens"][i]) for p in old), new_parts) for i in range(n_sources)]
    documents = [_split(sum(int(p["stream"]["documents"][i]) for p in old), new_parts) for i in range(n_sources)]
    fresh = make_packer(packing, seq_len, data.tokenizer.eos_id, micro_batch).state_dict()
    new = []
    for q in range(new_parts):
        packer, carried = _merge_packers([old[j] for j in range(q, old_parts, new_parts)], fresh, packing,
                                         data.tokenizer.eos_id)
        state = {"stream": {"tokens": [t[q] for t in tokens], "documents": [d[q] for d in documents],
                            "sources": [s[q] for s in sources]},
                 "packer": packer}
        if carried:
            state["carried"] = carried
        new.append(state)
    return [plain({"workers": workers, "parts": new[r * per_rank:(r + 1) * per_rank]}) for r in range(new_world)]


def _reshard_source(data: Data, i: int, old: list[dict], seed: int, new_parts: int) -> list[dict]:
    """Per new part, source i's state: the old parts' unvisited documents dealt out as `pending`."""
    spec, store = data.specs[i], data.stores[i]
    old_parts = len(old)
    saw = [part["stream"]["sources"][i].get("n") for part in old]
    if None not in saw and sum(saw) != len(store):
        raise DataError(f"{spec.where()}: the checkpoint's loaders saw {sum(saw)} documents, the data now has"
                        f" {len(store)}; the source (or how it is cut into pieces) changed since the checkpoint")
    if len(store) < new_parts:
        raise DataError(f"{spec.where()}: {len(store)} documents cannot be split across {new_parts} parts"
                        f" (ranks x data workers)")
    left, epoch = [], 0
    for p, part in enumerate(old):
        src = IndexedSource(store, spec, data.tokenizer, i, p, old_parts, seed)
        src.load_state_dict(part["stream"]["sources"][i])
        left.append(src.remaining())
        epoch = max(epoch, src.epoch)
    left = np.sort(np.concatenate(left))
    if len(left) and (np.diff(left) == 0).any():
        raise DataError(f"{spec.where()}: the checkpoint's loader states list a document twice;"
                        f" the checkpoint is damaged")
    left = left[np.random.default_rng([seed, i, epoch, old_parts, new_parts, RESHARD_KEY]).permutation(len(left))]
    out = []
    for q in range(new_parts):
        n = len(range(q, len(store), new_parts))
        # At the end of `epoch`: after the pending documents the next epoch starts ("restart"),
        # or the source has run out on this part ("stop"), as it would have at the old world.
        out.append({"epoch": epoch, "pos": n, "n": n, "pending": left[q::new_parts]})
    return out


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (q < total % parts) for q in range(parts)]


def _merge_packers(parts: list[dict], fresh: dict, packing: str, eos: int) -> tuple[dict, list]:
    """(packer state, carried documents) of a new part that receives the old parts' packers."""
    for part in parts:
        if part["packer"].get("packing", "greedy") != packing:
            raise DataError(f"loader state was saved with {part['packer'].get('packing')!r} packing,"
                            f" this run packs {packing!r}")
    if not parts:
        return copy.deepcopy(fresh), []
    if len(parts) == 1:  # the same rows, continued as they were
        return copy.deepcopy(parts[0]["packer"]), list(parts[0].get("carried", []))
    packer, carried = copy.deepcopy(fresh), []
    for part in parts:
        state = part["packer"]
        carried.extend(part.get("carried", []))
        if packing == "greedy":
            # The tail of a document cut at the end of the last batch (with its EOS): emitted as a
            # document of its own, exactly as the greedy packer starts a continued one (position 0).
            if len(state["carry"]):
                carried.append(_document(np.asarray(state["carry"], np.int64), eos))
            continue
        packer["ready"].extend(copy.deepcopy(state["ready"]))  # finished rows stay rows
        for _, tokens, starts, used in state["open"]:
            # An open row's segments are whole documents (or a long document's last piece), each
            # ending in its EOS: placed again by this part's packer, they are the same tokens.
            tokens = np.asarray(tokens, np.int64)[:int(used)]
            bounds = list(starts) + [int(used)]
            carried.extend(_document(tokens[a:b], eos) for a, b in zip(bounds[:-1], bounds[1:]))
    return packer, carried


def _document(segment: np.ndarray, eos: int) -> np.ndarray:
    """A packed segment (a document's tokens and its EOS) as a document to pack again."""
    if not len(segment) or segment[-1] != eos:
        raise DataError("checkpoint: a packer's held rows do not end their documents with EOS; the checkpoint is"
                        " damaged or was saved with another tokenizer")
    return segment[:-1]
