"""Test harness for Ulysses sequence parallelism (tests/test_sequence_parallel.py), under a real `deepspeed` launch.

--sequence-parallel 2 on 2 ranks (one row group: both ranks are given the same whole rows, each computes half of
every row) or on 4 (two row groups, each its own rows: sequence and data parallelism together, where DeepSpeed's
gradient divisor differs between ZeRO stages). The rows are packed with several documents whose boundaries fall
inside either half and across the middle, and labels are masked unevenly (differently in each row group), so a
wrong document mask, wrong RoPE positions on the second half, a missing target at the halves' seam, a local (not
row-group) loss normalisation or a wrong gradient divisor all show. For each case (ZeRO-2 and ZeRO-3, sdpa, flex
and varlen (torch's varlen_attn with the plain-PyTorch flash reference registered as its CPU kernel,
tests/helpers/reference_flash.py: all of the path but CUDA's kernel), kv heads dividing N and fewer kv heads than
N, loss "mean" and "sum", activation checkpointing, bf16) an engine is built through build_engine
(EngineSpec.sequence_parallel=2: DeepSpeed's sequence-parallel mpu, its all-to-all), one forward and backward is
run, and compared with a plain unsharded model holding the same weights on the same batch (what one rank computes
with the global batch as micro-batches: the mean over row groups of each group's loss): each row group's loss as
the sum of its ranks' shares, and every parameter's full gradient (`safe_get_full_grad`, after DeepSpeed's
reduction over the sequence-data-parallel group). bf16 cases compare with the plain model in bf16 and also record
the plain model's bf16-vs-fp32 difference (the scale of bf16's rounding). Rank 0 writes OUT_DIR/result.json.

Usage: deepspeed --num_gpus 2|4 tests/helpers/sp_harness.py OUT_DIR
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)
warnings.filterwarnings("ignore", category=FutureWarning)

B, T, SP, VOCAB = 2, 32, 2, 200
DOCS = ([11, 13, 8], [20, 5, 7])  # document lengths per row: boundaries at 11 and 24 / 20 and 25 (the seam is 16)
CASES = {  # world -> (ZeRO stage, attention, kv heads, loss reduction, activation checkpointing, dtype); 4 heads
    2: [(3, "sdpa", 2, "mean", False, "fp32"), (3, "flex", 2, "mean", False, "fp32"),
        (3, "sdpa", 1, "mean", False, "fp32"), (3, "flex", 1, "mean", False, "fp32"),
        (2, "sdpa", 2, "mean", False, "fp32"), (2, "flex", 1, "mean", False, "fp32"),
        (3, "sdpa", 2, "sum", False, "fp32"), (2, "sdpa", 1, "sum", False, "fp32"),
        (3, "sdpa", 2, "mean", True, "fp32"),  # the recomputed blocks exchange again in backward
        (3, "varlen", 2, "mean", False, "fp32"), (2, "varlen", 1, "mean", False, "fp32"),  # reference_flash.py
        (3, "sdpa", 2, "mean", False, "bf16"), (2, "flex", 1, "mean", False, "bf16")],
    # two row groups: ZeRO-3 divides the all-rank gradient sum by the world, ZeRO-2 by world/N (ds_compat/sequence.py
    # sequence_parallel_gradient_factor); 4 ranks on 2 cores are slow, so the cases that tell the divisors apart
    4: [(3, "sdpa", 2, "mean", False, "fp32"), (2, "flex", 1, "mean", False, "fp32"),
        (3, "flex", 1, "sum", False, "fp32")],
}


def batch(group: int = 0):
    """Row group `group`'s rows: its own tokens, and its own label mask."""
    import torch

    g = torch.Generator().manual_seed(group)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    labels = ids.clone()
    labels[0, :7 + 4 * group] = -100  # a prompt in the first half only: the halves hold different labelled counts
    labels[1, 16:19] = -100  # and in the second half of the other row
    labels[pos == 0] = -100  # nothing predicts a document's first token
    return ids, pos, labels


