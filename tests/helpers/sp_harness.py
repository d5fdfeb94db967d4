"""Test harness for Ulysses sequence parallelism (tests/test_sequence_parallel.py), under a real `deepspeed` launch.

2 ranks at --sequence-parallel 2 (one row group: both ranks are given the same whole rows, each computes
half of every row). The rows are packed with several documents whose boundaries fall inside either half
and across the middle, and labels are masked unevenly, so a wrong document mask, wrong RoPE positions on
the second half, a missing target at the halves' seam or a local (not row-group) loss normalisation all
show. For each case (ZeRO-2 and ZeRO-3, sdpa, flex and varlen (torch's varlen_attn with the plain-PyTorch
flash reference registered as its CPU kernel, tests/helpers/reference_flash.py: all of the path but CUDA's kernel), kv heads dividing N and fewer kv heads than N,
loss "mean" and "sum", one with activation checkpointing) an engine is built through build_engine (EngineSpec.sequence_parallel=2: DeepSpeed's
sequence-parallel mpu, its all-to-all), one forward and backward is run, and compared with a plain
unsharded model holding the same weights on the same whole batch (what one rank computes): the sum of
the ranks' losses and every parameter's full gradient (`safe_get_full_grad`, after DeepSpeed's reduction
over the sequence-data-parallel group). Rank 0 writes OUT_DIR/result.json.

Usage: deepspeed --num_gpus 2 tests/helpers/sp_harness.py OUT_DIR
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore", category=FutureWarning)

B, T, SP, VOCAB = 2, 32, 2, 200
DOCS = ([11, 13, 8], [20, 5, 7])  # document lengths per row: boundaries at 11 and 24 / 20 and 25 (the seam is 16)
CASES = [  # (ZeRO stage, attention, kv heads, loss reduction, activation checkpointing); 4 query heads
    (3, "sdpa", 2, "mean", False), (3, "flex", 2, "mean", False), (3, "sdpa", 1, "mean", False),
    (3, "flex", 1, "mean", False), (2, "sdpa", 2, "mean", False), (2, "flex", 1, "mean", False),
    (3, "sdpa", 2, "sum", False), (2, "sdpa", 1, "sum", False),
    (3, "sdpa", 2, "mean", True),  # the recomputed blocks exchange again in backward
    (3, "varlen", 2, "mean", False), (2, "varlen", 1, "mean", False),  # the flash kernel: reference_flash.py
]


def batch():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt in the first half only: the halves hold different labelled counts
    labels[1, 16:19] = -100  # and in the second half of the other row
    labels[pos == 0] = -100  # nothing predicts a document's first token
    return ids, pos, labels


def main(out_dir: str) -> None:
    import torch.distributed as dist

    import reference_flash  # tests/helpers/, beside this script
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile

    init_process_group()
    rank = dist.get_rank()
    _, profile = load_profile("cpu")
    base = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
    ids, pos, labels = batch()
    results = []
    for case in CASES:  # varlen: the plain-PyTorch flash reference is torch's CPU kernel while the case runs
        with reference_flash.registered() if case[1] == "varlen" else contextlib.nullcontext() as calls:
            results.append(run_case(case, base, calls, ids, pos, labels))
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results, indent=2))


def run_case(case: tuple, base: dict, calls: list | None, ids, pos, labels) -> dict:
    """One engine at SP=2 and one unsharded model with its weights, one forward and backward each."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.modeling.model import ModelArgs, Transformer

    stage, attention, kv, reduction, checkpointing = case
    world = dist.get_world_size()
    ds_config = {**base, "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                 "train_batch_size": B * world // SP,  # DeepSpeed counts the batch over world/SP ranks
                 "zero_allow_untested_optimizer": True, "bf16": {"enabled": False},
                 "zero_optimization": {**base["zero_optimization"], "stage": stage}}
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=VOCAB)
    engine = build_engine(EngineSpec(ds_config, args, seed=1, attention=attention, loss_chunk_tokens=8,
                                     sequence_parallel=SP, activation_checkpointing=checkpointing,
                                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1))).engine
    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # as built: no step taken yet
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = engine(ids, pos, labels=labels, loss_reduction=reduction)  # this rank's share
    engine.backward(loss)
    # what the flash kernel was given under SP: whole rows (B*T positions), heads / SP, the whole rows' documents
    kernel_calls = [{"q": list(c["q"]), "k": list(c["k"]), "cu": c["cu"].tolist(), "max_q": c["max_q"]}
                    for c in (calls or [])]
    grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}  # collective
    shares = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(shares, loss.detach().float())
    plain = Transformer(args)  # one rank, the same whole batch, no shard
    plain.attention = attention
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(whole[n])
    reference = plain(ids, pos, labels=labels, loss_reduction=reduction)
    reference.backward()
    rel = {n: float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30))
           for n, p in plain.named_parameters()}
    result = {"stage": stage, "attention": attention, "kv_heads": kv, "reduction": reduction,
              "activation_checkpointing": checkpointing,
              "shares": [float(s) for s in shares], "loss": float(sum(shares)),
              "reference_loss": float(reference.detach()), "grad_rel_err": rel,
              "grad_max_abs": max(float(p.grad.abs().max()) for p in plain.parameters()),
              "sp_rank": model.sequence_parallel.rank, "kernel_calls": kernel_calls}
    engine.destroy()
    return result


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
