"""ZeRO-Offload settings, in-process: --offload / --nvme-path onto DeepSpeed's offload keys, a profile's own
keys validated, the ops a dry run names, and NVMe refusals (no libaio, a full disk) before anything is written.
The rest of the bad input is test_run_bad_input.py's."""
import shutil

import pytest

from zerotrain.launcher.components import offload
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import apply_offload, check_offload, validate_profile


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


def test_nvme_full_disk_and_no_libaio_are_refused_before_anything_is_written(tmp_path, mix_path, monkeypatch):
    from test_bad_input import snapshot
    from zerotrain.launcher.config import resolve_config
    from zerotrain.launcher.run_plan import plan_run

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"run": {}}\n')
    before = snapshot(run.parent)
    argv = ["--data", str(mix_path), "--out", str(run.parent), "--run-id", "r1", "--offload", "all", "--nvme-path",
            str(tmp_path)]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no-builds"))  # async_io not built
    monkeypatch.setattr(offload, "LIBAIO_HEADERS", (str(tmp_path / "libaio.h"),))
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    assert str(err.value) == (f"--nvme-path {tmp_path}: NVMe offload needs DeepSpeed's async_io op, which builds"
                              " against libaio; libaio is not installed (apt-get install libaio-dev, or pre-build"
                              " the op: DS_BUILD_AIO=1)")
    monkeypatch.undo()
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(UsageError, match=rf"--nvme-path {tmp_path}: 0.00 GiB free, the offloaded state needs"):
        plan_run(resolve_config(argv), world=1)
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
    assert "Adam's step count restarts" in offload.check_resume(on_nvme, tag)  # allowed, said to be inexact
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
    dry_run(RunConfig(data=str(mix_path), profile="cpu", model="debug", out=str(tmp_path / "runs"), dry_run=True))
    said = [line for line in capsys.readouterr().out.splitlines() if "warning" in line and "lock" in line]
    assert said == [f"zerotrain: warning: {stale} is 11 min old: a DeepSpeed op build that was killed leaves it, and"
                    " loading deepspeed_shm_comm then waits on it forever; remove it if no other run here is"
                    " building that op"]
    os.utime(stale, None)  # a build going on now
    assert offload.stale_build_locks(tmp_path) == [] and offload.describe_stale_locks(tmp_path) == []
