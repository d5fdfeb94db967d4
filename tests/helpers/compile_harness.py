"""Test harness for regional compilation (tests/test_gpu_speed.py): eager against compiled engines, one launch.

Under `deepspeed --num_gpus 2` (2 CPU ranks over gloo). For each case (ZeRO stage, activation checkpointing, tiled
MLP, sequence parallelism) two engines are built through build_engine from the same seed, fp32: one eager, one with
every block compiled by inductor (engine.compile_blocks, what --compile and the GPU profiles' zerotrain.compile do).
Each takes one forward and backward of the same packed batch (data parallel: each rank its own rows; SP=2: both
ranks the same whole rows), its document layout made on the host as the trainer makes it
(Transformer.document_layout). Rank 0 writes OUT_DIR/result.json, per case: every rank's loss from each engine,
how many graphs dynamo compiled for each, and per parameter the largest difference between the two engines' full
gradients (DeepSpeed's safe_get_full_grad, after the reduction) beside the gradient's largest magnitude. Also, from
each engine's gradients, DeepSpeed's Muon update of every matrix it would orthogonalize (`muon_update` as ZeRO-1/2
call it, first step: zero momentum; run eagerly under `force_eager`, the arithmetic of its compiled form without
inductor's minutes per matrix shape): per matrix the largest compiled-vs-eager difference, and the eager update
against the same update with its Newton-Schulz in fp64 (what DeepSpeed's own precision rounds: the scale to judge
the first by).

Exact resume, compiled (the first case's engine, AdamW as the client optimizer): after its gradients it steps, saves
a checkpoint, and trains STEPS_AFTER more steps; a second compiled engine, built fresh, loads the checkpoint and
trains the same steps: their losses and final weights are recorded for a bit-for-bit comparison.

Usage: deepspeed --num_gpus 2 tests/helpers/compile_harness.py OUT_DIR
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

B, T, VOCAB, STEPS_AFTER = 2, 128, 300, 2
CASES = [(2, True, True, 1), (3, False, False, 1), (2, True, False, 2)]  # (stage, checkpointing, tiled MLP, SP)


def batch(rank: int, step: int, sp: int):
    """(ids, positions, labels): two documents a row; each data-parallel rank its own rows (SP: one row group)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + (0 if sp > 1 else rank))
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(T - 40)]).expand(B, T).contiguous()
    return ids, pos, ids.clone()


def main(out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from zerotrain.launcher.components.process_group import init_process_group

    init_process_group()
    rank = dist.get_rank()
    results = []
    for stage, checkpointing, tiled, sp in CASES:
        case = {"stage": stage, "checkpointing": checkpointing, "tiled": tiled, "sp": sp}
        ran = {}
        for compiled in (False, True):
            graphs_before = counters["stats"]["unique_graphs"]
            engine = build(stage, checkpointing, tiled, sp, compiled)
            losses, grads = forward_backward(engine, batch(rank, 0, sp))
            ran[compiled] = {"losses": losses, "graphs": counters["stats"]["unique_graphs"] - graphs_before,
                             "grads": grads, "muon": muon_updates(engine.module, grads)}
            if compiled and (stage, checkpointing, tiled, sp) == CASES[0]:
                case["resume"] = resumed_compiled(engine, (stage, checkpointing, tiled, sp), Path(out_dir))
            engine.destroy()
        eager, compiled = ran[False], ran[True]
        case.update({key: [eager[key], compiled[key]] for key in ("losses", "graphs")},
                    grad_diff=differences(eager["grads"], compiled["grads"]), grad_max=largest(eager["grads"]),
                    muon_diff=differences(eager["muon"], compiled["muon"]), muon_max=largest(eager["muon"]),
                    muon_rounding=differences(eager["muon"], muon_updates(None, {n: eager["grads"][n] for n in eager["muon"]}, fp64=True)))
        results.append(case)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(results, indent=1))


