"""ZeRO-Offload before anything is built: the DeepSpeed ops a run will JIT-build (and how long that takes here),
libaio for NVMe, and room in --nvme-path. What --offload writes into the DeepSpeed dict is
launcher/offload/keys.py's `apply_offload`; the host memory and traffic it costs, launcher/planning/host.py's.
`check_offload_here` (moved from launcher/run_plan.py) runs these checks for a run before anything is built.

DeepSpeed builds its C++ ops on first use (torch.utils.cpp_extension, cached per user in
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR): DeepSpeedCPUAdam for an offloaded optimizer, the async
I/O op for NVMe. Measured here (2 cores, DeepSpeed 0.19.8): cpu_adam about 45 s, async_io about 3 min. A
build needs a C++ compiler, and async_io libaio's header as well; `DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 pip
install deepspeed` builds them at install time instead (docs/gpu.md).
"""
from __future__ import annotations

import ctypes.util
import os
import shutil
import time
from pathlib import Path

from zerotrain.launcher.config import check_nvme_dir
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import precision
from zerotrain.modeling.sizes import count_params

# op name (the extension's name) -> (what it is for, measured build seconds on this 2-core machine)
OPS = {"cpu_adam": ("DeepSpeedCPUAdam, the offloaded optimizer's step", 45),
       "async_io": ("the async I/O op that swaps offloaded state to --nvme-path", 180)}
LIBAIO_HEADERS = ("/usr/include/libaio.h", "/usr/local/include/libaio.h")
INSTALL_LIBAIO = "apt-get install libaio-dev"