def main(out_dir: str) -> None:
    import torch.distributed as dist

    import reference_flash  # tests/helpers/, beside this script
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    _, profile = load_profile("cpu")
    base = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
    rows = [batch(g) for g in range(world // SP)]
    results = []
    for case in CASES[world]:  # varlen: the plain-PyTorch flash reference is torch's CPU kernel while the case runs
        with reference_flash.registered() if case[1] == "varlen" else contextlib.nullcontext() as calls:
            results.append(run_case(case, base, calls, rows))
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results, indent=2))


def run_case(case: tuple, base: dict, calls: list | None, rows: list) -> dict:
    """One engine at SP=2 and one unsharded model with its weights, one forward and backward each; `rows`: each
    row group's (ids, positions, labels)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.profiles import accumulate_in_fp32
    from zerotrain.modeling.model import ModelArgs, Transformer

    stage, attention, kv, reduction, checkpointing, dtype = case
    rank, world, groups = dist.get_rank(), dist.get_world_size(), len(rows)
    ids, pos, labels = rows[rank // SP]  # this rank's row group's rows
    ds_config = {**base, "train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
                 "train_batch_size": B * groups,  # DeepSpeed counts the batch over world/SP ranks
                 "zero_allow_untested_optimizer": True, "bf16": {"enabled": dtype == "bf16"},
                 "zero_optimization": {**base["zero_optimization"], "stage": stage}}
    ds_config = accumulate_in_fp32(ds_config)  # as the driver builds a bf16 engine
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=VOCAB)
    engine = build_engine(EngineSpec(ds_config, args, seed=1, attention=attention, loss_chunk_tokens=8,
                                     sequence_parallel=SP, activation_checkpointing=checkpointing,
                                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1))).engine
    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # as built: no step taken yet
        whole = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    loss = engine(ids, pos, labels=labels, loss_reduction=reduction)  # this rank's share
    engine.backward(loss)
    # what the flash kernel was given under SP: whole rows (B*T positions), heads / SP, the whole rows' documents
    kernel_calls = [{"q": list(c["q"]), "k": list(c["k"]), "cu": c["cu"].tolist(), "max_q": c["max_q"]}
                    for c in (calls or [])]
    grads = {n: safe_get_full_grad(p).float().clone() for n, p in model.named_parameters()}  # collective
    shares = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(shares, loss.detach().float())

    def unsharded(torch_dtype):
        """One rank, the global batch, no shard: the mean over row groups (DeepSpeed's data-parallel mean)."""
        plain = Transformer(args)
        plain.attention = attention
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(whole[n])
        plain.to(torch_dtype)
        losses = [plain(ids_g, pos_g, labels=labels_g, loss_reduction=reduction) for ids_g, pos_g, labels_g in rows]
        (sum(losses) / groups).backward()
        return [float(x.detach()) for x in losses], {n: p.grad.float() for n, p in plain.named_parameters()}

    def rel(a, b):  # the largest difference in a tensor relative to its largest magnitude
        return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b}

    reference_losses, reference = unsharded(torch.bfloat16 if dtype == "bf16" else torch.float32)
    result = {"stage": stage, "attention": attention, "kv_heads": kv, "reduction": reduction,
              "activation_checkpointing": checkpointing, "dtype": dtype, "world": world,
              "shares": [float(s) for s in shares],
              "group_losses": [float(sum(shares[g * SP:(g + 1) * SP])) for g in range(groups)],
              "reference_losses": reference_losses, "grad_rel_err": rel(grads, reference),
              "grad_max_abs": max(float(g.abs().max()) for g in reference.values()),
              "sp_rank": model.sequence_parallel.rank, "kernel_calls": kernel_calls}
    if dtype == "bf16":  # the scale of bf16's rounding: the unsharded model in bf16 against fp32
        fp32_losses, fp32 = unsharded(torch.float32)
        result.update(fp32_losses=fp32_losses, bf16_vs_fp32_grad_rel=rel(reference, fp32))
    engine.destroy()
    return result


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
