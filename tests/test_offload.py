"""ZeRO-Offload settings, in-process: --offload / --nvme-path onto DeepSpeed's offload keys, a profile's own
keys validated, the ops a dry run names, and NVMe refusals (no libaio, a full disk) before anything is written.
The rest of the bad input is test_run_bad_input.py's."""
import json
import shutil

import pytest

from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.offload.keys import apply_offload, check_offload
from zerotrain.launcher.profiles import validate_profile


# -- the settings, in-process ----------------------------------------------------------------------

ZERO3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False,
                                                                  "ratio": 0.5}}}


def test_offload_maps_onto_deepspeeds_keys_keeping_the_profiles_own():
    ds = apply_offload(ZERO3, "all", None, "--offload")
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False,
                                                                         "ratio": 0.5},
                                       "offload_param": {"device": "cpu"}}
    ds = apply_offload(ZERO3, "optimizer", "/mnt/nvme", "--offload")
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "nvme_path": "/mnt/nvme",
                                                            "pin_memory": False, "ratio": 0.5}
    assert "offload_param" not in ds["zero_optimization"]
    assert apply_offload(ZERO3, "none", None, "--offload")["zero_optimization"] == {"stage": 3}
    assert apply_offload(ZERO3, None, None, "--offload") is ZERO3  # unset: the profile's keys as they are
    assert offload.offloaded(apply_offload(ZERO3, "all", "/x", "--offload")) == {"optimizer": "nvme",
                                                                                  "parameters": "nvme"}
    with pytest.raises(UsageError, match="--offload all: offloads parameters, which only ZeRO-3 partitions; this"
                                         " profile is ZeRO-2"):
        apply_offload({"zero_optimization": {"stage": 2}}, "all", None, "--offload")


@pytest.mark.parametrize("zero, message", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "zero_optimization.offload_param at ZeRO-2: only ZeRO-3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer at ZeRO-0"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device must be none, cpu or nvme"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "offload_optimizer on nvme needs an nvme_path"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio must be a number in [0, 1]"),
    ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": -1}}, "buffer_count must be a non-negative"),
    ({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "yes"}}, "pin_memory must be a boolean"),
    ({"stage": 3, "offload_param": {"device": "cpu", "bufer_size": 1}}, "has no key 'bufer_size' in DeepSpeed 0.19"),
])
def test_a_profiles_own_offload_keys_are_validated(zero, message):
    with pytest.raises(UsageError) as err:
        validate_profile({"zero_optimization": zero}, "profile p")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_profile_keys_zerotrain_offload_and_nvme_path_are_validated():
    for zt, message in (({"offload": "some"}, "zerotrain.offload must be one of none, optimizer, all, got 'some'"),
                        ({"nvme_path": 3}, "zerotrain.nvme_path must be a directory path, got 3")):
        with pytest.raises(UsageError, match=message):
            validate_profile({"zero_optimization": {"stage": 3}, "zerotrain": zt}, "profile p")
    check_offload(ZERO3["zero_optimization"], "profile p")  # a valid one passes