def ops_needed(ds: dict) -> list[str]:
    """The JIT-built DeepSpeed ops a DeepSpeed dict needs: cpu_adam when DeepSpeed builds its CPU Adam for an
    offloaded optimizer (not when the optimizer section says torch_adam, nor for a client optimizer), async_io
    when anything goes to NVMe."""
    zero = ds.get("zero_optimization") or {}
    devices = {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    section = ds.get("optimizer") or {}
    needed = []
    if devices["offload_optimizer"] != "none" and str(section.get("type", "")).lower() in ("adam", "adamw") \
            and not (section.get("params") or {}).get("torch_adam"):
        needed.append("cpu_adam")
    if "nvme" in devices.values():
        needed.append("async_io")
    return needed


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension caches builds (its get_default_build_root, without importing torch)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path(os.path.expanduser("~/.cache/torch_extensions"))


# torch (cpp_extension._get_build_directory) builds an op NAME in ROOT/NAME with TORCH_EXTENSIONS_DIR set, and in
# ROOT/py311_cpu/NAME (python version, then cpu, cu128, ...) under its default root: both layouts are looked in
BUILD_DIRS = ("{op}", "*/{op}")


def is_built(op: str, root: Path | None = None) -> bool:
    """A cached build of `op` exists (ROOT/NAME/NAME.so, or ROOT/py311_cpu/NAME/NAME.so: BUILD_DIRS)."""
    return any(any((root or extensions_root()).glob(f"{where.format(op=op)}/{op}.so")) for where in BUILD_DIRS)


# torch.utils.cpp_extension guards a build with a `lock` in its folder (BUILD_DIRS; torch/utils/file_baton.py): a
# build that was killed leaves the file, and every later load waits on it forever, silently. A build takes minutes
# at most.
STALE_LOCK_S = 600


def stale_build_locks(root: Path | None = None, older_than_s: float = STALE_LOCK_S, now: float | None = None) -> list[Path]:
    """Build locks older than `older_than_s`: left by a JIT build that was killed (no build takes that long)."""
    now = time.time() if now is None else now
    locks = []
    root = root or extensions_root()
    for lock in sorted({lock for where in BUILD_DIRS for lock in root.glob(f"{where.format(op='*')}/lock")}):
        try:
            if now - lock.stat().st_mtime > older_than_s:
                locks.append(lock)
        except FileNotFoundError:  # released while we looked
            pass
    return locks


def describe_stale_locks(root: Path | None = None) -> list[str]:
    """The start-up's (and --dry-run's) warning for each stale build lock: the run would hang on it at the first
    DeepSpeed op it loads (on a CPU every run loads one: deepspeed_shm_comm)."""
    lines = []
    for lock in stale_build_locks(root):
        try:
            minutes = int((time.time() - lock.stat().st_mtime) // 60)
        except FileNotFoundError:
            continue
        lines.append(f"{lock} is {minutes} min old: a DeepSpeed op build that was killed leaves it, and loading"
                     f" {lock.parent.name} then waits on it forever; remove it if no other run here is building"
                     " that op")
    return lines


def offloaded(ds: dict) -> dict[str, str]:
    """{"optimizer"/"parameters": device} for what a DeepSpeed dict offloads ({} for nothing)."""
    zero = ds.get("zero_optimization") or {}
    devices = {what: (zero.get(section) or {}).get("device", "none")
               for what, section in (("optimizer", "offload_optimizer"), ("parameters", "offload_param"))}
    return {what: device for what, device in devices.items() if device != "none"}


def describe(ds: dict, root: Path | None = None) -> list[str]:
    """--dry-run's offload lines: what goes where (none when nothing is offloaded), then the ops to build."""
    zero = ds.get("zero_optimization") or {}
    where = {what: zero.get(section) or {} for what, section in (("optimizer states and fp32 master weights",
                                                                  "offload_optimizer"),
                                                                 ("parameters", "offload_param"))}
    moved = [f"{what} -> " + (f"nvme ({sub['nvme_path']})" if sub.get("device") == "nvme" else "host memory")
             for what, sub in where.items() if sub.get("device", "none") != "none"]
    if not moved:
        return []
    return ["offload (ZeRO-Offload): " + "; ".join(moved), *describe_builds(ds, root)]


def describe_builds(ds: dict, root: Path | None = None) -> list[str]:
    """One line per op the run needs, for --dry-run and start-up: built already, or JIT-built on first use."""
    lines = []
    for op in ops_needed(ds):
        what, seconds = OPS[op]
        if is_built(op, root):
            lines.append(f"DeepSpeed op {op} ({what}): built already ({root or extensions_root()})")
        else:
            lines.append(f"DeepSpeed op {op} ({what}): JIT-built on first use, about {seconds} s on 2 CPU cores"
                         f" (once per machine; cached in {root or extensions_root()})")
    return lines


def check_libaio(ds: dict, where: str, headers=None, root: Path | None = None) -> None:
    """NVMe offload needs DeepSpeed's async_io op; building it needs libaio's header. Refused in one line
    before anything is built when neither a cached build nor the header exists."""
    if "async_io" not in ops_needed(ds) or is_built("async_io", root):
        return
    if not any(Path(h).is_file() for h in headers or LIBAIO_HEADERS) or ctypes.util.find_library("aio") is None:
        raise UsageError(f"{where}: NVMe offload needs DeepSpeed's async_io op, which builds against libaio;"
                         f" libaio is not installed ({INSTALL_LIBAIO}, or pre-build the op: DS_BUILD_AIO=1)")


def nvme_paths(ds: dict) -> list[str]:
    """The --nvme-path directories a DeepSpeed dict swaps to (none without NVMe offload)."""
    zero = ds.get("zero_optimization") or {}
    return sorted({(zero.get(k) or {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
                   if (zero.get(k) or {}).get("device") == "nvme"})


def nvme_bytes(params: int, ds: dict, ranks_here: int, world: int) -> int:
    """Bytes the NVMe directory takes on this node: for an offloaded optimizer the fp32 master weights and
    Adam's two moments (12 bytes per parameter), for offloaded parameters their 16-bit (fp32: 4-byte) copy,
    each rank swapping its 1/world partition; `ranks_here` ranks share the directory."""
    zero = ds.get("zero_optimization") or {}
    per_param = 0
    if (zero.get("offload_optimizer") or {}).get("device") == "nvme":
        per_param += 12
    if (zero.get("offload_param") or {}).get("device") == "nvme":
        per_param += 4 if precision(ds) == "fp32" else 2
    return per_param * params * ranks_here // max(world, 1)


def check_nvme_space(path: str, need: int, where: str) -> None:
    """Refuse (one line) an NVMe directory without room for what will be swapped there."""
    free = shutil.disk_usage(path).free
    if free < need:
        raise UsageError(f"{where} {path}: {free / 2**30:.2f} GiB free, the offloaded state needs"
                         f" {need / 2**30:.2f} GiB on this node")


def check_resume(ds: dict, tag_dir: Path) -> None:
    """An optimizer swapped to NVMe is saved under TAG/offloaded_tensors/, and DeepSpeed 0.19 loads it from there
    only, and only then (engine.load_checkpoint skips the ZeRO optimizer state with the optimizer on NVMe, and
    checkpointer.load restores what it skips from that state): a resume cannot move the optimizer between NVMe and
    memory. Refused in one line before anything is built."""
    saved = (tag_dir / "offloaded_tensors").is_dir()
    here = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") == "nvme"
    if saved and not here:
        raise UsageError(f"checkpoint {tag_dir}: its optimizer state was saved from NVMe (offloaded_tensors/), which"
                         " DeepSpeed loads only with the optimizer on NVMe again: resume with the same --nvme-path"
                         " and --offload")
    if here and not saved:
        raise UsageError(f"checkpoint {tag_dir}: its optimizer state was saved from memory, and DeepSpeed loads an"
                         " optimizer on NVMe only from a checkpoint saved with it there: resume without --nvme-path")


def check_offload_here(ds_config: dict, model_args, world: int, dry_run: bool) -> None:
    """NVMe offload: its directory (a profile's too) takes files and has room for this node's share, and the
    async I/O op can be built (libaio); a dry run checks libaio and the directory, not the room."""
    for path in nvme_paths(ds_config):
        check_nvme_dir(path, "--nvme-path")
        check_libaio(ds_config, f"--nvme-path {path}")
        if not dry_run:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            need = nvme_bytes(count_params(model_args)["total"], ds_config, local, world)
            check_nvme_space(path, need, "--nvme-path")
