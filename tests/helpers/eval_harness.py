"""Test harness for launcher/components/evaluate.py under a real `deepspeed` launch (tests/test_evaluate.py).

Every rank: loads a mix, splits off the holdout, builds its eval rows, then cuts them so that
the ranks hold UNEVEN numbers of rows (source 1: an odd count; source 2: one row, so rank 1 has
none); builds the debug model under ZeRO-3 (the cpu profile's settings); trains one step on the
training stores, evaluates, trains another step, evaluates again. Then the full weights are
gathered and rank 0 evaluates the same rows in one process on a plain (non-DeepSpeed) copy of the
model, with the Evaluator (world 1, another micro-batch) and with a direct token-sum formula.
Each rank also counts its own all-gathers during an evaluation (ZeRO-3 really gathers per pass).
Each rank writes OUT_DIR/rank{r}.json; the test compares them.

Usage: deepspeed --num_gpus 2 tests/helpers/eval_harness.py MIX.json OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)

warnings.filterwarnings("ignore", category=FutureWarning)

SEED, SEQ_LEN, MICRO_BATCH, EVAL_TOKENS = 1234, 64, 2, 3000
ROWS = (5, 1)  # rows kept per source: 3 + 2 and 1 + 0 across 2 ranks


GATHERS = [0]  # DeepSpeed parameter all-gathers on this rank


def count_gathers() -> None:
    """Count every call of deepspeed.comm.allgather_fn (ZeRO-3's parameter gathers) in GATHERS."""
    import deepspeed.comm as ds_comm

    original = ds_comm.allgather_fn

    def counting(*args, **kwargs):
        GATHERS[0] += 1
        return original(*args, **kwargs)

    ds_comm.allgather_fn = counting  # looked up at each call by deepspeed.runtime.zero


def main(mix: str, out_dir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from zerotrain.dataio.pipeline.loader import cut_data, make_loader, open_data
    from zerotrain.dataio.sources.holdout import holdout_rows, split_holdout
    from zerotrain.dataio.sources.readers import load_text_source
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.components.evaluate import Evaluator
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.model import Transformer, preset

    dist, _ = init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    data = open_data(mix, ByteTokenizer())  # what load_data does, with the holdout before the cut
    stores = [load_text_source(s) for s in data.specs]
    train_stores, eval_stores = split_holdout(stores, data.specs, SEED, EVAL_TOKENS, data.tokenizer)
    data = cut_data(data, train_stores, None, world)
    full = holdout_rows(eval_stores, data.specs, data.tokenizer, SEQ_LEN)
    rows = {name: {k: v[:keep] for k, v in r.items()} for (name, r), keep in zip(full.items(), ROWS)}

    _, profile = load_profile("cpu")
    ds_config = {k: v for k, v in profile.items() if k != "zerotrain"}
    ds_config.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1,
                     train_batch_size=MICRO_BATCH * world)
    # Gather and release the parameters in every forward pass, as ZeRO-3 does for a model larger
    # than its prefetch / live-parameter limits. With the defaults the whole debug model stays
    # gathered after the first eval pass, and a rank that skipped passes would not hang (tried:
    # without the padding passes this launch hangs with these settings and passes without them).
    ds_config["zero_optimization"] = {**ds_config["zero_optimization"], "stage3_max_live_parameters": 0,
                                      "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    args = preset("debug", vocab_size=data.tokenizer.vocab_size)
    built = build_engine(EngineSpec(ds_config, args, seed=SEED))  # the cpu profile: ZeRO-3 under zero.Init
    engine, held = built.engine, built.held

    forwards = [0]
    engine.module.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    loader = make_loader(data, rank, world, SEED, SEQ_LEN, MICRO_BATCH)

    def train_step():
        batch = loader.next_batch()
        loss = engine(**{k: batch[k] for k in ("input_ids", "position_ids", "labels")})
        engine.backward(loss)
        engine.step()

    evaluator = Evaluator(rows, rank, world, MICRO_BATCH)
    own_rows = {name: len(r["input_ids"][rank::world]) for name, r in rows.items()}
    train_step()
    forwards[0] = 0
    count_gathers()
    first = evaluator.evaluate(engine)
    eval_forwards, eval_gathers = forwards[0], GATHERS[0]
    training_after = engine.module.training
    train_step()
    second = evaluator.evaluate(engine)

    # The same weights, whole, in a plain model on rank 0 (gathering is collective: all ranks).
    state = {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if rank == 0:
            state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    result = {"rank": rank, "world": world, "held_params": held, "own_rows": own_rows,
              "eval_forwards": eval_forwards, "eval_gathers": eval_gathers,
              "param_tensors": len(list(engine.module.parameters())), "forward_passes": evaluator.forward_passes,
              "training_after": training_after, "first": first, "second": second}
    if rank == 0:
        plain = Transformer(args)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(state[n])
        result["single_process"] = Evaluator(rows, 0, 1, micro_batch=3).evaluate(plain)
        plain.eval()
        direct = {}
        with torch.no_grad():  # sum of every token's loss, one row at a time: no Evaluator arithmetic
            for name, r in rows.items():
                loss_sum, n_tokens = 0.0, 0
                for i in range(len(r["input_ids"])):
                    logits = plain(r["input_ids"][i:i + 1], r["position_ids"][i:i + 1])
                    labels = r["labels"][i:i + 1, 1:].flatten()
                    loss_sum += float(F.cross_entropy(logits[0, :-1].double(), labels, ignore_index=-100,
                                                      reduction="sum"))
                    n_tokens += int((labels != -100).sum())
                direct[name] = (loss_sum, n_tokens)
        result["direct"] = {"val_loss": sum(s for s, _ in direct.values()) / sum(n for _, n in direct.values()),
                            "val_loss_per_source": {k: s / n for k, (s, n) in direct.items()},
                            "val_tokens": sum(n for _, n in direct.values())}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # the deepspeed launcher adds it
