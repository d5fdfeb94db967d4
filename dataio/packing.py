"""Packed-sequence rows: whole documents laid end to end into rows of `seq_len` tokens.

Each document is `tokens + [EOS]`. Documents are placed in order; a document that does not fit
in what is left of a row fills the row and its remainder starts the next row (so no token is
lost or repeated and no slot is padding). Position ids restart at 0 at every document start and
at the start of a carried-over remainder; they are the single source of document boundaries:
attention masks and `cu_seqlens` are derived from them (modeling.model.document_mask,
`cu_seqlens` below). Labels follow the Hugging Face convention (the model shifts them) and are
-100 at each document start, so no document is trained to predict across a boundary.
"""
from __future__ import annotations

from typing import Callable

import torch


class Packer:
    def __init__(self, seq_len: int, eos_id: int):
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.carry: list[int] = []  # remainder of a document split at the previous row's end

    def next_row(self, next_document: Callable[[], list[int]]) -> tuple[list[int], list[int]]:
        """One row: (token ids, position ids), both of length seq_len."""
        ids, pos = [], []
        while len(ids) < self.seq_len:
            if not self.carry:
                self.carry = next_document() + [self.eos_id]
            take = self.carry[: self.seq_len - len(ids)]
            self.carry = self.carry[len(take):]
            ids.extend(take)
            pos.extend(range(len(take)))
        return ids, pos

    def state_dict(self) -> dict:
        return {"carry": list(self.carry)}

    def load_state_dict(self, state: dict) -> None:
        self.carry = list(state["carry"])


def collate(rows: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([r[0] for r in rows], dtype=torch.long)  # (B, T)
    position_ids = torch.tensor([r[1] for r in rows], dtype=torch.long)  # (B, T)
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document lengths over the flattened batch (for variable-length attention kernels)."""
    starts = (position_ids.flatten() == 0).nonzero().flatten()
    bounds = torch.cat([starts, torch.tensor([position_ids.numel()], device=position_ids.device)])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())
