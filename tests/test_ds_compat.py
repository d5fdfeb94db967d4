"""launcher/components/ds_compat/: the DeepSpeed internals zerotrain relies on are where it says, in the
DeepSpeed installed here, and a DeepSpeed outside the verified range is met with one line at start-up.

Only our own function that reads the version string (and, for the refusal, our own table of names) is
faked; every lookup goes to the real DeepSpeed.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import free_port

from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.ds_compat import PrivateName
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.trainer import run


def test_every_private_name_is_in_the_installed_deepspeed():
    assert ds_compat.is_verified(ds_compat.deepspeed_version()), "the DeepSpeed under test is the verified one"
    assert ds_compat.missing() == []


def test_inside_the_verified_range_is_silent(monkeypatch):
    monkeypatch.setattr(ds_compat, "deepspeed_version", lambda: "0.19.8")
    assert ds_compat.check_deepspeed_version() is None
    monkeypatch.setattr(ds_compat, "deepspeed_version", lambda: "0.19.12")
    assert ds_compat.check_deepspeed_version() is None


@pytest.mark.parametrize("version", ["0.20.0", "0.19.7", "1.0.0rc1"])
def test_outside_the_range_with_every_name_present_is_one_warning(monkeypatch, version):
    monkeypatch.setattr(ds_compat, "deepspeed_version", lambda: version)
    line = ds_compat.check_deepspeed_version()
    assert line.startswith("zerotrain: warning: DeepSpeed " + version) and ds_compat.VERIFIED in line
    assert "\n" not in line


def test_a_missing_name_needed_for_correctness_is_exit_2_and_an_optimisation_a_warning(monkeypatch):
    monkeypatch.setattr(ds_compat, "deepspeed_version", lambda: "0.21.0")
    gone = PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._renamed_in_a_later_release",
                       "a failed checkpoint write fails the save on every rank", True)
    monkeypatch.setattr(ds_compat, "PRIVATE_NAMES", (*ds_compat.PRIVATE_NAMES, gone))
    with pytest.raises(UsageError) as e:
        ds_compat.check_deepspeed_version()
    assert "DeepSpeed 0.21.0" in str(e.value) and "_renamed_in_a_later_release" in str(e.value)
    assert "\n" not in str(e.value)
    # the same name, relied on only for memory: a warning, the run goes on
    monkeypatch.setattr(ds_compat, "PRIVATE_NAMES",
                        (*ds_compat.PRIVATE_NAMES[:-1], PrivateName(gone.module, gone.name, "memory", False)))
    line = ds_compat.check_deepspeed_version()
    assert line.startswith("zerotrain: warning:") and "_renamed_in_a_later_release" in line


def test_source_text_probe_sees_a_changed_function(monkeypatch):
    """A name that exists but no longer does what we rely on (its source lacks the text) counts as missing."""
    real = [n for n in ds_compat.PRIVATE_NAMES if n.source_has and not n.file][0]
    changed = PrivateName(real.module, real.name, real.needed_for, True, source_has="self._config.no_such_flag")
    assert ds_compat.missing([real]) == [] and ds_compat.missing([changed]) == [changed]


def test_the_driver_refuses_before_writing_anything(tmp_path, mix_path, monkeypatch):
    """The start-up check runs in the Trainer before the process group, the lock or the run directory."""
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29699").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ds_compat, "deepspeed_version", lambda: "0.21.0")
    monkeypatch.setattr(ds_compat, "PRIVATE_NAMES", (PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._gone",
                                                                 "checkpoint writes", True),))
    out = tmp_path / "runs"
    with pytest.raises(UsageError, match="DeepSpeed 0.21.0 is outside"):
        run(config_from({"data": str(mix_path), "model": "debug", "profile": "cpu", "seq_len": 64, "micro_batch": 2,
                         "max_steps": 2, "out": str(out), "resume": "never", "fit_check": False}))
    assert not out.exists()


SHM = r"""
import os
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.process_group import init_process_group
path, real, seen = ds_compat.shm_buffer_path(0), ds_compat.unlink_shm_buffer, []

