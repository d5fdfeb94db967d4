"""Ulysses sequence parallelism (modeling/model.py SequenceShard; launcher/components/engine.py builds it with
DeepSpeed's sequence-parallel mpu and all-to-all, ds_compat.py).

The proof is a real 2-rank `deepspeed` launch at SP=2 (tests/helpers/sp_harness.py): packed rows whose
documents start inside either half and span the seam, uneven label masks; ZeRO-2 and ZeRO-3, sdpa, flex and
varlen (torch's varlen_attn over the plain-PyTorch flash reference, tests/helpers/reference_flash.py),
kv heads dividing N and fewer kv heads than N, loss "mean" and "sum", activation checkpointing once. The sum of the ranks' loss shares and
every parameter's full gradient after DeepSpeed's reduction equal, within 1e-6 relative, one unsharded
model's on the same whole batch.

Through the driver (`--sequence-parallel 2`, 2 ranks under the deepspeed launcher, the cpu profile: ZeRO-3,
fp32, best-fit packed documents): killed with kill -9 after its step-3 save, resumed bit for bit; and every
step's loss and every evaluation within 1e-6 relative of one rank training the same global batch (its loader
is the SP group's).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from conftest import BIN, REPO, free_port, launch, read_metrics
from test_offload_runs import N, SAVE, kill_after_save, resumed_same
from test_resume_exact import stop_at
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
    assert {(3, "sdpa"), (3, "flex"), (2, "sdpa"), (2, "flex"), (3, "varlen"), (2, "varlen")} <= {c[:2] for c in cases}
    assert {1, 2} == {c[2] for c in cases} and {"mean", "sum"} == {c[3] for c in cases}
    assert any(r["activation_checkpointing"] for r in sp_results)
    for res in sp_results:
        assert abs(res["loss"] - res["reference_loss"]) <= 1e-6 * abs(res["reference_loss"]), res
        worst = max(res["grad_rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (res["stage"], res["attention"], res["kv_heads"], res["reduction"], worst)
        assert res["grad_max_abs"] > 0
        # each rank computed a real share: neither half's loss is the whole, nor zero
        assert all(0 < s < res["loss"] for s in res["shares"]), res["shares"]


def test_varlen_under_sp_is_given_whole_rows_of_half_the_heads_and_their_documents(sp_results):
    """The varlen cases ran torch's varlen_attn with the plain-PyTorch flash reference as its CPU kernel
    (tests/helpers/reference_flash.py; equal to one unsharded rank above): after the exchange each rank's kernel
    call held both whole rows flattened (2 x 32 positions), 4 / 2 query heads and one kv head of its own, and
    the whole rows' document boundaries, once per layer."""
    varlen = [r for r in sp_results if r["attention"] == "varlen"]
    assert len(varlen) == 2
    whole_rows = [0, 11, 24, 32, 52, 57, 64]  # DOCS of sp_harness.py, end to end
    for res in varlen:
        assert len(res["kernel_calls"]) == 2  # 2 layers, one forward
        for call in res["kernel_calls"]:
            assert call["q"] == [64, 2, 16] and call["k"] == [64, 1, 16], call
            assert call["cu"] == whole_rows and call["max_q"] == 20


def test_a_cuda_node_plans_sequence_parallelism_with_the_varlen_kernel(mix_path, tmp_path, capsys):
    """On an 8 x H100 profile (a dry run plans its hardware), auto resolves to varlen in bf16 and SP=2 keeps it:
    the kernel is given whole rows after the exchange, as the varlen cases of the harness prove on a CPU."""
    from zerotrain.launcher.config import config_from
    from zerotrain.launcher.trainer import dry_run

    cfg = config_from({"data": str(mix_path), "out": str(tmp_path / "runs"), "seq_len": 256, "model": "debug",
                       "profile": "h100-80g-x8", "sequence_parallel": 2})
    assert dry_run(cfg).exit_code == 0
    out = capsys.readouterr().out
    assert "attention: varlen (auto on cuda, bf16)" in out and "rows shared by 2 ranks" in out, out[-2000:]
    assert not (tmp_path / "runs").exists()


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


BAD = {  # (flags, world, what the one line says); the debug model: 4 heads, 2 kv heads; --seq-len 256. kv heads
    # incompatible with N: test_heads_must_split_over_the_sequence_parallel_ranks (no preset has such heads); varlen
    # where SP cannot use it: on a CPU the kernel itself is refused (test_attention), with SP or without
    "on one rank": (["--sequence-parallel", "2"], 1, "needs more than one rank; this launch has 1"),
    "not dividing the world": (["--sequence-parallel", "3"], 4, "must divide the world size 4"),
    "not dividing seq-len": (["--sequence-parallel", "2", "--seq-len", "255"], 2, "must divide --seq-len 255"),
    "heads": (["--sequence-parallel", "3", "--seq-len", "255"], 3, "needs attention heads divisible by 3"),
    "zero": (["--sequence-parallel", "0"], 2, "--sequence-parallel: must be a positive integer, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sequence_parallel_refused_before_anything_is_written(case, tmp_path, mix_path):
    from test_bad_input import snapshot
    from zerotrain.launcher.config import resolve_config
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.run_plan import plan_run

    flags, world, expected = BAD[case]
    run = tmp_path / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    before = snapshot(run.parent)
    argv = ["--data", str(mix_path), "--out", str(run.parent), "--run-id", "r1", "--max-steps", "5"] + flags
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=world)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    assert snapshot(run.parent) == before


SP_FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--lr", "3e-3",
            "--warmup-steps", "2", "--log-data-every-steps", "0", "--max-steps", str(N),
            "--save-every-steps", str(SAVE), "--eval-tokens", "2000", "--eval-every-steps", str(SAVE)]


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory, mix_path):
    tmp = tmp_path_factory.mktemp("sp_runs")
    sp = ["--data", str(mix_path), "--out", str(tmp / "sp"), "--run-id", "r", *SP_FLAGS, "--sequence-parallel", "2"]
    out = {"run": tmp / "sp" / "r"}
    out["before_kill"] = kill_after_save(sp, out["run"])
    resumed = launch("deepspeed", sp)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out["stdout"] = resumed.stdout
    one = launch("python", ["--data", str(mix_path), "--out", str(tmp / "one"), "--run-id", "r", *SP_FLAGS])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    out["one"] = read_metrics(tmp / "one" / "r")
    # the SP=2 run as it was at its step-3 save, resumed on the same 2 ranks without sequence parallelism
    stop_at(out["run"], SAVE, tmp / "dp" / "r")
    dp = launch("deepspeed", [a if a != str(tmp / "sp") else str(tmp / "dp") for a in sp] + ["--sequence-parallel", "1"])
    assert dp.returncode == 0, dp.stdout[-3000:] + dp.stderr[-3000:]
    out["dp"], out["dp_stdout"] = tmp / "dp" / "r", dp.stdout
    return out