def differences(a: dict, b: dict) -> dict:
    """{name: the largest element-wise |a - b|} (the same names in both)."""
    assert a.keys() == b.keys()
    return {n: float((a[n].double() - b[n].double()).abs().max()) for n in a}


def largest(tensors: dict) -> dict:
    return {n: float(t.abs().max()) for n, t in tensors.items()}


def build(stage: int, checkpointing: bool, tiled: bool, sp: int, compiled: bool):
    import torch

    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.model import preset

    _, profile = load_profile("cpu")
    world = torch.distributed.get_world_size()
    ds_config = {k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")}
    ds_config.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1, train_batch_size=B * world // sp,
                     zero_allow_untested_optimizer=True, zero_optimization={**ds_config["zero_optimization"],
                                                                            "stage": stage})
    spec = EngineSpec(ds_config, preset("debug", vocab_size=VOCAB), seed=1, attention="sdpa",
                      activation_checkpointing=checkpointing, tiled_mlp=tiled, compile=compiled,
                      compile_backend="inductor", sequence_parallel=sp,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    engine = build_engine(spec).engine
    engine.train()
    return engine


def forward_backward(engine, rows) -> tuple[list[float], dict]:
    """Every rank's loss (its rows', or its share of the row group's) and every parameter's full gradient."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    ids, pos, labels = rows
    model = engine.module
    loss = engine(ids, pos, labels=labels, documents=model.document_layout(pos, engine.device))
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}  # a collective
    losses = [torch.zeros(()) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(losses, loss.detach())
    return [x.item() for x in losses], grads


def muon_updates(model, grads: dict, fp64: bool = False) -> dict:
    """DeepSpeed's Muon update (deepspeed/runtime/zero/muon/original_muon.py muon_update, as ZeRO-1/2 call it:
    DeepSpeed's default beta and "gram" Newton-Schulz, zero momentum) of each matrix Muon would take
    (optimizers.layer_is_muon; model None: the matrices of `grads` already chosen), from `grads`. fp64: the same
    update with the Newton-Schulz in fp64."""
    import torch
    from deepspeed.runtime.zero.muon import original_muon

    from zerotrain.launcher.optimizers import layer_is_muon

    chosen = original_muon.ns_compute_dtype
    if fp64:
        original_muon.ns_compute_dtype = lambda method="gram": torch.float64
    try:
        with torch.compiler.set_stance("force_eager"):
            names = grads if model is None else [n for n, p in model.named_parameters() if layer_is_muon(n, p)]
            return {n: original_muon.muon_update(grads[n].double() if fp64 else grads[n].clone(),
                                                 torch.zeros_like(grads[n], dtype=torch.float64 if fp64 else None))
                    for n in names}
    finally:
        original_muon.ns_compute_dtype = chosen


def resumed_compiled(engine, case: tuple, out: Path) -> dict:
    """The compiled engine steps, saves, trains on; a fresh compiled engine loads the save and trains the same."""
    import torch

    rank, sp = torch.distributed.get_rank(), case[3]
    engine.step()
    ckpt = out / "checkpoint"
    engine.save_checkpoint(str(ckpt), tag="step1")

    def train_on(e) -> list[float]:
        losses = []
        for step in range(1, STEPS_AFTER + 1):
            loss, _ = forward_backward(e, batch(rank, step, sp))
            e.step()
            losses.append(loss)
        return losses

    def weights(e) -> list[list[float]]:
        from deepspeed.utils import safe_get_full_fp32_param

        return [safe_get_full_fp32_param(p).flatten().tolist() for p in e.module.parameters()]

    continued = train_on(engine)
    continued_weights = weights(engine)
    again = build(*case, compiled=True)
    again.load_checkpoint(str(ckpt), tag="step1")
    resumed = train_on(again)
    result = {"continued": continued, "resumed": resumed, "weights_equal": weights(again) == continued_weights,
              "compiled_again": all(getattr(layer, "_compiled_call_impl", None) is not None
                                    for layer in again.module.layers)}
    again.destroy()
    return result


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
