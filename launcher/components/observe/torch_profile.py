"""What a torch.profiler window saw, in a few lines: the kernels that took the device's time, and the host syncs.

`summarize(prof)` reads a finished `torch.profiler.profile`: the top operators and kernels by self device time
(the CPU's where no accelerator was profiled), and how often the host waited for the device (synchronize calls
and device-to-host copies, which block the host until the queue drains). Used by --torch-profile
(participants/torch_profile.py) and benchmarks/gpu_peers.py.
"""
from __future__ import annotations

# host-side events after which the host has waited for the device (CUDA runtime names, as the profiler records them)
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
DEVICE_TO_HOST = ("Memcpy DtoH",)


def summarize(prof, top: int = 15) -> str:
    events = prof.key_averages()
    device = any(getattr(e, "self_device_time_total", 0) for e in events)
    key = "self_device_time_total" if device else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    lines = [f"top {len(rows)} by self {'device' if device else 'CPU'} time (of {total / 1e3:.1f} ms):"]
    for e in rows:
        t = getattr(e, key)
        lines.append(f"  {t / 1e3:9.2f} ms {100 * t / total:5.1f}%  x{e.count:<6d} {e.key[:110]}")
    syncs = {name: sum(e.count for e in events if e.key == name) for name in SYNC_EVENTS}
    copies = sum(e.count for e in events if any(d in e.key for d in DEVICE_TO_HOST))
    lines.append("host syncs: " + ", ".join(f"{name} x{n}" for name, n in syncs.items())
                 + f", device-to-host copies x{copies}")
    return "\n".join(lines) + "\n"