def test_dry_run_names_the_ops_it_will_build(tmp_path):
    ds = apply_offload(ZERO3, "all", "/mnt/nvme", "--offload")
    ds["optimizer"] = {"type": "AdamW", "params": {}}
    assert offload.ops_needed(ds) == ["cpu_adam", "async_io"]
    lines = offload.describe(ds, root=tmp_path)
    assert lines[0] == ("offload (ZeRO-Offload): optimizer states and fp32 master weights -> nvme (/mnt/nvme);"
                        " parameters -> nvme (/mnt/nvme)")
    assert lines[1].startswith("DeepSpeed op cpu_adam (DeepSpeedCPUAdam, the offloaded optimizer's step): JIT-built"
                               " on first use, about 45 s")
    assert lines[2].startswith("DeepSpeed op async_io (")
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert "built already" in offload.describe(ds, root=tmp_path)[1]
    ds["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW steps on the host: nothing to build for it
    assert offload.ops_needed(ds) == ["async_io"]
    assert offload.describe(apply_offload(ZERO3, "none", None, "--offload")) == []


def nvme_argv(tmp_path, mix_path):
    """A run directory that exists (with its config) and the flags of an NVMe run into it; its snapshot."""
    from test_bad_input import snapshot

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    argv = ["--data", str(mix_path), "--out", str(run.parent), "--run-id", "r1", "--offload", "all", "--nvme-path",
            str(tmp_path)]
    return run, argv, snapshot(run.parent)


def test_nvme_without_libaio_is_refused_before_anything_is_written(tmp_path, mix_path, monkeypatch):
    from test_bad_input import snapshot
    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.run_plan import plan_run

    run, argv, before = nvme_argv(tmp_path, mix_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no-builds"))  # async_io not built
    monkeypatch.setattr(offload, "LIBAIO_HEADERS", (str(tmp_path / "libaio.h"),))
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    assert str(err.value) == (f"--nvme-path {tmp_path}: NVMe offload needs DeepSpeed's async_io op, which builds"
                              " against libaio; libaio is not installed (apt-get install libaio-dev, or pre-build"
                              " the op: DS_BUILD_AIO=1)")
    assert snapshot(run.parent) == before and not list(tmp_path.glob(".zerotrain-probe-*"))


def test_nvme_full_disk_is_refused_before_anything_is_written(tmp_path, mix_path, monkeypatch):
    """The disk-space check comes after the libaio check: where libaio is missing (and async_io not built) it
    is never reached, and the test says so as its skip reason (CI installs libaio-dev; a user may not)."""
    from test_bad_input import snapshot
    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.run_plan import plan_run

    run, argv, before = nvme_argv(tmp_path, mix_path)
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    if "libaio is not installed" in str(err.value):
        pytest.skip(f"the disk-space check is after the libaio check, which refuses here: {err.value}")
    assert str(err.value).startswith(f"--nvme-path {tmp_path}: 0.00 GiB free, the offloaded state needs")
    assert snapshot(run.parent) == before and not list(tmp_path.glob(".zerotrain-probe-*"))


def test_a_resume_cannot_move_an_nvme_optimizer_to_memory_or_back(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    on_nvme, in_memory = apply_offload(ZERO3, "all", "/mnt/nvme", "--offload"), apply_offload(ZERO3, "all", None,
                                                                                             "--offload")
    assert offload.check_resume(in_memory, tag) is None  # saved from memory, resumed in memory (or without offload)
    assert offload.check_resume(apply_offload(ZERO3, "none", None, "--offload"), tag) is None
    with pytest.raises(UsageError, match="saved from memory, and DeepSpeed loads an optimizer on NVMe only"):
        offload.check_resume(on_nvme, tag)
    (tag / "offloaded_tensors").mkdir()
    assert offload.check_resume(on_nvme, tag) is None  # allowed: checkpointer.load restores what DeepSpeed skips
    with pytest.raises(UsageError, match=r"saved from NVMe \(offloaded_tensors/\), which DeepSpeed loads only"):
        offload.check_resume(in_memory, tag)


def test_a_stale_build_lock_is_named_and_a_fresh_one_is_not(tmp_path, mix_path, monkeypatch, capsys):
    """torch's JIT build lock left by a killed build makes every later load of that op wait forever, silently:
    one older than any build takes is named (the dry run here; the start-up says it before the process group,
    which loads the first op); a build in progress (a fresh lock) is not."""
    import os
    import time

    from zerotrain.launcher.config import RunConfig
    from zerotrain.launcher.trainer import dry_run

    stale = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.write_bytes(b"")
    old = time.time() - offload.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    assert offload.stale_build_locks(tmp_path) == [stale]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    dry_run(RunConfig.from_flat(dict(data=str(mix_path), profile="cpu", model="debug", out=str(tmp_path / "runs"),
                                     dry_run=True)))
    said = [line for line in capsys.readouterr().out.splitlines() if "warning" in line and "lock" in line]
    assert said == [f"zerotrain: warning: {stale} is 11 min old: a DeepSpeed op build that was killed leaves it, and"
                    " loading deepspeed_shm_comm then waits on it forever; remove it if no other run here is"
                    " building that op"]
    os.utime(stale, None)  # a build going on now
    assert offload.stale_build_locks(tmp_path) == [] and offload.describe_stale_locks(tmp_path) == []


def test_builds_and_locks_are_found_in_both_of_torchs_layouts(tmp_path, monkeypatch):
    """torch builds an op in ROOT/NAME when TORCH_EXTENSIONS_DIR is set, and in ROOT/py311_cpu/NAME under its
    default root: a build and a stale lock are found in either (a build looked for in one layout only is reported
    missing, and its killed build's lock never named)."""
    import os
    import time

    direct, nested = tmp_path / "set" / "async_io", tmp_path / "default" / "py311_cpu" / "async_io"
    for build in (direct, nested):
        build.mkdir(parents=True)
        (build / "async_io.so").write_bytes(b"")
        (build / "lock").write_bytes(b"")
        old = time.time() - offload.STALE_LOCK_S - 60
        os.utime(build / "lock", (old, old))
    for root, build in ((tmp_path / "set", direct), (tmp_path / "default", nested)):
        assert offload.is_built("async_io", root) and not offload.is_built("cpu_adam", root)
        assert offload.stale_build_locks(root) == [build / "lock"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "set"))  # what the run itself looks in
    assert offload.is_built("async_io") and offload.stale_build_locks() == [direct / "lock"]


# ---- the planner's host memory and host-link traffic with offload (launcher/planning) -------------------

def test_host_memory_counts_deepspeeds_offloaded_allocations_per_node():
    """ZeRO-3 with the optimizer and parameters in host memory, bf16, Adam: per rank (4 + 8) fp32 master and
    moments, (2 + 4) gradient buffers, 2 parameters, times P/N, times the ranks of a node; ZeRO-2 with
    grad-accum > 1 adds the host-side accumulation buffer and the 16-bit staging copy."""
    from zerotrain.launcher import planning as planner
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling.sizes import count_params, preset

    args = preset("ws-1.3b", vocab_size=128256)
    P = count_params(args)["total"]
    _, prof = load_profile("rtx6000ada-48g-x2-offload")
    setup = planner.setup_from(prof, prof["zerotrain"])
    host = planner.host_memory(args, setup, "zero3_offload", grad_accum=16)
    part = P / 2
    assert host.optimizer == pytest.approx(12 * part * 2)
    assert host.gradients == pytest.approx(6 * part * 2)
    assert host.parameters == pytest.approx(2 * part * 2)
    assert host.state == pytest.approx(20 * P) and setup.host_bytes == 256 * 2**30
    z2 = planner.host_memory(args, setup, "zero2_offload", grad_accum=16)
    assert z2.gradients == pytest.approx((4 + 2) * part * 2)  # fp32 partition + the host accumulation buffer
    assert z2.buffers == pytest.approx((2 * part + 2 * planner.largest_layer(args)) * 2)
    assert planner.host_memory(args, setup, 3).total == pytest.approx(host.total)  # the profile's own row
    # NVMe: the optimizer's state leaves host memory, but DeepSpeed's swap buffers (4 of the largest sub-group,
    # 1e9 elements by default: a whole partition here), the gradient partition and up to max_in_cpu (1e9)
    # parameters stay: at DeepSpeed's defaults this model needs more host memory on NVMe, not less
    nvme = apply_offload(prof, "all", "/mnt/nvme", "--offload")
    swapped = planner.host_memory(args, planner.setup_from(nvme, prof["zerotrain"]), 3)
    assert swapped.optimizer == 0 and swapped.gradients == pytest.approx(2 * part * 2)
    assert swapped.parameters == pytest.approx(2 * part * 2)
    assert swapped.buffers == pytest.approx(2 * (4 * part * 4 + 5 * 1e8 * 2))  # defaults: 4 x sub-group, 5 x 1e8
    assert planner.host_memory(args, planner.setup_from(apply_offload(prof, "none", None, "--offload"),
                                                        prof["zerotrain"]), 3).total == 0


def test_offload_traffic_is_in_the_plans_time(capsys):
    """The host link's seconds per step (hardware.host_link_gb_s) are added to the compute's: the plan's
    tokens/s is the tokens of a step over (compute + traffic); the plan prints both lines."""
    from zerotrain.launcher.cli import main as cli

    cli(["plan", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--vocab-size", "256", "--json"])
    p = json.loads(capsys.readouterr().out)
    t, h = p["offload_traffic"], p["host_memory"]
    assert t["host_link_gb_s"] == 25 and t["seconds_per_step"] > 0
    P, accum = p["params_total"], p["grad_accum"]
    assert t["gb_per_step_per_gpu"] == pytest.approx((2 * P / 2 * (accum + 1) + 2 * P / 2 * accum * 3) / 1e9,
                                                     rel=1e-3)  # grads + params back; params x3 under AC
    compute_s = p["tokens_per_step"] / (p["mfu"] * p["hardware"]["peak_flops_per_device"] * 2 / p["flops_per_token"])
    assert p["tokens_per_s"] == pytest.approx(p["tokens_per_step"] / (compute_s + t["seconds_per_step"]), rel=1e-3)
    assert h["offloaded"] == {"optimizer": "cpu", "parameters": "cpu"} and h["fits"] and h["host_memory_gib"] == 256
    cli(["plan", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--vocab-size", "256"])
    out = capsys.readouterr().out
    assert "host memory (offload: optimizer -> cpu, parameters -> cpu): " in out and " of 256.00 GiB (" in out
    assert "offload traffic: " in out and "at 25 GB/s (zerotrain.hardware.host_link_gb_s)" in out
    assert "with 66.3 s per step of offload traffic" in out  # the time line says what it includes


def test_dry_run_prints_the_host_memory_and_traffic_lines(tmp_path, mix_path, capsys):
    """--dry-run of an offload recipe on its profile's hardware: the same host-memory and traffic lines as
    `zerotrain plan`, after the offload line; nothing is written."""
    from zerotrain.launcher.cli import main as cli

    with pytest.raises(SystemExit) as ended:
        cli(["train", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--tokenizer", "bytes", "--data",
             str(mix_path), "--out", str(tmp_path / "runs"), "--dry-run"])
    assert ended.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("offload (ZeRO-Offload): "))
    host = next(line for line in lines[at:] if line.startswith("host memory (offload: "))
    assert "per node of 256.00 GiB (optimizer " in host and "ranks' own 1.2 GiB)" in host
    assert any(line.startswith("offload traffic: ") and "+66.3 s per step" in line for line in lines[at:])
    assert not (tmp_path / "runs").exists()


def test_what_the_host_cannot_hold_is_refused_in_one_line_before_anything_is_written(tmp_path, mix_path, capsys):
    """A profile whose node has too little host memory for the offloaded state: `zerotrain plan` says so in its
    verdict, and --dry-run exits 2 with one line naming the need and the host, nothing written."""
    from test_bad_input import snapshot
    from zerotrain.launcher.cli import main as cli

    prof = json.loads(open("ds_configs/rtx6000ada-48g-x2-offload.json").read())
    prof["zerotrain"]["hardware"]["host_memory_gib"] = 64  # the 7B model's state needs ~121 GiB
    path = tmp_path / "small-host.json"
    path.write_text(json.dumps(prof))
    cli(["plan", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--profile", str(path), "--vocab-size", "256"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does not fit on the host: the offloaded state needs 121.") and "has 64.00 GiB" in last
    runs = tmp_path / "runs"
    runs.mkdir()
    before = snapshot(runs)
    with pytest.raises(SystemExit) as ended:
        cli(["train", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--profile", str(path), "--tokenizer",
             "bytes", "--data", str(mix_path), "--out", str(runs), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(err) == 1, err
    assert "does not fit on the host: the offloaded state needs 121." in err[0] and "a node" in err[0]
    assert snapshot(runs) == before


def test_would_fit_names_the_offload_flag(capsys):
    """A 7B model on the plain dual-48 GB profile (ZeRO-3) fits no device row, even at micro-batch 1: the plan
    suggests the ZeRO-3 offload row (no lower stage: the profile's is 3), named by the flag that runs it."""
    from zerotrain.launcher.cli import main as cli

    cli(["plan", "--config", "recipes/rtx6000ada-x2-7b-offload.json", "--profile", "rtx6000ada-48g-x2",
         "--vocab-size", "256", "--json"])
    p = json.loads(capsys.readouterr().out)
    assert not p["fits"] and p["host_memory"]["offloaded"] == {}
    changes = [w["change"] for w in p["would_fit"]]
    assert changes == ["ZeRO-3 + --offload all"], changes
    assert "would fit: ZeRO-3 + --offload all (" in p["verdict"]
