"""What would fit instead of a configuration that does not (the plan's `would_fit`, the fit check's refusal):
activation checkpointing, another attention kernel or sequence parallelism, a higher ZeRO stage, a smaller
micro-batch, offload, a shorter row, more nodes, smallest change first."""
from __future__ import annotations

from dataclasses import replace

from zerotrain.launcher.planning.hardware import Setup
from zerotrain.launcher.planning.memory import max_micro_batch, memory
from zerotrain.launcher.planning.sequence import sequence_parallel_sizes
from zerotrain.launcher.planning.units import gib
from zerotrain.modeling.attention import KERNELS


def alternatives(args, setup: Setup, stage: int, micro: int, seq_len: int, checkpointing: bool) -> list[dict]:
    """What would fit instead, smallest change first: activation checkpointing, a higher ZeRO stage
    (with and without it), a smaller micro-batch (grad accum grows to keep the global batch), more
    GPUs (whole nodes). Each entry: the change and its memory per GPU."""
    out = []

    def add(change: str, s, mb, ac, st=setup):
        m = memory(args, st, s, mb, seq_len, ac).total
        if m <= st.device_bytes:
            out.append({"change": change, "memory_per_gpu_gib": gib(m)})

    ac_name = "activation checkpointing"
    if not checkpointing:
        add(ac_name, stage, micro, True)
    # long rows: flex instead of sdpa's T x T mask per row, and more ranks per row (sequence parallelism)
    sizes = [n for n in sequence_parallel_sizes(args, setup.world, seq_len) if n > setup.sequence_parallel]
    kinds = [(f"--sequence-parallel {n}", replace(setup, sequence_parallel=n)) for n in sizes]
    lighter = KERNELS[setup.kernel].lighter  # sdpa: flex (flex and varlen keep no mask; sdpa one of T x T per row)
    if lighter:
        instead = replace(setup, attention=lighter)
        kinds = [(f"--attention {lighter}", instead)] + kinds + [
            (f"--attention {lighter} + --sequence-parallel {n}", replace(instead, sequence_parallel=n)) for n in sizes]
    for change, st in kinds:
        n = len(out)
        add(change, stage, micro, checkpointing, st)
        if len(out) == n and not checkpointing:
            add(f"{change} + {ac_name}", stage, micro, True, st)
    for s in range(stage + 1, 4):
        add(f"ZeRO-{s}", s, micro, checkpointing)
        if not checkpointing:
            add(f"ZeRO-{s} + {ac_name}", s, micro, True)
    for s, ac in ((stage, checkpointing), (3, True)):
        mb = max_micro_batch(args, setup, s, seq_len, ac)
        if 1 <= mb < micro:
            add(f"micro-batch {mb}" if (s, ac) == (stage, checkpointing) else f"ZeRO-3 + {ac_name} + micro-batch {mb}",
                s, mb, ac)
            break
    for variant, flag, s in (("zero2_offload", "ZeRO-2 + --offload optimizer", 2), ("zero3_offload",
                                                                                   "ZeRO-3 + --offload all", 3)):
        if s >= stage and not out:  # offload trades speed for memory: offered when nothing faster fits
            add(flag + (f" + {ac_name}" if not checkpointing else ""), variant, micro, True)
    if not out:  # not even one row fits: the longest row that would, at micro-batch 1
        for s, ac in ((stage, checkpointing), (3, True)):
            lo, hi = 0, seq_len
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if memory(args, setup, s, 1, mid, ac).total <= setup.device_bytes else (lo, mid)
            if lo >= 1:
                how = "" if (s, ac) == (stage, checkpointing) else f"ZeRO-3 + {ac_name} + "
                m = memory(args, setup, s, 1, lo, ac).total
                out.append({"change": f"{how}micro-batch 1 x seq-len {lo}", "memory_per_gpu_gib": gib(m)})
                break
    if not out and stage > 0:  # ZeRO-0 keeps everything on every rank: more GPUs never help it
        for s, ac in ((stage, checkpointing), (3, True)):
            for nodes in range(setup.nodes + 1, setup.nodes * 1024 + 1):
                more = replace(setup, nodes=nodes)
                if memory(args, more, s, micro, seq_len, ac).total <= setup.device_bytes:
                    how = "" if (s, ac) == (stage, checkpointing) else f" with ZeRO-3 + {ac_name}"
                    add(f"{more.world} GPUs ({nodes} nodes of {setup.gpus_per_node}){how}", s, micro, ac, more)
                    break
            if out:
                break
    return out
