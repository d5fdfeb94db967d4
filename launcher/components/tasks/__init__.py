"""lm-evaluation-harness tasks scored inside the training loop (`--eval-tasks`): what needs no lm_eval.

lm-evaluation-harness (the optional extra `zerotrain[eval]`) owns the tasks: its registry finds them, it
builds their requests and computes their metrics. Ours is only the model behind its `LM` interface
(`tasks/lm.py` LiveLM: the live DeepSpeed engine, on every rank) and this module: which requests each rank
scores, how a batch of them becomes rows, how logits become log-likelihoods, and how lm-eval's result
dict becomes our metric names. All of it is plain Python and torch on tensors, unit-tested without a
process group (tests/test_eval_tasks.py).

Every rank scores: under ZeRO-3 each forward gathers the parameters with collectives, so every rank must
run the same number of forwards. Requests are dealt round-robin over the data-parallel ranks
(`shard`), each rank runs the passes rank 0 needs (the most), filling in with one-row padding passes, and
every rank's i-th pass is as wide as the widest of the ranks' i-th batches (`pass_widths`: a tiled MLP splits
a forward by its width, and at ZeRO-3 each tile gathers weights);
sequence-parallel ranks of a group score the same rows, each its stretch of positions. Each rank writes
its share (log-likelihood sum, count of non-greedy tokens) into an (n_requests, 2) float64 table that
one all-reduce sums: every rank then holds every result, and lm-eval computes the same metrics on each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerotrain.launcher.errors import UsageError

EXTRA_MISSING = ("--eval-tasks: lm-evaluation-harness is not installed (pip install 'zerotrain[eval]', which"
                 " installs lm_eval)")
GENERATION = "generate_until"


def need_lm_eval(flag: str = "--eval-tasks") -> None:
    """One line, exit 2, when the optional extra is missing."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UsageError(EXTRA_MISSING.replace("--eval-tasks", flag))


def split_specs(value) -> list[str]:
    """--eval-tasks "a,b,path/x.yaml" (or a recipe's list) -> ["a", "b", "path/x.yaml"]."""
    items = value if isinstance(value, list) else str(value).split(",")
    out = [str(s).strip() for s in items if str(s).strip()]
    if not out:
        raise UsageError("--eval-tasks: no task given (task names, task YAML files or folders, comma-separated)")
    return out


# -- which requests a rank scores ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """This rank's batches (lists of request indices) and how many padding passes follow them."""
    batches: list[list[int]]
    padding: int

    @property
    def passes(self) -> int:
        return len(self.batches) + self.padding


def shard(n_requests: int, dp_rank: int, dp_world: int, micro_batch: int, order: list[int] | None = None) -> Shard:
    """Requests dealt round-robin (in `order`, e.g. longest first, so batches hold alike lengths) over the
    data-parallel ranks, `micro_batch` per pass; every rank runs rank 0's number of passes (the most).
    No collective: every rank computes every rank's count alike. Fewer requests than ranks: the others pad."""
    if not 0 <= dp_rank < dp_world or micro_batch < 1:
        raise ValueError(f"shard: rank {dp_rank} of {dp_world}, micro_batch {micro_batch}")
    order = list(range(n_requests)) if order is None else order
    mine = order[dp_rank::dp_world]
    batches = [mine[i:i + micro_batch] for i in range(0, len(mine), micro_batch)]
    every_rank = math.ceil(math.ceil(n_requests / dp_world) / micro_batch)
    return Shard(batches, every_rank - len(batches))


def pass_widths(row_lengths: list[int], order: list[int], dp_world: int, micro_batch: int, multiple: int) -> list[int]:
    """Each pass's input width, the same on every data-parallel rank: the widest of that pass's batches over all
    ranks (`shard`, every rank computes every rank's alike), rounded up to `multiple`. Why: a tiled MLP
    (--tiled-mlp) splits a forward by its width (sizes.mlp_tiles) and at ZeRO-3 every tile gathers the MLP's
    weights, so ranks running other widths would gather another number of times and hang. Right-padding a row
    changes nothing before it (causal)."""
    shards = [shard(len(row_lengths), r, dp_world, micro_batch, order) for r in range(dp_world)]
    out = []
    for i in range(shards[0].passes):
        longest = max((row_lengths[j] - 1 for s in shards if i < len(s.batches) for j in s.batches[i]), default=1)
        out.append(max(multiple, math.ceil(longest / multiple) * multiple))
    return out


