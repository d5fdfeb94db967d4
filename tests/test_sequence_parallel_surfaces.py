"""Sequence parallelism through every other surface: the launchers, --tiled-mlp, the health check's phases, the
watchdog and export (the SP math itself: tests/test_sequence_parallel.py).

Two launches at --sequence-parallel 2 on 2 CPU ranks, the cpu profile (ZeRO-3, fp32, parameters gathered at every
use: stage3_param_persistence_threshold 0) with a health window closed at every step, the debug model (dim 128),
rows of 512 tokens (256 positions per rank), the same data, seed and batch:
- `accelerate launch` with the shipped 2-node pair made CPU-sized (two accelerate processes of one rank each,
  loopback), with --tiled-mlp (2 tiles of 128 positions per MLP);
- `zerotrain launch --hostfile H --no_ssh --node_rank R` on two loopback "nodes" of one slot each, untiled.
These are also the suite's loopback multi-node launches: two `accelerate launch` processes make one world of 2
whose profile is the config file's, and DeepSpeed's multi-node launcher (a hostfile, --no_ssh, one process per
node) makes one world of 2; each saves its last step's checkpoint whole.
`zerotrain launch -n 2` runs `deepspeed --num_gpus 2 --module zerotrain.launcher.train`
(components/launching/jobs.py deepspeed_command): the runner tests/test_sequence_parallel.py's driver runs use.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, TRAIN_PY, free_port, read_metrics

BIN = Path(sys.executable).parent
STEPS = 3
FLAGS = ["--model", "debug", "--seq-len", "512", "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "1",
         "--max-steps", str(STEPS), "--save-every-steps", str(STEPS), "--eval-tokens", "2000",
         "--eval-every-steps", str(STEPS), "--log-data-every-steps", "0", "--sequence-parallel", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_nodes(cmds: list[list[str]]) -> list[str]:
    nodes = [subprocess.Popen(c, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    logs = [n.communicate(timeout=600)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return logs


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory, mix_path):
    tmp = tmp_path_factory.mktemp("sp_surfaces")
    profile = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    profile["zerotrain"]["health"] = {"window_s": 0.001}  # every step closes a window: its time shares logged
    profile_path = tmp / "cpu-sp.json"
    profile_path.write_text(json.dumps(profile))
    out = {"profile": profile_path}

    # accelerate: two machines of one process each on loopback; the profile is the config's file
    port, cmds = free_port(), []
    for node in (0, 1):
        cfg = yaml.safe_load((REPO / "launcher" / "accelerate" / f"h100-2node-node{node}.yaml").read_text())
        cfg.update(use_cpu=True, num_processes=2, main_process_ip="127.0.0.1", main_process_port=port)
        cfg["deepspeed_config"]["deepspeed_config_file"] = str(profile_path)
        path = tmp / f"node{node}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cmds.append([str(BIN / "accelerate"), "launch", "--config_file", str(path), str(TRAIN_PY), "--data",
                     str(mix_path), "--out", str(tmp / "acc"), "--run-id", "r", *FLAGS, "--tiled-mlp"])
    out["acc_logs"], out["acc"] = run_nodes(cmds), tmp / "acc" / "r"

    # zerotrain launch --hostfile: two loopback nodes, each started with --no_ssh --node_rank
    hostfile = tmp / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    out["hf_logs"] = run_nodes([[sys.executable, "-m", "zerotrain", "launch", "--hostfile", str(hostfile), "--no_ssh",
                                 "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port, "--",
                                 "--profile", str(profile_path), "--data", str(mix_path), "--out", str(tmp / "hf"),
                                 "--run-id", "r", *FLAGS] for rank in (0, 1)])
    out["hf"] = tmp / "hf" / "r"
    return out


@pytest.mark.launches
def test_tiled_sp2_under_accelerate_trains_what_untiled_sp2_trains_from_a_hostfile(surfaces):
    acc, hf = read_metrics(surfaces["acc"]), read_metrics(surfaces["hf"])
    for run in ("acc", "hf"):
        saved = json.loads((surfaces[run] / "config.json").read_text())
        assert saved["world_size"] == 2 and saved["run"]["sequence_parallel"] == 2
        assert saved["run"]["tiled_mlp"] is (True if run == "acc" else None)
        assert saved["run_sources"]["tiled_mlp"] == ("flag" if run == "acc" else "default")
    assert json.loads((surfaces["acc"] / "config.json").read_text())["run"]["profile"] == str(surfaces["profile"])
    # the tiling the model ran, said at start-up (rank 0 is accelerate's machine 0)
    said = surfaces["acc_logs"][0]
    assert "tiled MLP: 2 tile(s) of up to 128 of this rank's 256 positions" in said, said[-3000:]
    assert "tiled MLP" not in surfaces["hf_logs"][0]
    assert [m["step"] for m in acc] == [m["step"] for m in hf] == list(range(1, STEPS + 1))
    assert [m["tokens_seen"] for m in acc] == [m["tokens_seen"] for m in hf]
    # the same training to rounding (the tiled weight gradients are summed tile by tile: tests/test_tiled_mlp.py)
    for a, b in zip(acc, hf):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    assert len({m["loss"] for m in acc}) == STEPS
    assert abs(acc[-1]["val_loss"] - hf[-1]["val_loss"]) <= 1e-6 * hf[-1]["val_loss"]


@pytest.mark.launches
def test_two_loopback_nodes_make_one_world_under_accelerate_and_a_hostfile(surfaces):
    for run in ("acc", "hf"):
        saved = json.loads((surfaces[run] / "config.json").read_text())
        assert saved["world_size"] == 2, run
        assert [m["step"] for m in read_metrics(surfaces[run])] == list(range(1, STEPS + 1)), run
        assert (surfaces[run] / "checkpoints" / f"global_step{STEPS}" / "zerotrain.json").is_file(), run
    # under accelerate the config file names the profile (not the default one: only the file can name it)
    saved = json.loads((surfaces["acc"] / "config.json").read_text())
    assert saved["profile"] == surfaces["profile"].stem and saved["run"]["profile"] == str(surfaces["profile"])
    # the hostfile's launch went through DeepSpeed's multi-node runner: its per-node launch.py on each "node"
    assert all("[launch.py:" in log for log in surfaces["hf_logs"]), surfaces["hf_logs"][1][-3000:]


@pytest.mark.launches
def test_the_all_to_all_is_a_phase_of_its_own_and_the_watchdog_is_unaffected(surfaces):
    for run in ("acc", "hf"):
        windows = [m["time_shares"] for m in read_metrics(surfaces[run]) if "time_shares" in m]
        assert len(windows) == STEPS, run
        for shares in windows:
            # measured around every exchange (4 a layer forward, 4 backward): a share of its own, compute's apart
            assert shares.get("all_to_all", 0) > 0 and shares["compute"] > 0, (run, shares)
            assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)  # (each rounded to 4 places)
        logs = surfaces[f"{run}_logs"][0]
        assert "watchdog: a rank with no progress for the larger of 600 s" in logs  # on, its default rule
        hangs = surfaces[run] / "hangs"  # the beats' directory (emptied at a clean end), no dump: no rank hung
        assert [p.name for p in hangs.iterdir()] == ["heartbeat"], list(hangs.iterdir())


@pytest.mark.launches
def test_export_of_an_sp2_run_checks_and_holds_its_weights(surfaces, tmp_path, capsys):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from zerotrain.launcher.cli import main as cli

    to = tmp_path / "hf"
    cli(["export", str(surfaces["acc"]), "--to", str(to)])
    said = capsys.readouterr().out
    assert "within the float32 tolerance" in said, said
    exported = load_file(to / "model.safetensors")
    tag = surfaces["acc"] / "checkpoints" / f"global_step{STEPS}"
    # the run's weights as DeepSpeed puts its 2 ranks' ZeRO-3 partitions together, read here on their own
    trained = get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name)
    hf_name = {n: n if n == "lm_head.weight" else f"model.{n}" for n in trained}  # modeling/hf.py's names
    assert set(exported) <= set(hf_name.values())
    for name, tensor in trained.items():
        if hf_name[name] in exported:  # (a tied lm_head.weight is the embedding's, exported once)
            assert torch.equal(exported[hf_name[name]], tensor), name
    # and the untiled hostfile run, trained on the same rows, ended with the same weights to rounding
    other = get_fp32_state_dict_from_zero_checkpoint(str(surfaces["hf"] / "checkpoints"), tag=tag.name)
    worst = max(((other[n] - t).norm() / t.norm()).item() for n, t in trained.items())
    assert worst <= 1e-4, worst


def test_each_exchange_is_measured_as_the_all_to_all_phase_forward_and_backward():
    """The engine builder's wrapper (launcher/sequence/groups.py _MeasuredExchange) around an exchange that is its own
    adjoint, as the dimension-0 all-to-all is (here a flip of dimension 0, one process): the phase is entered once
    in forward and once in backward, inside "compute", and the gradient is the exchange's own."""
    from zerotrain.launcher.sequence.groups import _MeasuredExchange
    from zerotrain.launcher.components.observe.phases import PhaseClock
    from zerotrain.launcher.components.observe.watchdog import phase_words, timeout_for

    ticks = iter(range(1000))
    clock, calls = PhaseClock(clock=lambda: float(next(ticks))), []

    def exchange(t):
        calls.append(clock.now_state()[1])
        return t.flip(0)

    x = torch.randn(2, 3, 4, requires_grad=True)
    upstream = torch.randn(2, 3, 4)
    with clock.phase("compute"):
        _MeasuredExchange.apply(x * 2, exchange, lambda: clock.phase("all_to_all")).backward(upstream)
    assert calls == ["all_to_all", "all_to_all"]
    assert torch.equal(x.grad, 2 * upstream.flip(0))
    _, window = clock.take_window()
    assert window["all_to_all"] > 0 and window["compute"] > 0
    # the watchdog: the phase's timeout is the default rule's, its hang summary says what it is
    assert timeout_for("all_to_all", None, {"compute": 1.0, "all_to_all": 0.1}) == 600.0
    assert "all-to-all" in phase_words("all_to_all", {"compute": 1.0})
