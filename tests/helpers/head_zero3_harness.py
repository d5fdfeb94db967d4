"""Test harness for the chunked loss under ZeRO-3 (tests/test_chunked_loss.py), under a real `deepspeed` launch.

For an untied and a tied head: the model is built under `deepspeed.zero.Init` (the cpu profile's ZeRO-3
settings, fp32), its head split into 8 chunks per micro-batch; one forward + backward of the same
batch on every rank, with DeepSpeed's parameter coordinator counting the fetches of lm_head's
parameters (the only way ZeRO-3 gathers them: around that module's own forward and backward).
The loss and the full gradients (`safe_get_full_grad`) are compared with a plain model holding the
same weights and computing the loss on full logits (`next_token_loss`). Rank 0 writes OUT_DIR/result.json.

Usage: deepspeed --num_gpus 2 tests/helpers/head_zero3_harness.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)
warnings.filterwarnings("ignore", category=FutureWarning)

B, T, CHUNK = 2, 32, 8  # 64 positions: 8 chunks


def main(out_dir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.utils import safe_get_full_grad

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.components.process_group import init_process_group
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.loss import next_token_loss
    from zerotrain.modeling.model import ModelArgs, Transformer

    init_process_group()
    rank = dist.get_rank()
    _, profile = load_profile("cpu")
    ds_config = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
    ds_config.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1,
                     train_batch_size=B * dist.get_world_size(), zero_allow_untested_optimizer=True,
                     zero_optimization={**ds_config["zero_optimization"], "stage": 3})
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 200, (B, T), generator=g)
    pos = torch.cat([torch.arange(11), torch.arange(T - 11)]).expand(B, T)
    labels = x.clone()
    labels[0, :5] = -100
    results = []
    for tied in (False, True):
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=200, tie_embeddings=tied)
        engine = build_engine(EngineSpec(ds_config, args, seed=1,
                                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))).engine
        model = engine.module
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # as built: no step taken yet
            whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.lm_head.chunk_tokens = CHUNK
        fetches = {"forward": 0, "backward": 0}
        original = PartitionedParameterCoordinator.fetch_sub_module

        def counting(self, current_submodule, forward):
            if current_submodule is model.lm_head:
                fetches["forward" if forward else "backward"] += 1
            return original(self, current_submodule, forward)

        with mock.patch.object(PartitionedParameterCoordinator, "fetch_sub_module", counting):
            loss = engine(x, pos, labels=labels)
            engine.backward(loss)
        grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}  # collective
        plain = Transformer(args)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(whole[n])
        reference = next_token_loss(plain(x, pos), labels)
        reference.backward()
        err = max(float((grads[n] - p.grad).abs().max()) for n, p in plain.named_parameters())
        results.append({"tied": tied, "chunks": -(-B * T // CHUNK), "head_fetches": fetches, "loss": loss.item(),
                        "reference_loss": reference.item(), "grad_max_err": err})
        engine.destroy() if hasattr(engine, "destroy") else None
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
