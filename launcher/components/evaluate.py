"""Validation loss over fixed eval rows, computed by all ranks together.

The rows come from zerotrain.dataio.sources.holdout (`holdout_rows` / `mix_rows`): per source a tensor of packed
rows that every rank holds identically. Rank r evaluates rows r, r + world, ... of each source,
`micro_batch` rows per forward pass.

Under ZeRO-3 each forward pass gathers the parameters with collectives, so EVERY rank must run
EVERY forward pass: a rank that runs fewer leaves the others waiting forever. Row counts need not
divide evenly, so each rank runs, per source, the number of forward passes rank 0 needs (rank 0
always has the most rows); a rank with fewer rows fills in with padding passes (one row, all
labels -100) whose result is discarded. The counts are computed locally from the row counts,
which all ranks know, so no collective is needed to agree on them.

Each rank sums, per source, (mean loss of a pass) x (tokens with a label in that pass) and those
tokens, in float64; one all-reduce of those sums; val_loss = total loss sum / total tokens, so
it equals one process evaluating all rows, however they are split across ranks or micro-batches.
`val_loss` weighs sources by their eval tokens (which follow the mix weights); `val_ppl` is
exp(val_loss). The model is put in eval mode under torch.no_grad and back in its previous mode
after, also when the evaluation raises.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

ROW_KEYS = ("input_ids", "labels", "position_ids")


class Evaluator:
    """`evaluate(engine_or_model)` -> {"val_loss", "val_ppl", "val_loss_per_source", "val_tokens"}."""

    def __init__(self, batches_per_source: dict[str, dict[str, torch.Tensor]], rank: int, world: int,
                 micro_batch: int, sequence_parallel: int = 1, sp_rank: int = 0):
        """rank, world: the data-parallel ones. With sequence parallelism (N ranks share each row, the
        model returning each rank's share of a pass's loss) the N ranks of a group evaluate the same rows:
        their loss shares add up in the all-reduce, and only sp_rank 0 counts the tokens."""
        if not batches_per_source:
            raise ValueError("evaluator: no eval rows")
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ValueError(f"evaluator: micro_batch must be a positive integer, got {micro_batch!r}")
        if not 0 <= rank < world:
            raise ValueError(f"evaluator: rank {rank} outside a world of {world}")
        self.rank, self.world, self.micro_batch = rank, world, micro_batch
        self.sequence_parallel, self.counts_tokens = sequence_parallel, sp_rank == 0
        self.names = list(batches_per_source)
        self.passes = []  # per source: (own micro-batches, padding passes)
        for name, rows in batches_per_source.items():
            n = len(rows["input_ids"])
            if n == 0:
                raise ValueError(f"evaluator: source {name!r} has no eval rows")
            # rows rank, rank + world, ...; copied, so the caller may drop every rank's rows
            mine = {k: rows[k][rank::world].clone() for k in ROW_KEYS}
            batches = [{k: v[i:i + micro_batch] for k, v in mine.items()}
                       for i in range(0, len(mine["input_ids"]), micro_batch)]
            every_rank = math.ceil(math.ceil(n / world) / micro_batch)  # rank 0's count: the largest
            pad = {k: rows[k][:1].clone() for k in ROW_KEYS}
            pad["labels"] = torch.full_like(pad["labels"], -100)
            self.passes.append((batches, [pad] * (every_rank - len(batches))))

    @property
    def forward_passes(self) -> int:
        """Forward passes per evaluation: the same number on every rank."""
        return sum(len(own) + len(pad) for own, pad in self.passes)

    def local_sums(self, model, device=None) -> torch.Tensor:
        """(n_sources, 2) float64: this rank's sum of loss x tokens, and its tokens, per source."""
        device = device if device is not None else _device_of(model)
        sums = torch.zeros(len(self.names), 2, dtype=torch.float64, device=device)
        for s, (own, padding) in enumerate(self.passes):
            for batch in own:
                n_tokens = int((batch["labels"][:, 1:] != -100).sum())  # the model predicts labels[:, 1:]
                loss = model(**{k: v.to(device) for k, v in batch.items()})
                if n_tokens:  # a pass with nothing to predict returns nan: it adds nothing
                    sums[s, 0] += loss.detach().double() * n_tokens
                    sums[s, 1] += n_tokens if self.counts_tokens else 0
            for batch in padding:  # only so that this rank joins the others' parameter gathers
                model(**{k: v.to(device) for k, v in batch.items()})
        return sums

    def finish(self, sums: torch.Tensor) -> dict:
        """The metrics from all ranks' summed (n_sources, 2) sums."""
        sums = sums.double().cpu()
        loss_sum, tokens = float(sums[:, 0].sum()), float(sums[:, 1].sum())
        val_loss = loss_sum / tokens
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss < 700 else math.inf,
                "val_loss_per_source": {n: float(sums[i, 0] / sums[i, 1]) if sums[i, 1] else None
                                        for i, n in enumerate(self.names)},
                "val_tokens": int(tokens)}

    def evaluate(self, model, device=None) -> dict:
        """All ranks call this together; every rank returns the same metrics."""
        module = getattr(model, "module", model)  # a DeepSpeed engine keeps the mode on its module
        was_training = module.training
        model.eval()
        try:
            with torch.no_grad():
                sums = self.local_sums(model, device)
                if self.world * self.sequence_parallel > 1:
                    dist.all_reduce(sums)  # one collective for every source's sums
        finally:
            model.train(was_training)
        return self.finish(sums)


def _device_of(model) -> torch.device:
    device = getattr(model, "device", None)  # a DeepSpeed engine knows its device
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device
