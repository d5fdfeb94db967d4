"""Every place zerotrain relies on a DeepSpeed name that is not its public API, in one package, a part per concern:

    checkpoint   the save that fails on every rank together; a rollback after a universal resume
    offload      an offloaded optimizer's host-side state; a checkpoint saved with the optimizer on NVMe
    sequence     Ulysses sequence parallelism (mpu, all-to-all, gradient factor) and --tiled-mlp's TiledMLP
    launching    DeepSpeed's runner (flags, hosts) and the CPU all-reduce's /dev/shm buffer
    zero         a finished ZeRO-3 run freed, the fp32 master partitions, Muon, zero.Init's attributes

Each part lists the names it relies on in its NAMES (a `PrivateName`: the module, the name, what needs it, and
text its source must contain); each function names the DeepSpeed file (and function) it matches and the
releases it was checked against. Nothing else in the project touches a `_`-prefixed DeepSpeed attribute, replaces
one of the engine's members, or depends on a name DeepSpeed keeps inside a C++ source; the few undocumented
attributes modeling/ and the config layer read (they may not import this package) are read in
zerotrain/ds_attributes.py, named in ELSEWHERE and listed in PRIVATE_NAMES (tests/test_ds_private_names.py).

`check_deepspeed_version()` runs once in the driver, before the engine is built: inside the range in
`VERIFIED` it is silent; outside it, every name in `PRIVATE_NAMES` (every part's NAMES) is looked up in the
installed DeepSpeed. A missing name that a result depends on (a checkpoint write that cannot fail on one rank
alone, a rollback after a universal resume) is a UsageError, one line, exit 2; a missing name that is
only an optimisation (freeing memory between runs) is one warning line; all present is one warning
line saying the release is not verified. Checked: DeepSpeed 0.19.8 (the setup.cfg minimum: Muon as
we use it needs it).

The parts' functions are re-exported here (`ds_compat.tiled_mlp`). DeepSpeed is imported inside the functions:
this package is imported by light commands.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from pathlib import Path

from packaging.specifiers import SpecifierSet

from zerotrain.launcher.components.ds_compat import checkpoint, launching, offload, sequence, zero
from zerotrain.launcher.components.ds_compat.checkpoint import route_checkpoint_writes, stop_loading_universal
from zerotrain.launcher.components.ds_compat.launching import (SHM_BUFFER_NAME, allreduce_buffer_files,
                                                               runner_active_hosts, runner_parse_args,
                                                               shm_buffer_path, unlink_shm_buffer)
from zerotrain.launcher.components.ds_compat.names import VERIFIED, PrivateName
from zerotrain.launcher.components.ds_compat.offload import (OFFLOADED_STATE, cache_cpu_info,
                                                             continue_cpu_adam_bias_correction,
                                                             offloaded_state_bytes, restore_swapped_optimizer_state,
                                                             swapped_fp32_state_dict)
from zerotrain.launcher.components.ds_compat.sequence import (sequence_all_to_all, sequence_parallel_gradient_factor,
                                                              sequence_parallel_mpu, tiled_mlp)
from zerotrain.launcher.components.ds_compat.zero import (import_muon_compiling_on_first_use, muon_optimizer_class,
                                                          release_zero3_globals, zero_master_tensors)
from zerotrain.launcher.errors import UsageError

__all__ = ["VERIFIED", "PrivateName", "PRIVATE_NAMES", "PARTS", "ELSEWHERE", "OFFLOADED_STATE", "SHM_BUFFER_NAME",
           "deepspeed_version", "is_verified", "missing", "check_deepspeed_version", "route_checkpoint_writes",
           "stop_loading_universal", "allreduce_buffer_files", "runner_active_hosts", "runner_parse_args",
           "shm_buffer_path", "unlink_shm_buffer", "offloaded_state_bytes", "restore_swapped_optimizer_state",
           "cache_cpu_info", "continue_cpu_adam_bias_correction",
           "swapped_fp32_state_dict", "sequence_all_to_all", "sequence_parallel_gradient_factor",
           "sequence_parallel_mpu", "tiled_mlp", "import_muon_compiling_on_first_use", "muon_optimizer_class",
           "release_zero3_globals", "zero_master_tensors"]

PARTS = (checkpoint, offload, sequence, launching, zero)  # each lists its names in NAMES
PRIVATE_NAMES = tuple(entry for part in PARTS for entry in part.NAMES)

# The modules besides this package that read a DeepSpeed name listed above (the layers below components/ may not import
# this module): module -> the attribute names it reads. tests/test_ds_private_names.py fails on any other.
ELSEWHERE = {"zerotrain/ds_attributes.py": ("ds_id", "ds_shape", "ds_tensor", "basic_optimizer")}


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, from its package metadata (DeepSpeed itself is not imported)."""
    return importlib.metadata.version("deepspeed")


def is_verified(version: str) -> bool:
    return SpecifierSet(VERIFIED).contains(version, prereleases=True)


def missing(names=None) -> list[PrivateName]:
    """The entries of `names` (default PRIVATE_NAMES) the installed DeepSpeed does not have."""
    gone = []
    for entry in PRIVATE_NAMES if names is None else names:
        try:
            module = importlib.import_module(entry.module)
            if entry.file:
                text = (Path(module.__file__).parent / entry.file).read_text()
            else:
                obj = module
                for part in entry.name.split("."):
                    obj = getattr(obj, part)
                text = inspect.getsource(obj) if entry.source_has else ""
        except (ImportError, AttributeError, OSError, TypeError):
            gone.append(entry)
            continue
        if entry.source_has and entry.source_has not in text:
            gone.append(entry)
    return gone


def check_deepspeed_version() -> str | None:
    """Start-up check (the driver, before building the engine). None inside VERIFIED; outside it, a
    warning line to print, or a UsageError (exit 2) naming a missing name a result depends on."""
    version = deepspeed_version()
    if is_verified(version):
        return None
    gone = missing()
    where = f"DeepSpeed {version} is outside the range zerotrain was verified with ({VERIFIED})"
    broken = [m for m in gone if m.correctness]
    if broken:
        raise UsageError(f"{where} and lacks {_label(broken[0])}, needed so that {broken[0].needed_for};"
                         f" install deepspeed{VERIFIED}")
    if gone:
        return (f"zerotrain: warning: {where} and lacks {_label(gone[0])}: {gone[0].needed_for} no longer holds"
                f" (training is unaffected)")
    return f"zerotrain: warning: {where}; the DeepSpeed internals it relies on are present"


def _label(entry: PrivateName) -> str:
    return f"{entry.module}:{entry.file or entry.name}" + (f" ({entry.source_has!r})" if entry.source_has else "")