def test_sp2_run_killed_after_a_save_resumes_bit_for_bit(sp_runs):
    resumed_same(sp_runs)  # resumed at step 3; the steps logged before the kill reproduced exactly
    meta = json.loads((sp_runs["run"] / "checkpoints" / f"global_step{SAVE}" / "zerotrain.json").read_text())
    assert meta["sequence_parallel"] == 2 and meta["world_size"] == 2


def test_sp2_run_trains_what_one_rank_trains_on_the_same_global_batch(sp_runs):
    sp, one = read_metrics(sp_runs["run"]), sp_runs["one"]
    assert [m["step"] for m in sp] == [m["step"] for m in one] == list(range(1, N + 1))
    assert [m["tokens_seen"] for m in sp] == [m["tokens_seen"] for m in one]  # each row counted once
    for a, b in zip(sp, one):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    assert len({m["loss"] for m in sp}) == N  # it trains: every step a new loss
    # evaluation on every rank: each SP rank's share of the same rows, the tokens counted once (twice would
    # halve the loss)
    evals = [(a, b) for a, b in zip(sp, one) if "val_loss" in b]
    assert len(evals) == N // SAVE and all("val_loss" in a for a, _ in evals)
    for a, b in evals:
        for name, want in [("all", b["val_loss"]), *b["val_loss_per_source"].items()]:
            got = a["val_loss"] if name == "all" else a["val_loss_per_source"][name]
            assert abs(got - want) <= 1e-6 * want, (a["step"], name, got, want)


def test_dry_run_counts_row_groups_not_ranks(tmp_path, mix_path, capsys):
    from zerotrain.launcher.config import resolve_config
    from zerotrain.launcher.trainer import dry_run

    argv = ["--data", str(mix_path), "--out", str(tmp_path), "--run-id", "r", "--model", "debug", "--seq-len", "64",
            "--micro-batch", "2", "--sequence-parallel", "2", "--max-steps", "5"]
    dry_run(resolve_config(argv), world=2)
    said = capsys.readouterr().out
    assert "world 2, ZeRO-3, batch 2 x 1 x 1 (rows shared by 2 ranks) x 64 = 128 tokens per step" in said, said
    assert "sequence-parallel 2 (flag)" in said
    assert not (tmp_path / "r").exists()


def test_sp2_checkpoint_resumes_without_sequence_parallelism_on_the_same_ranks(sp_runs):
    """N may change on resume (same world): the ZeRO partitions are the same, the row groups go from 1 to 2, the
    loader state re-splits (dataio/reshard.py: every document once, tests/test_data_reshard.py) and gradient
    accumulation keeps the global batch."""
    out = sp_runs["dp_stdout"]
    assert f"resumed from {sp_runs['dp'] / 'checkpoints' / f'global_step{SAVE}'} at step {SAVE}" in out
    assert "data: 1 ranks' loader states re-split over 2" in out
    assert "batch 2 x 1 x 2 x 64 tokens" in out  # grad-accum 2 -> 1: the global batch of 4 rows kept
    history = read_metrics(sp_runs["dp"])
    assert [m["step"] for m in history] == list(range(1, N + 1))
    assert [m["tokens_seen"] for m in history] == [m["tokens_seen"] for m in read_metrics(sp_runs["run"])]
    assert [m["loss"] for m in history[:SAVE]] == [m["loss"] for m in read_metrics(sp_runs["run"])[:SAVE]]
    assert all(m["loss"] < history[0]["loss"] for m in history[SAVE:])  # it goes on training from the checkpoint


def test_an_sp_checkpoint_on_another_world_size_is_refused_before_anything_is_written(tmp_path, mix_path):
    """DeepSpeed's universal checkpoint has not been proven with sequence-parallel groups: a resume with
    sequence parallelism keeps the world size (N may change)."""
    from test_bad_input import snapshot
    from zerotrain.launcher.config import resolve_config
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.run_plan import plan_run

    tag = tmp_path / "runs" / "r" / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    (tag / "zerotrain.json").write_text(json.dumps({"step": 2, "tokens_seen": 1, "world_size": 2, "run_id": "r",
                                                    "loader_workers": 0, "sequence_parallel": 2}))
    before = snapshot(tmp_path / "runs")
    argv = ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--run-id", "r", "--max-steps", "5"]
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    assert "saved by 2 rank(s) at --sequence-parallel 2; with sequence parallelism a resume keeps the world size" \
        in str(err.value)
    assert snapshot(tmp_path / "runs") == before
