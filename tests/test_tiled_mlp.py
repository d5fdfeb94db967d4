"""--tiled-mlp: every MLP through DeepSpeed's TiledMLP (launcher/components/ds_compat/sequence.py tiled_mlp, set on
the model by the engine builder), in process, fp32, on the debug model's MLP (dim 128, ffn 384 hidden).

The tiled MLP is the same math: each position's output depends on that position alone, so splitting the positions
changes no product; only each weight's gradient, a sum over every position of the batch, is summed tile by tile
instead of in one matrix product. Measured on this CPU (AMD EPYC, torch 2.13): the output and the input's gradient
bit-identical, the weights' gradients within 2.6e-7 of their norm here (5.7e-7 of their largest element over rows
of 32 to 1024 positions, 2 to 8 tiles, dim 128 and 768; one tile: bit-identical). The tolerance below, 1e-6 of a
gradient's norm (about 8 fp32 epsilons), is what a changed summation order can give and nothing else: a wrong tile
(one position of 512 given no incoming gradient) moves them by 6e-2 (`test_a_wrong_tiling_would_be_seen`).

The driver at --tiled-mlp with --sequence-parallel 2, ZeRO-3, on 2 ranks: tests/test_sequence_parallel_surfaces.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import free_port
from zerotrain.launcher.components import ds_compat
from zerotrain.modeling.model import MLP, Transformer, mlp_tiles, preset

ARGS = preset("debug")  # dim 128


def forward_backward(mlp: MLP, x: torch.Tensor, upstream: torch.Tensor):
    mlp.zero_grad()
    x = x.clone().requires_grad_(True)
    out = mlp(x)
    out.backward(upstream)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# (batch, positions): a whole row of 512 (4 tiles), its shard at --sequence-parallel 2 (256: 2 tiles) and 4 (128:
# one tile, still recomputed in backward), a length that does not divide into tiles (300: 3 tiles, the last short)
@pytest.mark.parametrize("batch,positions", [(2, 512), (2, 256), (2, 128), (1, 300)])
def test_tiled_mlp_output_and_every_gradient_equal_the_untiled(batch, positions):
    torch.manual_seed(0)
    mlp = MLP(ARGS)
    x, upstream = torch.randn(batch, positions, ARGS.dim), torch.randn(batch, positions, ARGS.dim)
    want = forward_backward(mlp, x, upstream)
    calls = []

    def tiled(module, inp, tiles):
        calls.append(tiles)
        return ds_compat.tiled_mlp(module, inp, tiles)

    mlp.tiled = tiled
    got = forward_backward(mlp, x, upstream)
    assert calls == [mlp_tiles(positions, ARGS.dim)] == [-(-positions // 128)]  # DeepSpeed's rule: ceil(T / dim)
    assert rel(got[0], want[0]) <= 1e-6 and rel(got[1], want[1]) <= 1e-6
    assert got[2].keys() == want[2].keys() == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    for name, grad in want[2].items():
        assert grad.abs().max() > 0 and rel(got[2][name], grad) <= 1e-6, (name, rel(got[2][name], grad))


def test_a_wrong_tiling_would_be_seen():
    """The tolerance tells a tiling that loses part of a tile from rounding: the last position's incoming gradient
    zeroed moves the weights' gradients far beyond 1e-6."""
    torch.manual_seed(0)
    mlp = MLP(ARGS)
    x, upstream = torch.randn(2, 256, ARGS.dim), torch.randn(2, 256, ARGS.dim)
    want = forward_backward(mlp, x, upstream)
    cut = upstream.clone()
    cut[:, -1] = 0
    mlp.tiled = ds_compat.tiled_mlp
    got = forward_backward(mlp, x, cut)
    assert min(rel(got[2][n], g) for n, g in want[2].items()) > 1e-3


