"""A few steps under torch.profiler, summarised as text: where the device time goes and how often the host waits.

    summary = summarize(prof, steps=3)   # prof: a finished torch.profiler.profile

Two parts, both read from the profiler's own aggregation (`prof.key_averages()`), nothing re-timed:
- the top kernels by self device time (CUDA kernels, memcpy and memset), with their share of all device time,
  calls and milliseconds per step; a profile with no device activity (a CPU run) lists the top operators by
  self CPU time instead, and says so;
- where there is device activity, the device's idle time: from its first recorded kernel (or copy) to its
  last, the time no kernel ran on any stream (the union of the device events' intervals from `prof.events()`,
  subtracted): the gaps in which the device waited for the host to queue work;
- where that idle time is (`idle_gaps`): every gap of at least GAP_US between the device's busy intervals,
  grouped by what the host was doing when it began (the innermost operators open at that moment on the thread
  that launched the kernel ending it: a `cudaStreamSynchronize` under an optimizer's `.item()`, or Python between
  two launches when only a step's annotation is open) and by the operator that launched that kernel; the
  largest groups, in milliseconds a step. This is what the device's idle line cannot say: which host work the
  device waited for;
- the host syncs: every event by which the host waits for the device (HOST_SYNC_EVENTS: the CUDA runtime's
  synchronize calls, device-to-host copies, and the aten operators that read a device value on the host), with
  its count.

Used by `benchmarks/gpu_peers.py` for its plain loop and by the driver's `--torch-profile START:COUNT`
(RUN_DIR/torch_profile/summary.txt). torch is not imported here: the caller owns the profiler.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass

TOP = 15
# Names under which the host waits for the device. The CUDA runtime's: the synchronize calls and the
# device-to-host copies (a blocking cudaMemcpy, or the "Memcpy DtoH" a .item()/.cpu() issues). aten's:
# _local_scalar_dense is every .item()/int()/bool() of a tensor, nonzero sizes its output from the device's
# data; on a GPU both block the host (on a CPU they are counted all the same: the same code syncs on a GPU).
HOST_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                    "aten::_local_scalar_dense", "aten::nonzero")
HOST_SYNC_PREFIXES = ("Memcpy DtoH",)
GAP_US = 50.0  # an idle gap longer than a kernel launch's few microseconds: the host was behind, not just launching
GAP_GROUPS = 8  # groups of gaps listed
PATH_DEPTH = 3  # operators named in a path, innermost first


def _device_us(event) -> float:
    # torch >= 2.4 names it self_device_time_total (self_cuda_time_total before, removed later)
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0)


def device_events(events) -> list:
    """Every profiler event that ran on a device (not the CPU) for some time: kernels, memcpy and memset, from
    `prof.events()` (FunctionEvent: `device_type`, `time_range`)."""
    return [e for e in events
            if getattr(e.device_type, "name", "CPU") != "CPU" and e.time_range.end > e.time_range.start]


def device_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device event (`device_events`)."""
    return [(e.time_range.start, e.time_range.end) for e in device_events(events)]


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


@dataclass(frozen=True)
class Gap:
    """One idle gap of the device: from `start` to `end` (microseconds) no kernel ran on any stream. `host`: the
    operators open on the launching thread when it began, innermost first; `ended_by`: the operator that launched
    the kernel ending it, then its parents (both () where the profile did not record them)."""
    start: float
    end: float
    host: tuple[str, ...]
    ended_by: tuple[str, ...]


def _bare(name: str) -> str:
    return re.sub(r"#\d+$", "", name)  # "ProfilerStep#7" and the like: one group for every step


def _path(event, depth: int = PATH_DEPTH) -> tuple[str, ...]:
    names = []
    while event is not None and len(names) < depth:
        names.append(_bare(event.name))
        event = getattr(event, "cpu_parent", None)
    return tuple(names)


def idle_gaps(events, min_us: float = GAP_US) -> list[Gap]:
    """The device's idle gaps of at least `min_us` in `prof.events()` (FunctionEvent after the profiler built its
    tree: `cpu_parent`; a device event's `linked_correlation_id` is the `id` of the operator that launched it),
    with what the host was doing at each gap's start and which operator ended it (see the module docstring).

    The innermost operator open at time t on a thread is the latest one to start at or before t, or the nearest
    of its parents still open at t: a thread's operators nest, so any operator open at t holds that latest one."""
    device = sorted(device_events(events), key=lambda e: e.time_range.start)
    if not device:
        return []
    host = [e for e in events if getattr(e.device_type, "name", "CPU") == "CPU" and not getattr(e, "is_async", False)]
    launchers = {e.id: e for e in host if not getattr(e, "linked_correlation_id", 0)}
    by_thread: dict = {}
    for e in sorted(host, key=lambda e: e.time_range.start):
        by_thread.setdefault(e.thread, []).append(e)
    starts = {t: [e.time_range.start for e in evs] for t, evs in by_thread.items()}
    main = max(by_thread, key=lambda t: len(by_thread[t])) if by_thread else None

    def open_at(thread, t):
        evs = by_thread.get(thread, [])
        i = bisect_right(starts.get(thread, []), t) - 1
        event = evs[i] if i >= 0 else None
        while event is not None and event.time_range.end < t:
            event = getattr(event, "cpu_parent", None)
        return event

    gaps, end = [], device[0].time_range.end
    for e in device[1:]:
        if e.time_range.start - end >= min_us:
            launcher = launchers.get(getattr(e, "linked_correlation_id", 0))
            thread = launcher.thread if launcher is not None else main
            gaps.append(Gap(end, e.time_range.start, _path(open_at(thread, end)), _path(launcher)))
        end = max(end, e.time_range.end)
    return gaps


def gap_lines(gaps: list[Gap], per: int, scope: str, groups: int = GAP_GROUPS) -> list[str]:
    """The summary's lines on `gaps`: their total, then the largest groups by (host, ended_by)."""
    if not gaps:
        return [f"no idle gap of {GAP_US:.0f} us or more over {scope}"]
    totals: dict = {}
    for g in gaps:
        ms, n = totals.get((g.host, g.ended_by), (0.0, 0))
        totals[(g.host, g.ended_by)] = (ms + (g.end - g.start) / 1e3, n + 1)
    idle = sum(ms for ms, _ in totals.values())
    lines = [f"device idle in gaps of {GAP_US:.0f} us or more over {scope}: {idle / per:,.2f} ms per step in"
             f" {len(gaps) / per:,.1f} gaps a step; the largest by where the host was when one began -> what"
             " launched the kernel that ended it (innermost operator first):",
             f"{'ms/step':>9} {'gaps/step':>9}  host at the gap's start -> ended by"]
    for (where, ended), (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:groups]:
        said = " < ".join(where) or "no operator open"
        lines.append(f"{ms / per:>9.3f} {n / per:>9.1f}  {said[:90]} -> {' < '.join(ended)[:90] or 'not recorded'}")
    return lines


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
        lines += gap_lines(idle_gaps(prof.events()), per, scope)
    syncs = host_syncs(averages)
    said = ", ".join(f"{name} {count}" for name, count in syncs.items()) or "none"
    lines.append(f"host syncs over {scope}: {sum(syncs.values())} ({said})")
    return "\n".join(lines) + "\n"
