"""An attention kernel is one entry of modeling/attention.py's KERNELS, and the model, the sizes, the planner and
the run's checks all read that entry: each consumer's kernel names are the registry's, and a fake entry added
here changes what each of them does (its device refusal, its mask form, its memory terms, its suggestion, its
--compile refusal). Starts no process."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zerotrain.errors import UsageError
from zerotrain.launcher import run_plan, settings
from zerotrain.launcher.config import with_values
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.node import Node
from zerotrain.launcher.profiles import load_profile
from zerotrain.launcher.planning import activation_bytes
from zerotrain.launcher.planning.alternatives import alternatives
from zerotrain.launcher.planning.hardware import Setup
from zerotrain.launcher.settings import profile_value
from zerotrain.modeling import model, sizes
from zerotrain.modeling.attention import KERNELS

ARGS = sizes.preset("debug")


def test_every_consumer_names_the_registrys_kernels():
    assert set(model.ATTENTION_KERNELS) == set(KERNELS)
    assert sizes.ATTENTION_BACKENDS == ("auto", *KERNELS)
    assert settings.BY_NAME["attention"].choices == sizes.ATTENTION_BACKENDS  # --attention's choices
    for name, entry in KERNELS.items():
        assert model.ATTENTION_KERNELS[name].__name__ == entry.function
        assert activation_bytes(ARGS, 2, 64, 4, False, name).saved > 0  # the planner takes every kernel


def test_a_fake_kernel_is_seen_by_sizes_model_and_planner(monkeypatch):
    fake = replace(KERNELS["varlen"], name="fake", auto_rank=None, devices=("tpu",),
                   device_refusal="fake runs on a tpu only; this run is on {device_type}")
    monkeypatch.setitem(KERNELS, "fake", fake)
    # sizes: its refusal, and where it can run, its name
    with pytest.raises(ValueError, match="^fake runs on a tpu only; this run is on cpu$"):
        sizes.choose_attention("fake", "cpu", "bf16")
    assert sizes.choose_attention("fake", "tpu", "bf16") == "fake"
    monkeypatch.setitem(KERNELS, "fake", replace(fake, auto_rank=-1, devices=(), precisions=()))
    assert sizes.choose_attention("auto", "cpu", "fp32") == "fake"  # ranked before varlen and sdpa
    # the model: the document form its entry names
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert model.DocumentLayout.from_positions(positions, "fake").cu_seqlens.tolist() == [0, 3, 8]
    monkeypatch.setitem(KERNELS, "fake", replace(fake, layout="block_mask"))
    assert model.DocumentLayout.from_positions(positions, "fake").block_mask is not None
    # the planner: its memory terms (varlen's on a CPU; sdpa's with a row mask), its suggestion when short
    monkeypatch.setitem(KERNELS, "fake", fake)
    assert activation_bytes(ARGS, 2, 256, 4, False, "fake") == activation_bytes(ARGS, 2, 256, 4, False, "varlen")
    monkeypatch.setitem(KERNELS, "fake", replace(KERNELS["sdpa"], name="fake", math_on_cuda_gqa=False))
    assert activation_bytes(ARGS, 2, 256, 4, False, "fake") == activation_bytes(ARGS, 2, 256, 4, False, "sdpa")
    setup = Setup("cpu", 1, 1, 1e15, False, {}, attention="sdpa")  # every change fits
    suggested = [a["change"] for a in alternatives(ARGS, setup, 0, 1, 256, False)]
    assert suggested and "--attention flex" in suggested, suggested
    monkeypatch.setitem(KERNELS, "sdpa", replace(KERNELS["sdpa"], lighter="fake"))
    suggested = [a["change"] for a in alternatives(ARGS, setup, 0, 1, 256, False)]
    assert "--attention fake" in suggested and "--attention flex" not in suggested, suggested


def test_the_runs_attention_check_reads_the_entry(mix_path, tmp_path, monkeypatch):
    """resolution.attention_kernel refuses --compile on a CPU for the kernel whose entry says so (flex today)."""
    monkeypatch.setitem(KERNELS, "sdpa", replace(KERNELS["sdpa"], compile_on_cpu_refusal="fake refusal"))
    cfg = with_values(resolve_config(["--profile", "cpu", "--model", "debug", "--seq-len", "128", "--attention", "sdpa",
                                      "--compile", "--data", str(mix_path), "--out", str(tmp_path / "runs")]),
                      {"fit_check": False})
    hardware = profile_value(load_profile(cfg.parallel.profile)[1], "hardware", {})
    monkeypatch.setattr(Node, "here", staticmethod(lambda: Node.of_profile(hardware)))  # the profile's machine
    with pytest.raises(UsageError, match="^--attention sdpa with --compile: fake refusal$"):
        run_plan.plan_run(cfg, 1, 0)