def forward_positions(row_lengths: list[int], dp_world: int, micro_batch: int, sequence_parallel: int) -> int:
    """Positions one rank runs forward to score requests of these row lengths (`request_row`'s rows): rank 0's
    passes (the most), each `pass_widths` wide, a 1/N stretch of it under sequence parallelism, a padding pass
    one row. The planner's cost of a scoring (planning/evaluation.py)."""
    order = longest_first(row_lengths)
    mine = shard(len(row_lengths), 0, dp_world, micro_batch, order)
    widths = pass_widths(row_lengths, order, dp_world, micro_batch, sequence_parallel)
    rows = [len(b) for b in mine.batches] + [1] * mine.padding
    return sum(n * w // sequence_parallel for n, w in zip(rows, widths))


def longest_first(row_lengths: list[int]) -> list[int]:
    """The order requests are dealt in: longest first, so that a batch holds alike lengths."""
    return sorted(range(len(row_lengths)), key=lambda i: -row_lengths[i])


def request_row(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], int]:
    """lm-eval's HFLM row for one request: (context + continuation)[-(max_length + 1):][:-1] as the input
    (truncated from the left, as lm-eval does), and how many of its last positions predict the continuation."""
    whole = (list(context) + list(continuation))[-(max_length + 1):]
    return whole, len(continuation)


def batch_rows(rows: list[list[int]], multiple: int, pad_id: int, width: int | None = None) -> torch.Tensor:
    """(B, T) input ids: each row's tokens but the last, right-padded to the longest, T rounded up to
    `multiple` (sequence parallelism splits T), or to `width` (`pass_widths`). Padding on the right changes
    nothing before it (causal)."""
    longest = max(len(r) - 1 for r in rows)
    width = width or max(multiple, math.ceil(longest / multiple) * multiple)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r) - 1] = torch.tensor(r[:-1], dtype=torch.long)
    return out


def score_rows(logits: torch.Tensor, rows: list[list[int]], cont_lens: list[int], positions: slice) -> torch.Tensor:
    """(B, 2) float64: per row, the log-probability of its continuation's tokens at `positions` (this rank's
    stretch of the row; all of it without sequence parallelism) and how many of those were not the argmax.
    logits (B, len(positions), V). Summed over a group's ranks this is the row's whole score."""
    out = torch.zeros(len(rows), 2, dtype=torch.float64)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = positions.start or 0
    for i, (r, n_cont) in enumerate(zip(rows, cont_lens)):
        n_in = len(r) - 1  # inputs r[:-1]; input position p predicts r[p + 1]
        lo, hi = max(n_in - n_cont, start), min(n_in, start + logprobs.shape[1])
        if lo >= hi:
            continue
        targets = torch.tensor(r[lo + 1:hi + 1], dtype=torch.long)
        lp = logprobs[i, lo - start:hi - start]
        out[i, 0] = lp.gather(-1, targets[:, None]).double().sum()
        out[i, 1] = float((lp.argmax(-1) != targets).sum())
    return out


# -- lm-eval's results as our metrics ------------------------------------------------------------------------

def metric_name(key: str) -> str | None:
    """lm-eval's "acc,none" -> "acc"; "exact_match,strict" -> "exact_match_strict"; stderr and alias -> None."""
    if "," not in key:
        return None
    metric, filt = key.split(",", 1)
    if metric.endswith("_stderr"):
        return None
    return metric if filt == "none" else f"{metric}_{filt}"


def flat_results(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results["results"] (numbers only)."""
    out = {}
    for task, values in results.items():
        metrics = {}
        for key, v in values.items():
            name = metric_name(key)
            if name is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[name] = float(v)
        if metrics:
            out[task] = metrics
    return out


def check_best_by(best_by: str, higher: dict[str, dict[str, bool]]) -> bool:
    """--best-by TASK/METRIC against the loaded tasks' metrics ({task: {metric: higher is better}});
    returns whether higher is better. UsageError naming what exists."""
    task, _, metric = best_by.rpartition("/")
    if task not in higher:
        raise UsageError(f"--best-by {best_by}: {task or '(none)'} is not one of --eval-tasks' tasks"
                         f" ({', '.join(sorted(higher)) or 'none'}); write TASK/METRIC")
    if metric not in higher[task]:
        raise UsageError(f"--best-by {best_by}: task {task} has no metric {metric!r}"
                         f" (its metrics: {', '.join(sorted(higher[task]))})")
    return higher[task][metric]
