"""Test harness for regional compilation (tests/test_gpu_speed.py): eager against compiled engines, in one process.

For each case (ZeRO stage, activation checkpointing, tiled MLP) two engines are built through build_engine from the
same seed, fp32, on the CPU: one eager, one with every block compiled by inductor (engine.compile_blocks, what
--compile and the GPU profiles' zerotrain.compile do). Each takes one forward and backward of the same packed
batch, its document layout made on the host as the trainer makes it (Transformer.document_layout); the loss and
every parameter's full gradient (DeepSpeed's safe_get_full_grad) are written to OUT_DIR/result.json with how
many graphs dynamo compiled.

Usage: python tests/helpers/compile_harness.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore", category=FutureWarning)

B, T = 2, 128
CASES = [(2, True, True), (3, False, False)]  # (stage, activation checkpointing, tiled MLP)


def main(out_dir: str) -> None:
    import torch
    from deepspeed.utils import safe_get_full_grad
    from torch._dynamo.utils import counters

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.launcher.run_plan import single_process_env
    from zerotrain.modeling.model import preset

    single_process_env()
    _, profile = load_profile("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 300, (B, T), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(T - 40)]).expand(B, T).contiguous()  # two documents a row
    labels = x.clone()
    results = []
    for stage, checkpointing, tiled in CASES:
        ds_config = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
        ds_config.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1, train_batch_size=B,
                         zero_allow_untested_optimizer=True,
                         zero_optimization={**ds_config["zero_optimization"], "stage": stage})
        case = {"stage": stage, "checkpointing": checkpointing, "tiled": tiled}
        for compiled in (False, True):
            graphs_before = counters["stats"]["unique_graphs"]
            spec = EngineSpec(ds_config, preset("debug", vocab_size=300), seed=1, attention="sdpa",
                              activation_checkpointing=checkpointing, tiled_mlp=tiled, compile=compiled,
                              compile_backend="inductor", optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
            engine = build_engine(spec).engine
            model = engine.module
            engine.train()
            loss = engine(x, pos, labels=labels, documents=model.document_layout(pos, engine.device))
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
            case["compiled" if compiled else "eager"] = {
                "loss": loss.item(), "graphs": counters["stats"]["unique_graphs"] - graphs_before,
                "grads": {n: g.flatten().tolist() for n, g in grads.items()}}
            engine.destroy() if hasattr(engine, "destroy") else None
        results.append(case)
    Path(out_dir, "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
