"""Ulysses sequence parallelism (modeling/model.py SequenceShard; launcher/components/engine.py builds it with
DeepSpeed's sequence-parallel mpu and all-to-all, ds_compat.py).

The proof is a real 2-rank `deepspeed` launch at SP=2 (tests/helpers/sp_harness.py): packed rows whose
documents start inside either half and span the seam, uneven label masks; ZeRO-2 and ZeRO-3, sdpa and flex,
kv heads dividing N and fewer kv heads than N, loss "mean" and "sum". The sum of the ranks' loss shares and
every parameter's full gradient after DeepSpeed's reduction equal, within 1e-6 relative, one unsharded
model's on the same whole batch.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import BIN, REPO, free_port
from zerotrain.modeling.model import ModelArgs, SequenceShard, check_sequence_parallel


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "helpers" / "sp_harness.py"), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_sp2_loss_and_every_gradient_equal_one_unsharded_rank(sp_results):
    cases = {(r["stage"], r["attention"], r["kv_heads"], r["reduction"]) for r in sp_results}
    assert {(3, "sdpa"), (3, "flex"), (2, "sdpa"), (2, "flex")} <= {c[:2] for c in cases}
    assert {1, 2} == {c[2] for c in cases} and {"mean", "sum"} == {c[3] for c in cases}
    for res in sp_results:
        assert abs(res["loss"] - res["reference_loss"]) <= 1e-6 * abs(res["reference_loss"]), res
        worst = max(res["grad_rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (res["stage"], res["attention"], res["kv_heads"], res["reduction"], worst)
        assert res["grad_max_abs"] > 0
        # each rank computed a real share: neither half's loss is the whole, nor zero
        assert all(0 < s < res["loss"] for s in res["shares"]), res["shares"]


def test_a_shard_holds_its_stretch_of_the_row():
    shard = SequenceShard(4, 2, lambda t: t)
    assert shard.local(32) == slice(16, 24)
    with pytest.raises(ValueError, match="divisible by 4"):
        shard.local(30)


@pytest.mark.parametrize("heads,kv,size,ok", [(4, 2, 2, True), (4, 1, 2, True), (8, 2, 4, True), (4, 4, 4, True),
                                               (6, 2, 4, False), (12, 6, 4, False), (8, 8, 1, True)])
def test_heads_must_split_over_the_sequence_parallel_ranks(heads, kv, size, ok):
    args = ModelArgs(dim=8 * heads, n_layers=1, n_heads=heads, n_kv_heads=kv, vocab_size=16)
    if ok:
        check_sequence_parallel(args, size)
    else:
        with pytest.raises(ValueError, match="sequence parallelism over"):
            check_sequence_parallel(args, size)


def test_unsharded_model_is_unchanged_by_the_shard_path():
    """Without a shard the forward is the model's own (the loss the chunked-loss tests hold equal to the
    full-logits definition)."""
    from zerotrain.modeling.model import Transformer, next_token_loss

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50))
    ids = torch.randint(0, 50, (2, 16))
    pos = torch.cat([torch.arange(5), torch.arange(11)]).expand(2, 16)
    assert torch.allclose(model(ids, pos, labels=ids), next_token_loss(model(ids, pos), ids), rtol=1e-6)