def unlink_after_looking(rank):  # what DeepSpeed's init_distributed made, seen just before joining removes it
    seen.append(path.exists() and rank == 0)
    seen.append(ds_compat.allreduce_buffer_files(os.environ["MASTER_PORT"]) == [path]
                and path in ds_compat.allreduce_buffer_files() and ds_compat.allreduce_buffer_files(1) == [])
    real(rank)

ds_compat.unlink_shm_buffer = unlink_after_looking
init_process_group()  # DeepSpeed's init_distributed, as every rank of ours joins; then its buffer's name goes
print("SHM", *seen, path.exists())
"""


@pytest.mark.launches
def test_shm_buffer_name_is_the_one_deepspeed_creates_and_joining_removes_it(tmp_path):
    """DeepSpeed's CPU all-reduce buffer, made by the real init_distributed (LOCAL_SIZE: all ranks local),
    is found under the name ds_compat computes, listed by allreduce_buffer_files (for its port, for every port,
    not for another port), and removed by init_process_group, which every process of ours joins through (a
    2-rank launch that leaves none: tests/test_universal.py)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # not pid-derived: 29500 is held by the xdist controller
    r = subprocess.run([sys.executable, "-c", SHM], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SHM True True False" in r.stdout, r.stdout[-2000:]


def test_py_cpuinfo_is_asked_once_a_process_and_each_caller_gets_its_own_copy(monkeypatch):
    """DeepSpeed's CPU ops and CPU Adam/Lion call cpuinfo.get_cpu_info() several times a rank, each a Python
    subprocess (ds_compat.cache_cpu_info): after it, the first answer serves every later call, as DeepSpeed's
    own `from cpuinfo import get_cpu_info` inside its functions reads it."""
    import cpuinfo
    from deepspeed.ops.op_builder import CPUAdamBuilder

    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"arch": "X86_64", "flags": ["avx2"],
                                                                            "vendor_id_raw": "AuthenticAMD"})
    ds_compat.cache_cpu_info()
    ds_compat.cache_cpu_info()  # wrapped once, not twice
    first = cpuinfo.get_cpu_info()
    first["arch"] = "changed by a caller"
    builder = CPUAdamBuilder()  # what DeepSpeed's op loads ask (cpu_arch, simd_width)
    assert builder.cpu_arch() == "-march=native" and builder.simd_width() == "-D__AVX256__"
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(asked) == 1


def test_deepspeeds_muon_module_is_imported_with_its_kernels_compiled_on_first_use(monkeypatch):
    """Every ZeRO engine build imports DeepSpeed's Muon module, whose kernels are wrapped by torch.compile at
    import (dynamo's and inductor's wrappers, ~1 CPU-s a rank): ds_compat.import_muon_compiling_on_first_use
    imports it with torch.compile called at each kernel's first call instead, once, with the decorator's
    options, and torch.compile itself restored. Here torch.compile is a recorder that returns the function as
    it is, so the kernel's answer must be the eager one."""
    import deepspeed.runtime.zero.muon as package
    import torch

    for name in ("muon_optimizer", "original_muon"):  # imported afresh; the worker's own put back after
        monkeypatch.delitem(sys.modules, f"{package.__name__}.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    compiled = []

    def recorder(model=None, **options):
        compiled.append((getattr(model, "__name__", model), options))
        return model

    monkeypatch.setattr(torch, "compile", recorder)
    ds_compat.import_muon_compiling_on_first_use()
    assert torch.compile is recorder and compiled == []  # nothing wrapped at import
    from deepspeed.runtime.zero.muon import original_muon

    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    first = original_muon.zeropower_via_newtonschulz5(grad, 3)
    again = original_muon.zeropower_via_newtonschulz5(grad, 3)
    assert compiled == [("zeropower_via_newtonschulz5", {})]  # wrapped at the first call, and only then
    eager = original_muon.zeropower_via_newtonschulz5.__wrapped__(grad, 3)
    assert torch.equal(first, eager) and torch.equal(again, eager)
    ds_compat.import_muon_compiling_on_first_use()  # already imported: nothing done again
    assert sys.modules[ds_compat.zero.MUON_MODULE].MuonWithAuxAdam is ds_compat.muon_optimizer_class()
