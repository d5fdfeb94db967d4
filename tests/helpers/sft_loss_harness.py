"""Test harness for the token-weighted SFT loss under a real `deepspeed` launch (tests/test_data_sft.py).

Each rank takes ACCUM micro-batches of an SFT mix from its own loader (so the labelled-token
counts differ between micro-batches and between ranks), all-gathers its count (what the
trainer's pre-step all-gather carries), and runs one optimizer step of the debug model under
ZeRO-3 (the cpu profile's settings, gradient clipping off, plain SGD so the weight change IS
-lr x the gradient DeepSpeed produced) with each micro-batch's loss SUM scaled by
`global_token_mean_scale` before `engine.backward`, exactly as the trainer is to do it.
Rank 0 then recomputes, in one process on a plain copy of the initial weights and on every
rank's micro-batches, the reference: the gradient of (sum of all token losses) / (all labelled
tokens); and, for contrast, the gradient of the mean of per-micro-batch means (what a wrong
reduction gives). Rank 0 writes OUT_DIR/result.json.

Usage: deepspeed --num_gpus 2 tests/helpers/sft_loss_harness.py MIX.json OUT_DIR
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)
warnings.filterwarnings("ignore", category=FutureWarning)

SEED, SEQ_LEN, MICRO, ACCUM, LR = 1234, 64, 2, 2, 0.5


def main(mix: str, out_dir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from zerotrain.dataio.pipeline.loader import MODEL_KEYS, load_data, make_loader, open_data, trainable_tokens
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.loss import global_token_mean_scale, next_token_loss
    from zerotrain.modeling.model import Transformer, preset

    dist, _ = init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(open_data(mix, ByteTokenizer()), None, world, 0, seq_len=SEQ_LEN)
    loader = make_loader(data, rank, world, SEED, SEQ_LEN, MICRO)
    batches = [loader.next_batch() for _ in range(ACCUM)]
    counts = [trainable_tokens(b) for b in batches]
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor([sum(counts)], dtype=torch.int64))  # the trainer's pre-step all-gather
    n_global = int(sum(int(t) for t in every))

    _, profile = load_profile("cpu")
    ds_config = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
    ds_config.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=ACCUM,
                     train_batch_size=MICRO * ACCUM * world, gradient_clipping=0.0,
                     zero_allow_untested_optimizer=True)
    args = preset("debug", vocab_size=data.tokenizer.vocab_size)
    engine = build_engine(EngineSpec(ds_config, args, seed=SEED,  # the cpu profile: ZeRO-3 under zero.Init
                                     optimizer=lambda params: torch.optim.SGD(params, lr=LR))).engine
    model = engine.module

    def whole_weights() -> dict:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # collective: every rank
            return {n: p.detach().clone().double() for n, p in model.named_parameters()} if rank == 0 else {}

    before = whole_weights()  # as built: no step taken yet
    scale = global_token_mean_scale(ACCUM, world, n_global)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for b in batches:
        loss = engine(**{k: b[k] for k in MODEL_KEYS}, loss_reduction="sum") * scale
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().double()
    dist.all_reduce(loss_sum)
    step_loss = float(loss_sum) / (ACCUM * world)  # what the trainer logs (StepRunner.agree)
    after = whole_weights()
    everyone = [None] * world
    dist.all_gather_object(everyone, [{k: b[k] for k in MODEL_KEYS} for b in batches])
    if rank != 0:
        return

    plain = Transformer(args).double()
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(before[n])
    micro = [b for rank_batches in everyone for b in rank_batches]

    def gradient(loss_fn) -> tuple[dict, float]:
        plain.zero_grad()
        loss = loss_fn()
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in plain.named_parameters()}, loss.item()

    def token_mean():
        total = sum(next_token_loss(plain(b["input_ids"], b["position_ids"]), b["labels"], "sum") for b in micro)
        return total / sum(trainable_tokens(b) for b in micro)

    def mean_of_means():
        return sum(plain(**b) for b in micro) / len(micro)

    reference, ref_loss = gradient(token_mean)
    naive, naive_loss = gradient(mean_of_means)
    deepspeed_grad = {n: (before[n] - after[n]) / LR for n in before}

    def rel_err(other: dict) -> float:
        return max(float((deepspeed_grad[n] - other[n]).norm() / other[n].norm().clamp_min(1e-30)) for n in other)

    result = {"world": world, "counts": [c for r in everyone for c in [trainable_tokens(b) for b in r]],
              "n_global": n_global, "step_loss": step_loss, "reference_loss": ref_loss, "naive_loss": naive_loss,
              "grad_rel_err": rel_err(reference), "naive_rel_err": rel_err(naive),
              "tensors": len(reference)}
    Path(out_dir, "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
