"""A few steps under torch.profiler, summarised as text: where the device time goes and how often the host waits.

    summary = summarize(prof, steps=3)   # prof: a finished torch.profiler.profile

Two parts, both read from the profiler's own aggregation (`prof.key_averages()`), nothing re-timed:
- the top kernels by self device time (CUDA kernels, memcpy and memset), with their share of all device time,
  calls and milliseconds per step; a profile with no device activity (a CPU run) lists the top operators by
  self CPU time instead, and says so;
- where there is device activity, the device's idle time: from its first recorded kernel (or copy) to its
  last, the time no kernel ran on any stream (the union of the device events' intervals from `prof.events()`,
  subtracted): the gaps in which the device waited for the host to queue work;
- the host syncs: every event by which the host waits for the device (HOST_SYNC_EVENTS: the CUDA runtime's
  synchronize calls, device-to-host copies, and the aten operators that read a device value on the host), with
  its count.

Used by `benchmarks/gpu_peers.py` for its plain loop and by the driver's `--torch-profile START:COUNT`
(RUN_DIR/torch_profile/summary.txt). torch is not imported here: the caller owns the profiler.
"""
from __future__ import annotations

TOP = 15
# Names under which the host waits for the device. The CUDA runtime's: the synchronize calls and the
# device-to-host copies (a blocking cudaMemcpy, or the "Memcpy DtoH" a .item()/.cpu() issues). aten's:
# _local_scalar_dense is every .item()/int()/bool() of a tensor, nonzero sizes its output from the device's
# data; on a GPU both block the host (on a CPU they are counted all the same: the same code syncs on a GPU).
HOST_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                    "aten::_local_scalar_dense", "aten::nonzero")
HOST_SYNC_PREFIXES = ("Memcpy DtoH",)


def _device_us(event) -> float:
    # torch >= 2.4 names it self_device_time_total (self_cuda_time_total before, removed later)
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0)


def device_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every profiler event that ran on a device (not the CPU): kernels, memcpy
    and memset, from `prof.events()` (FunctionEvent: `device_type`, `time_range`)."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if getattr(e.device_type, "name", "CPU") != "CPU" and e.time_range.end > e.time_range.start]


def busy_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span): the length of the union of the intervals (kernels overlapping on several streams counted
    once) and the time from the first start to the last end. span - busy is the device's idle time."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy, (start, end) = 0.0, ordered[0]
    for s, e in ordered[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    return busy + end - start, end - ordered[0][0]  # `end`: the latest end seen


def host_syncs(averages) -> dict[str, int]:
    """{event name: count} of the host-sync events in `prof.key_averages()`, most frequent first."""
    counts = {e.key: int(e.count) for e in averages
              if e.key in HOST_SYNC_EVENTS or e.key.startswith(HOST_SYNC_PREFIXES)}
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize(prof, steps: int | None = None, top: int = TOP) -> str:
    """The text summary of a finished profiler run (see the module docstring); `steps`: how many training steps
    it covered, for the per-step figures."""
    averages = prof.key_averages()
    per = max(1, steps or 1)
    device = sorted((e for e in averages if _device_us(e) > 0), key=_device_us, reverse=True)
    if device:
        total = sum(_device_us(e) for e in device)
        title = f"top {min(top, len(device))} of {len(device)} kernels by self device time"
        rows = [(e.key, _device_us(e), int(e.count)) for e in device[:top]]
    else:
        cpu = sorted((e for e in averages if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                     reverse=True)
        total = sum(e.self_cpu_time_total for e in cpu)
        title = f"no device activity recorded: top {min(top, len(cpu))} of {len(cpu)} operators by self CPU time"
        rows = [(e.key, float(e.self_cpu_time_total), int(e.count)) for e in cpu[:top]]
    scope = f"{steps} step(s)" if steps else "the profiled region"
    lines = [f"{title} over {scope}: {total / 1e3 / per:,.2f} ms per step in all",
             f"{'ms/step':>9} {'share':>6} {'calls':>7}  name"]
    for name, us, count in rows:
        lines.append(f"{us / 1e3 / per:>9.3f} {us / total if total else 0:>6.1%} {count:>7}  {name[:110]}")
    if device:
        busy, span = busy_span(device_intervals(prof.events()))
        idle = span - busy
        lines.append(f"device idle over {scope}: {idle / 1e3 / per:,.2f} ms per step of {span / 1e3 / per:,.2f} from"
                     f" its first kernel to its last ({idle / span if span else 0:.1%}; no kernel on any stream:"
                     " the device waiting for the host)")
    syncs = host_syncs(averages)
    said = ", ".join(f"{name} {count}" for name, count in syncs.items()) or "none"
    lines.append(f"host syncs over {scope}: {sum(syncs.values())} ({said})")
    return "\n".join(lines) + "\n"
