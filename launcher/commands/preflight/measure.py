"""What pre-flight's stages measure with: state digests, peak memory, rates, and the thresholds they judge by.

Plain helpers, no process group (unit-tested without one); torch is imported where tensors are handled.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path

from zerotrain import ds_attributes
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.hooks import SlowLoader, TestHooks
from zerotrain.launcher.node import Node

DATA_RATIO_MIN = 2.0  # the loader must produce at least twice what the model consumes (headroom for hiccups)
DATA_WAIT_MAX = 0.10  # at most 10% of a step waiting on data
NVME_PROBE_BYTES = 256 * 2**20  # per rank: large enough to pass a drive's write cache, small enough for seconds
SIGTERM_GRACE_S = 30  # DeepSpeed's launcher kills the ranks 30 s after forwarding SIGTERM
GiB = 2 ** 30


def rehearsal_steps(max_steps: int) -> int:
    """v3's default N from the run's scale: 1% of the run, at least 20 and at most 200 steps."""
    return min(max_steps, max(20, min(200, max_steps // 100)))


def device_description() -> str:
    return Node.here().name


def peak_rss() -> float | None:
    """Peak RSS of this process since the last `reset_peak_rss` (Linux /proc), bytes."""
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0): a sweep candidate's peak is its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def master_tensors(engine) -> tuple[object, list]:
    """(the torch optimizer inside DeepSpeed's wrapper, the tensors it updates on this rank: the fp32
    master partitions under ZeRO). ZeRO-3 hands its partitions to the torch optimizer only for the
    length of a step (stage3.py `_optimizer_step`), so they are read from the wrapper there."""
    return ds_compat.zero_master_tensors(engine)  # DeepSpeed's internals are read there


def state_digests(engine) -> dict[str, tuple[str, float]]:
    """Per tensor of this rank's training state: (sha256 of its bytes, its sum).

    The module's parameters as this rank holds them (its ZeRO-3 partition `ds_tensor`, else the
    tensor), the fp32 master partitions and their optimizer state (exp_avg, ...). Hashes, not
    copies: the comparison needs no second copy of the model in memory."""
    import torch

    out = {}

    def add(name, t):
        t = t.detach().reshape(-1).contiguous().cpu()
        out[name] = (hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:20], float(t.double().sum()))

    for name, p in engine.module.named_parameters():
        add(f"parameter {name}", ds_attributes.held(p))
    inner, masters = master_tensors(engine)
    for i, p in enumerate(masters):
        add(f"fp32 master partition {i}", p)
        for key, value in inner.state.get(p, {}).items():
            if torch.is_tensor(value):
                add(f"{key} of fp32 master partition {i}", value)
    return out


def slowed(loader, hooks: TestHooks):
    """Test hook (ZEROTRAIN_TEST_SLOW_LOADER, components/hooks.py): the loader, S seconds slower per batch."""
    return SlowLoader(loader, hooks.slow_loader_s) if hooks.slow_loader_s else loader


def rate(x: float) -> str:
    return f"{x / 1e6:,.2f}M" if x >= 1e6 else f"{x / 1e3:,.1f}k" if x >= 1e3 else f"{x:,.0f}"


def disk_throughput(directory: Path, size: int = NVME_PROBE_BYTES, block: int = 4 * 2**20) -> dict:
    """Write and read throughput of `directory` (v2's NVMe check, at --nvme-path): `size` incompressible bytes
    written to a new file there in `block`-sized writes and fsync'd (the time includes the fsync), the file's
    pages then dropped from the page cache (posix_fadvise DONTNEED: a file system that ignores it reads from
    memory), read back; the file removed. {"bytes", "write_bytes_per_s", "read_bytes_per_s"}. Buffered I/O, not
    DeepSpeed's O_DIRECT async I/O: a lower bound on what its swapping gets from the same drive."""
    path = Path(directory) / f".zerotrain-nvme-probe-{os.getpid()}"
    data = os.urandom(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            t0 = time.perf_counter()
            written = 0
            while written < size:
                written += os.write(fd, data[:min(block, size - written)])
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            read = 0
            while chunk := os.read(fd, block):
                read += len(chunk)
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": written, "write_bytes_per_s": written / max(write_s, 1e-9),
            "read_bytes_per_s": read / max(read_s, 1e-9)}


def all_to_all_seconds(exchange, shapes: list[tuple[int, ...]], dtype, device: str, synchronize,
                       rounds: int = 3) -> float:
    """Seconds one layer's forward exchanges take through `exchange` (the run's all-to-all over the
    sequence-parallel group): one tensor per shape in `shapes` ((N, B, T/N, heads/N, hd): q, k, v, the kernel's
    output), the median of `rounds` after one untimed round (the group's first use sets up its connections).
    Every rank of the group must call it with the same shapes; `synchronize()` waits for the device and
    lines the group's ranks up (a barrier), so a round times the exchanges, not a late rank."""
    import statistics

    import torch

    tensors = [torch.ones(shape, dtype=dtype, device=device) for shape in shapes]
    times = []
    for i in range(rounds + 1):
        synchronize()
        t0 = time.perf_counter()
        for t in tensors:
            exchange(t)
        synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