def test_a_tiled_model_trains_what_the_untiled_model_trains():
    """The whole model (4 layers, packed documents) with every MLP tiled: the loss and every parameter's gradient
    within 1e-6 of the same model untiled."""
    torch.manual_seed(0)
    model = Transformer(preset("debug", vocab_size=300))
    ids = torch.randint(0, 300, (2, 512))
    pos = torch.cat([torch.arange(200), torch.arange(312)]).expand(2, 512)

    def run():
        model.zero_grad()
        loss = model(ids, pos, labels=ids)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want = run()
    for layer in model.layers:
        layer.mlp.tiled = ds_compat.tiled_mlp
    got = run()
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    for name, grad in want[1].items():
        assert rel(got[1][name], grad) <= 1e-6, name


ZERO3 = r"""
import json, os, sys
import deepspeed, torch
from deepspeed.utils import safe_get_full_grad
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.engine import EngineSpec, build_engine
from zerotrain.launcher.profiles import load_profile
from zerotrain.modeling.model import preset

_, profile = load_profile("cpu")  # ZeRO-3, stage3_param_persistence_threshold 0: every weight gathered at its use
ds_config = {**{k: v for k, v in profile.items() if k not in ("zerotrain", "optimizer")},
             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
             "zero_allow_untested_optimizer": True}
args = preset("debug", vocab_size=300)
torch.manual_seed(0)
ids = torch.randint(0, 300, (2, 512))
pos = torch.cat([torch.arange(200), torch.arange(312)]).expand(2, 512)
out = {}
for tiled in (False, True):
    engine = build_engine(EngineSpec(ds_config, args, seed=1, tiled_mlp=tiled,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))).engine
    mlps = [layer.mlp for layer in engine.module.layers]
    seen = {"partitioned": all(p.data.numel() == 0 for m in mlps for p in m.parameters())}  # none gathered yet
    loss = engine(ids, pos, labels=ids)
    nodes, todo = [], [loss.grad_fn]  # the autograd graph: which backward functions the forward recorded
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            todo += [n for n, _ in node.next_functions]
    seen["tiled_mlps"] = sum(type(n).__name__ == "TiledMLPBackward" for n in nodes)
    engine.backward(loss)
    out[tiled] = {"loss": loss.item(), "seen": seen,
                  "grads": {n: safe_get_full_grad(p).tolist() for n, p in engine.module.named_parameters()}}
    engine.destroy()
for path in ds_compat.allreduce_buffer_files(os.environ["MASTER_PORT"]):  # this process's, not a launch's beside it
    path.unlink(missing_ok=True)
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.launches
def test_tiled_mlp_at_zero3_gathers_its_weights_and_reduces_each_gradient_once(tmp_path):
    """build_engine with EngineSpec.tiled_mlp at ZeRO-3 (one rank, the cpu profile: no weight kept gathered): every
    MLP runs DeepSpeed's TiledMLP (its weights partitioned away before the forward, gathered by their modules' hooks
    in the tiles), and after DeepSpeed's reduction (`ds_grad_is_ready` held false until the last tile) the loss and
    every parameter's full gradient equal the untiled engine's within 1e-6 of their norm."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, "-c", ZERO3, str(tmp_path / "out.json")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    plain, tiled = out["false"], out["true"]
    assert tiled["seen"] == {"partitioned": True, "tiled_mlps": 4}  # every layer's MLP, from partitioned weights
    assert plain["seen"] == {"partitioned": True, "tiled_mlps": 0}
    assert abs(tiled["loss"] - plain["loss"]) <= 1e-6 * plain["loss"]
    assert tiled["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        want, got = torch.tensor(grad), torch.tensor(tiled["grads"][name])
        assert want.abs().max() > 0 and rel(got, want) <= 1e-6, (name, rel(got, want))


def test_tiled_mlp_is_part_of_the_run_id_once_given(mix_path):
    """Not bit-identical (the weights' gradients are summed tile by tile), so a run that changes it is another run:
    hashed once given (earlier runs' ids unchanged), and a resume that turns it off is drift."""
    from zerotrain.launcher.config_resolve import drift, identity, identity_hash, resolve_config

    plain, tiled = resolve_config(["--data", str(mix_path)]), resolve_config(["--data", str(mix_path), "--tiled-mlp"])
    assert "tiled_mlp" not in identity(plain) and identity(tiled)["tiled_mlp"] is True
    assert identity_hash(plain) != identity_hash(tiled)
    assert drift(plain, tiled.to_dict()) == ["tiled_mlp True -> None"]
