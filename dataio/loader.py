"""A rank's infinite stream of packed batches from a weighted mix of sources.

Mixing is by tokens: the next document always comes from the source whose share of the tokens
taken so far is furthest below its weight. This is deterministic (no sampling noise) and keeps
every source within one document of its share. Each source's documents are split across ranks
(document i goes to rank i % world) and visited in a fresh seeded permutation every epoch; a
source that runs out restarts with the next epoch.

`state_dict()` holds everything needed to continue exactly: per-source epoch, index and token
count, and the packer's carry-over.
"""
from __future__ import annotations

import numpy as np

from dataio.errors import DataError
from dataio.packing import Packer, collate
from dataio.sources import SourceSpec, load_source


class MixedStream:
    def __init__(self, specs: list[SourceSpec], tokenizer, rank: int, world: int, seed: int):
        self.specs, self.tokenizer, self.seed, self.rank = specs, tokenizer, seed, rank
        total = sum(s.weight for s in specs)
        self.weights = [s.weight / total for s in specs]
        self.shards = []
        for s in specs:
            ds = load_source(s)
            if len(ds) < world:
                raise DataError(f"source {s.name!r}: {len(ds)} documents cannot be split across {world} ranks")
            self.shards.append(ds.shard(num_shards=world, index=rank, contiguous=False))
        self.epoch = [0] * len(specs)
        self.index = [0] * len(specs)
        self.tokens = [0] * len(specs)
        self._orders = {}

    def _order(self, i: int) -> np.ndarray:
        key = (i, self.epoch[i])
        if key not in self._orders:
            rng = np.random.default_rng([self.seed, i, self.epoch[i], self.rank])
            self._orders = {key: rng.permutation(len(self.shards[i]))}
        return self._orders[key]

    def next_document(self) -> list[int]:
        total = sum(self.tokens) or 1
        i = min(range(len(self.specs)), key=lambda j: self.tokens[j] / total - self.weights[j])
        if self.index[i] >= len(self.shards[i]):
            self.epoch[i] += 1
            self.index[i] = 0
        doc_idx = int(self._order(i)[self.index[i]])
        self.index[i] += 1
        text = self.shards[i][doc_idx][self.specs[i].text_field]
        ids = self.tokenizer.encode(text or "")
        self.tokens[i] += len(ids) + 1
        return ids

    def state_dict(self) -> dict:
        return {"epoch": list(self.epoch), "index": list(self.index), "tokens": list(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.tokens = list(state["epoch"]), list(state["index"]), list(state["tokens"])

    def token_shares(self) -> dict[str, float]:
        total = sum(self.tokens) or 1
        return {s.name: t / total for s, t in zip(self.specs, self.tokens)}


class PackedLoader:
    """micro_batch rows of seq_len tokens per call; infinite, so every rank gets the same count."""

    def __init__(self, stream: MixedStream, seq_len: int, micro_batch: int):
        self.stream = stream
        self.packer = Packer(seq_len, stream.tokenizer.eos_id)
        self.micro_batch = micro_batch

    def next_batch(self):
        return collate([self.packer.next_row(self.stream.next_document) for _ in range(self.micro_batch)])

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["stream"])
        self.packer.load_state_dict(state["packer"])
