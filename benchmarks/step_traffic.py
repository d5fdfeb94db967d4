"""Bytes a training step reads and writes per parameter, by optimizer wrapper: DeepSpeed's ZeRO paths at a world of
1 (bf16, grad-accum 1, clipping 1.0, fused AdamW) against a plain loop's (fp32 master weights, `_foreach_copy_` of
the bf16 gradients, `clip_grad_norm_`, fused AdamW: benchmarks/peer_loops.py's C). Counted on the CPU, one op at a
time (a TorchDispatchMode: the bytes of every distinct tensor each ATen op takes or returns, an in-place op's
destination once; views move nothing and are not counted), so the figure does not depend on the machine: on a GPU the step's copies, casts and reductions are
memory-bound, and what a wrapper moves beyond the plain loop is time the model's kernels do not get back
(benchmarks/RESULTS.md, 2026-11-28: B 9% behind C on one H100 with the same model kernels).

    python benchmarks/step_traffic.py [--variants zero2,zero2-bf16-accum,...] [--depth 4] [--micro 2] [--seq 64]

Each variant runs in its own process (a DeepSpeed engine joins a process group of 1), 4 steps on the same rows:
its losses (equal losses say the variant trains the same), and the 4th step's bytes per parameter, by op. A tool
for locating where a step's time goes on a device we do not have, not a timing: `make bench` times.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# name -> (ZeRO stage or None for the plain loop, data_types.grad_accum_dtype)
VARIANTS = {
    "plain": (None, None),
    "zero2": (2, "fp32"),  # what one GPU runs (profiles.one_device_stage; accumulate_in_fp32)
    "zero2-bf16-accum": (2, "bf16"),
    "zero1-bf16-accum": (1, "bf16"),
    "zero3": (3, "fp32"),
    "zero1-fp32-accum": (1, "fp32"),  # DeepSpeed swaps in BF16_Optimizer here
}
STEPS = 4


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--depth", type=int, default=4, help="the depth rule's model (head dim 64)")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a variant, in this process (the parent starts these)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(count(a, a.one)))
        return
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"step_traffic: unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    results = {}
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--depth", str(a.depth), "--micro",
                               str(a.micro), "--seq", str(a.seq)], capture_output=True, text=True,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        if proc.returncode:
            raise SystemExit(f"step_traffic: {name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(table(results))


def table(results: dict) -> str:
    base = results.get("plain")
    first = next(iter(results.values()))
    lines = [f"debug-rule model of {first['params']:,} parameters, micro-batch x seq {first['shape']}, bf16, world 1,"
             f" step {STEPS} of {STEPS}; bytes per parameter a step (every op's inputs and outputs)", "",
             "| variant | optimizer wrapper | bytes/param | over plain | losses (steps 1-4) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        over = f"{r['total'] - base['total']:+.1f}" if base else "n/a"
        losses = ", ".join(f"{x:.9g}" for x in r["losses"])
        lines.append(f"| {name} | {r['wrapper']} | {r['total']:.1f} | {over} | {losses} |")
    lines.append("")
    ops = sorted({op for r in results.values() for op in r["by_op"]},
                 key=lambda op: -max(r["by_op"].get(op, 0.0) for r in results.values()))
    lines.append("| op | " + " | ".join(results) + " |")
    lines.append("|---|" + "---|" * len(results))
    for op in ops:
        row = [results[n]["by_op"].get(op, 0.0) for n in results]
        if max(row) >= 0.5:
            lines.append(f"| {op} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    return "\n".join(lines)


def count(a, name: str) -> dict:
    """One variant, in this process: 4 steps, the last counted."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from harness import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from zerotrain.modeling import sizes

    args = sizes.depth_args(a.depth, 64, 64, vocab_size=256, max_seq_len=a.seq)
    stage, accum = VARIANTS[name]
    step, wrapper = plain_step(args) if stage is None else engine_step(args, stage, accum, a.micro)
    params = sizes.count_params(args)["total"]

    class Bytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_op = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "_unsafe_view", "alias"):
                # each tensor once per op (an in-place op's result is its input; a foreach op's are its list)
                tensors = {(t.data_ptr(), t.numel() * t.element_size()) for t in tree_flatten((args, kwargs, out))[0]
                           if isinstance(t, torch.Tensor)}
                self.by_op[func.overloadpacket.__name__] += sum(size for _, size in tensors)
            return out

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (a.micro, a.seq), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(a.seq).repeat(a.micro, 1), "labels": ids.clone()}
    losses, counted = [], Bytes()
    for i in range(STEPS):
        if i == STEPS - 1:
            with counted:
                losses.append(step(batch))
        else:
            losses.append(step(batch))
    by_op = {k: v / params for k, v in counted.by_op.items()}
    return {"params": params, "shape": f"{a.micro} x {a.seq}", "wrapper": wrapper, "losses": losses,
            "total": sum(by_op.values()), "by_op": by_op}


def engine_step(args, stage: int, accum: str, micro: int):
    """DeepSpeed's step as one GPU runs it (profiles.one_device_stage: no overlap_comm, no contiguous_gradients)."""
    from zerotrain.launcher.components.engine import EngineSpec, build_engine

    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": micro,
          "gradient_clipping": 1.0, "bf16": {"enabled": True, "check_grad_overflow": False},
          "data_types": {"grad_accum_dtype": accum}, "steps_per_print": 10**9,
          "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": False},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True, "fused": True}},
          "timers": {"throughput": {"enabled": False}}}
    engine = build_engine(EngineSpec(ds, args, seed=1)).engine

    def step(batch):
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, type(engine.optimizer).__name__


def plain_step(args):
    """benchmarks/peer_loops.py's C step: bf16 parameters, fp32 master weights stepped by fused AdamW."""
    import torch

    from zerotrain.modeling.model import Transformer

    torch.manual_seed(1)
    model = Transformer(args).to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(master, lr=3e-4, fused=True)

    def step(batch):
        loss = model(**batch)
        loss.backward()
        with torch.no_grad():
            for m in master:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m in master], [p.grad for p in params])  # bf16 -> fp32
            torch.nn.utils.clip_grad_norm_(master, 1.0, foreach=True)
            opt.step()
            torch._foreach_copy_(params, master)  # fp32 -> bf16
        for p in params:
            p.grad = None
        return loss.item()
    return step, "torch.optim.AdamW(fused) on fp32 masters"


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main(sys.argv[1:])
