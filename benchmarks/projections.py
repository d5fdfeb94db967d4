"""`fused_projections`: do one qkv weight and one gate_up weight per layer pay
on this machine? Our model as it is (q/k/v and gate/up as separate nn.Linear, the Hugging Face
names the exporter and importer keep) against the same model rebuilt with fused weights (the same
values concatenated, the same math: the loss of the first batch is printed for both), alternated
over repetitions of forward + backward + fused AdamW step, 1 process, all cores. Medians.

The model keeps separate projections unless this benchmark shows the fused form faster: on the
2-core development machine it was slower (see benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types

from harness import TINY

REPS = int(os.environ.get("BENCH_REPS", "2" if TINY else "8"))


def fuse(model):
    """The same model with one qkv and one gate_up weight per layer (values copied, same forward)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def project(self, x):  # Attention.project with one weight: the rest of the forward is the model's own
        return F.linear(x, self.qkv).split(self.split, dim=-1)

    def mlp(self, x):
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    for block in model.layers:
        a, m = block.self_attn, block.mlp
        weights = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        a.qkv = nn.Parameter(torch.cat(weights).detach().clone())
        a.split = tuple(w.shape[0] for w in weights)
        del a.q_proj, a.k_proj, a.v_proj
        a.project = types.MethodType(project, a)
        m.gate_up = nn.Parameter(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().clone())
        del m.gate_proj, m.up_proj
        m.forward = types.MethodType(mlp, m)
    return model


def bench_fused_projections() -> list[dict]:
    import torch

    from zerotrain.modeling.model import Transformer
    from step_worker import model_args

    rows = []
    shapes = (("debug", 64, 2),) if TINY else (("debug", 256, 8), ("d8", 256, 4))
    for shape, seq, micro in shapes:
        models = {}
        for fused in (False, True):
            torch.manual_seed(0)
            model = Transformer(model_args(argparse.Namespace(shape=shape, seq=seq)))
            models[fused] = fuse(model) if fused else model
        opts = {f: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for f, m in models.items()}
        gen = torch.Generator().manual_seed(0)
        batch = {"input_ids": torch.randint(0, 256, (micro, seq), generator=gen),
                 "position_ids": torch.arange(seq).repeat(micro, 1)}
        batch["labels"] = batch["input_ids"]
        with torch.no_grad():
            first = {f: m(**batch).item() for f, m in models.items()}
        times = {False: [], True: []}
        for rep in range(REPS + 1):  # the first round is warm-up
            for fused in (False, True):
                t0 = time.perf_counter()
                loss = models[fused](**batch)
                loss.backward()
                opts[fused].step()
                opts[fused].zero_grad(set_to_none=True)
                loss.item()
                if rep:
                    times[fused].append(time.perf_counter() - t0)
        sep, fus = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"benchmark": f"fused projections ({shape})",
                     "setting": f"seq {seq} x micro {micro}, 1 process x {torch.get_num_threads()} threads, fp32,"
                                f" n={REPS}",
                     "result": f"separate q/k/v, gate/up {sep * 1e3:,.1f} ms/step; fused qkv, gate_up {fus * 1e3:,.1f}"
                               f" ms/step: {sep / fus:.3f}x (first loss {first[False]:.6f} vs {first[True]:.6f})",
                     "target": "fuse only if > 1.0x"})
    return rows
