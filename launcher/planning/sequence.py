"""Sequence parallelism (Ulysses over N ranks): which N a model, world and row accept (`check_sequence_parallel`,
the run's check and `zerotrain plan`'s), the all-to-alls around attention and the seconds they add, and the longest
row that fits.

Each step waits on the all-to-alls (`all_to_all_bytes`): per layer and micro-batch, q, k, v (k and v at max(kv heads,
N) heads) and the kernel's output in forward, their gradients in backward, the forward's again in the recomputation
under activation checkpointing; each rank sends (N-1)/N of its (B, T/N, heads, head dim) tensors, at the
per-direction rate of the slowest link its group spans: `zerotrain.hardware.interconnect_gb_s` within a node,
`internode_gb_s` when a group crosses nodes (each with a `*_note` naming its source; spec figures, not measured),
not overlapped with compute (an upper bound). `max_seq_len`: the longest row that fits, by the same memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.planning.hardware import Setup
from zerotrain.launcher.planning.memory import largest, memory
from zerotrain.modeling.sizes import check_sequence_parallel as check_model_sequence_parallel


@dataclass(frozen=True)
class AllToAll:
    """Bytes one rank sends per attention layer for one micro-batch."""
    forward: float
    backward: float
    recompute: float  # the forward's again under activation checkpointing (0 without)
    per_layer: float  # all three


def check_sequence_parallel(sp: int, flag: str, seq_len: int, args, world: int, one_rank: str = "this launch has 1"
                            ) -> None:
    """UsageError (one line naming `flag`, before anything is written) when N = sp ranks cannot share each row:
    N divides the world, --seq-len and the attention heads (the kv heads divide by N or N by them:
    modeling/sizes.py check_sequence_parallel); N > 1 needs more than one rank. The run's check
    (launcher/run_plan.py) and `zerotrain plan`'s; `one_rank` ends the line for a world of 1 (plan: how to
    plan more ranks)."""
    if sp == 1:
        return
    if world == 1:
        raise UsageError(f"{flag}: sequence parallelism needs more than one rank; {one_rank}")
    if world % sp:
        raise UsageError(f"{flag}: must divide the world size {world} (N ranks share each row)")
    if seq_len % sp:
        raise UsageError(f"{flag}: must divide --seq-len {seq_len} (each rank holds seq_len / N positions)")
    try:
        check_model_sequence_parallel(args, sp)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def sequence_parallel_sizes(args, world: int, seq_len: int) -> list[int]:
    """Every N the run accepts for this model, world and --seq-len (check_sequence_parallel)."""
    def accepted(n: int) -> bool:
        try:
            check_sequence_parallel(n, "", seq_len, args, world)
            return True
        except UsageError:
            return False

    return [n for n in range(1, world + 1) if accepted(n)]


def all_to_all_bytes(args, micro: int, seq_len: int, act_bytes: int, sequence_parallel: int,
                     checkpointing: bool) -> AllToAll:
    """Bytes one rank sends per attention layer for one micro-batch under Ulysses over N ranks
    (modeling/model.py Attention.forward, sequence_to_heads / heads_to_sequence).

    Forward, four all-to-alls of this rank's (B, T/N, heads, h) tensors: q at H heads, k and v at max(KV, N)
    heads (fewer kv heads than N are repeated before the exchange), the kernel's output at H heads. Backward
    exchanges the same four gradients. Under activation checkpointing the forward's four run again in the
    recomputation. Each rank keeps 1/N of every tensor and sends the other (N-1)/N."""
    n = sequence_parallel
    if n <= 1:
        return AllToAll(0.0, 0.0, 0.0, 0.0)
    heads = 2 * args.n_heads + 2 * max(args.n_kv_heads, n)
    tensors = micro * (seq_len // n) * heads * args.head_dim * act_bytes  # the four tensors this rank holds
    sent = tensors * (n - 1) / n
    recompute = sent if checkpointing else 0.0
    return AllToAll(sent, sent, recompute, 2 * sent + recompute)


def sequence_link(setup: Setup) -> tuple[float | None, str, str]:
    """(bytes/s per direction of the slowest link a sequence-parallel group spans, its name, the profile key
    that states it). Groups are ranks g*N .. g*N+N-1: within a node when N divides the GPUs per node, else
    across nodes."""
    n = setup.sequence_parallel
    if setup.nodes > 1 and setup.gpus_per_node % n:
        rate, where, key = setup.internode_bytes_per_s, "between nodes", "zerotrain.hardware.internode_gb_s"
    else:
        rate, where, key = setup.interconnect_bytes_per_s, "within a node", "zerotrain.hardware.interconnect_gb_s"
    return rate, f"{where} ({key})", key


def all_to_all_summary(args, setup: Setup, micro: int, seq_len: int, checkpointing: bool, grad_accum: int) -> dict:
    """The plan's `all_to_all`: GB one GPU sends per layer and per step, the link and its GB/s, and the seconds
    per step at that rate, not overlapped with compute (None without the profile's bandwidth; 0 at N = 1)."""
    moved = all_to_all_bytes(args, micro, seq_len, 2 if setup.mixed else 4, setup.sequence_parallel, checkpointing)
    per_step = moved.per_layer * args.n_layers * grad_accum
    rate, link, _ = sequence_link(setup)
    def seconds(moved_bytes: float) -> float | None:
        return 0.0 if not moved_bytes else moved_bytes / rate if rate else None

    return {"gb_per_layer_forward": round(moved.forward / 1e9, 4),
            "gb_per_layer": round(moved.per_layer / 1e9, 4), "gb_per_step_per_gpu": round(per_step / 1e9, 3),
            "link": link, "link_gb_s": None if rate is None else rate / 1e9,
            "seconds_per_layer": seconds(moved.per_layer), "seconds_per_step": seconds(per_step)}


def max_seq_len(args, setup: Setup, stage, checkpointing: bool, micro: int = 1, limit: int = 1 << 24) -> int:
    """The longest row (a multiple of the setup's N) whose memory at `micro` rows fits the device, by the same
    `memory` the fit check uses (0: not even N positions; `limit`: no limit found below it). Memory grows with
    the row, so the answer is searched (doubling, then bisection) in steps of N."""
    n = setup.sequence_parallel
    return n * largest(lambda k: memory(args, setup, stage, micro, k * n, checkpointing).total
                       <= setup.device_bytes, limit // n)


def sequence_summary(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
                     grad_accum: int) -> dict:
    """The plan's `sequence_parallel`: N, the sizes this model, world and row accept, the all-to-all, and the
    longest row that fits at micro-batch 1 for the chosen stage, with and without activation checkpointing."""
    return {"size": setup.sequence_parallel, "valid_sizes": sequence_parallel_sizes(args, setup.world, seq_len),
            "all_to_all": all_to_all_summary(args, setup, micro, seq_len, checkpointing, grad_accum),
            "max_seq_len": max_seq_len(args, setup, stage, checkpointing),
            "max_seq_len_with_ac": max_seq_len(args, setup, stage, True)}
