"""One path from flags to a plan (launcher/resolution.py): the run (run_plan.plan_run), `zerotrain plan` and `--dry-run`
resolve a matrix of flags (profiles, offload, sequence parallelism, token sizing, recipes, world sizes) to the same
micro-batch, accumulation, steps, warmup, ZeRO stage, offload, sequence-parallel size and attention kernel.

In-process, no process group: the run's route is planned as a rank of `world` whose machine is the profile's
(Node.here replaced by Node.of_profile, so a GPU profile is planned on this CPU), without the fit check against
this machine; each route's own output is read (the RunPlan, the dry run's lines and dict, the plan's JSON), and the
Resolved each route got from `resolve` is recorded by a wrapper that returns it unchanged.
"""
from __future__ import annotations

import json
import re

import pytest

from zerotrain.launcher import planning, resolution, run_plan
from zerotrain.launcher.commands import plan as plan_command
from zerotrain.launcher.config import with_values
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.node import Node
from zerotrain.launcher.profiles import load_profile
from zerotrain.launcher.settings import profile_value
from zerotrain.launcher.trainer import dry_run

CASES = {  # name: (flags, world)
    "cpu, one rank": (["--profile", "cpu", "--model", "tiny", "--seq-len", "256"], 1),
    "cpu, offload optimizer": (["--profile", "cpu", "--model", "tiny", "--seq-len", "256", "--offload", "optimizer"],
                               2),
    "cpu-zero2, tokens": (["--profile", "cpu-zero2", "--model", "tiny", "--seq-len", "128", "--offload", "optimizer",
                           "--total-tokens", "100000", "--warmup-tokens", "20000"], 2),
    "cpu, sequence parallel, tokens": (["--profile", "cpu", "--model", "tiny", "--seq-len", "256",
                                        "--sequence-parallel", "2", "--total-tokens", "200000",
                                        "--warmup-tokens", "30000"], 2),
    "a100 x8, flex, global batch": (["--profile", "a100-80g-x8", "--model", "small", "--seq-len", "1024",
                                     "--micro-batch", "4", "--global-batch-tokens", "262144", "--attention", "flex"],
                                    8),
    "h100 on one GPU": (["--profile", "h100-80g-x8", "--model", "small", "--seq-len", "2048"], 1),
    "h100 x8, SP 2, offload all, tokens": (["--profile", "h100-80g-x8", "--model", "small", "--seq-len", "4096",
                                            "--sequence-parallel", "2", "--offload", "all",
                                            "--total-tokens", "1000000000", "--warmup-tokens", "10000000"], 8),
    "rtx6000ada offload profile": (["--profile", "rtx6000ada-48g-x2-offload", "--model", "small", "--seq-len", "1024"],
                                   2),
    "recipe cpu-debug": (["--config", "cpu-debug"], 2),
    "recipe 760m, muon, world 1": (["--config", "rtx6000ada-x2-760m", "--tokenizer", "bytes", "--max-steps", "300"], 1),
}


def spy(monkeypatch, module) -> list:
    """Record what `module.resolve` returns (the real function runs; its result is returned unchanged)."""
    got = []

    def recording(*args, **kwargs):
        got.append(resolution.resolve(*args, **kwargs))
        return got[-1]

    monkeypatch.setattr(module, "resolve", recording)
    return got


def offload_of(ds: dict) -> dict:
    return planning.host.offload_devices(planning.stage_key(ds), ds.get("zero_optimization") or {})


def by_the_run(argv: list[str], world: int, monkeypatch) -> tuple:
    cfg = with_values(resolve_config(argv), {"fit_check": False})
    hw = profile_value(load_profile(cfg.parallel.profile)[1], "hardware", {})
    monkeypatch.setattr(Node, "here", staticmethod(lambda: Node.of_profile(hw)))  # the profile's machine
    p = run_plan.plan_run(cfg, world, 0)
    ds = p.ds_config
    return (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], p.cfg.schedule.max_steps,
            p.cfg.schedule.warmup_steps, planning.stage_key(ds), offload_of(ds), p.sequence_parallel, p.attention)


def by_the_dry_run(argv: list[str], world: int, monkeypatch, capsys) -> tuple:
    got = spy(monkeypatch, run_plan)
    result = dry_run(with_values(resolve_config(argv), {"dry_run": True}), world)
    out = capsys.readouterr().out
    ds, r = result.extra["ds_config"], got[-1]
    shown = re.search(r"world (\d+), ZeRO-(\d), batch (\d+) x (\d+) x (\d+)", out)
    assert shown and [int(g) for g in shown.groups()] == [
        world, ds["zero_optimization"]["stage"], ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"], world // r.sequence_parallel], out
    assert f"attention: {r.settings.attention} (" in out, out
    return (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], r.cfg.schedule.max_steps,
            r.cfg.schedule.warmup_steps, planning.stage_key(ds), offload_of(ds), r.sequence_parallel, r.settings.attention)


def by_the_plan(argv: list[str], world: int, monkeypatch, capsys) -> tuple:
    got = spy(monkeypatch, plan_command)
    plan_command.plan_main([*argv, "--gpus", str(world), "--nodes", "1", "--json"])
    p, r = json.loads(capsys.readouterr().out), got[-1]
    return (p["micro_batch"], p["grad_accum"], p["steps"], r.cfg.schedule.warmup_steps, p["zero_stage"],
            p["host_memory"]["offloaded"], p["sequence_parallel"]["size"], p["attention"])


@pytest.mark.parametrize("case", CASES)
def test_the_run_plan_and_dry_run_resolve_alike(case, mix_path, tmp_path, monkeypatch, capsys):
    flags, world = CASES[case]
    argv = [*flags, "--data", str(mix_path), "--out", str(tmp_path / "runs")]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    run = by_the_run(argv, world, monkeypatch)
    dry = by_the_dry_run(argv, world, monkeypatch, capsys)
    planned = by_the_plan(argv, world, monkeypatch, capsys)
    names = ("micro-batch", "grad accum", "steps", "warmup", "ZeRO stage", "offload", "sequence parallel", "attention")
    assert dict(zip(names, dry)) == dict(zip(names, run))
    assert dict(zip(names, planned)) == dict(zip(names, run))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing written
