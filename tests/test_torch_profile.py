"""launcher/components/observe/torch_profile.py: the profiler summary, on a real torch.profiler run on the CPU."""
import torch
from torch.profiler import ProfilerActivity, profile

from zerotrain.launcher.components.observe.torch_profile import host_syncs, summarize


def test_summary_lists_the_costliest_operators_and_counts_every_host_sync():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    mask = torch.rand(4096) > 0.5

    def step():  # a large matmul (~270 MFLOP), two .item() and one nonzero
        c = a @ b
        float(c.sum())
        int(mask.sum())
        mask.nonzero()

    step()  # each operator's first call (thread pool, kernel dispatch) outside the profile: it once outran the matmul
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # three "steps"
            step()
    text = summarize(prof, steps=3)
    lines = text.splitlines()
    assert lines[0].startswith("no device activity recorded: top ") and "over 3 step(s)" in lines[0]
    assert lines[2].split()[-1] == "aten::mm", text  # the matmul is the costliest by far
    assert host_syncs(prof.key_averages()) == {"aten::_local_scalar_dense": 6, "aten::nonzero": 3}
    assert lines[-1] == "host syncs over 3 step(s): 9 (aten::_local_scalar_dense 6, aten::nonzero 3)"
    assert len(summarize(prof, top=2).splitlines()) == 2 + 2 + 1  # title, header, 2 rows, syncs


def test_a_region_without_syncs_says_none():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64).exp_()
    assert summarize(prof).splitlines()[-1] == "host syncs over the profiled region: 0 (none)"


def test_device_idle_is_the_span_less_the_union_of_the_device_events():
    """The device's idle time (summarize's line where a device ran): kernels on two streams overlapping count
    once, the gaps between them are idle; CPU events are not the device's."""
    from types import SimpleNamespace

    from zerotrain.launcher.components.observe.torch_profile import busy_span, device_intervals

    def event(kind, start, end):
        return SimpleNamespace(device_type=SimpleNamespace(name=kind), time_range=SimpleNamespace(start=start, end=end))

    events = [event("CUDA", 10, 20), event("CUDA", 15, 30), event("CPU", 0, 100), event("CUDA", 40, 45),
              event("CUDA", 42, 44), event("CUDA", 60, 60), event("CUDA", 70, 80)]
    intervals = device_intervals(events)
    assert intervals == [(10, 20), (15, 30), (40, 45), (42, 44), (70, 80)]  # the CPU's and the empty one left out
    assert busy_span(intervals) == (20 + 5 + 10, 70)  # busy 10-30, 40-45, 70-80; span 10-80: 35 ms idle
    assert busy_span(list(reversed(intervals))) == (35, 70) and busy_span([]) == (0.0, 0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # a real CPU profile: no device events
        torch.randn(64, 64).exp_()
    assert device_intervals(prof.events()) == []


def _event(name, start, end, thread=1, parent=None, id=0, linked=0, kind="CPU"):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           cpu_parent=parent, id=id, linked_correlation_id=linked,
                           device_type=SimpleNamespace(name=kind), is_async=False)


def _step(offset, n):
    """One step's events, shifted by `offset` us: the device runs a matmul's kernel (0-600), the host meanwhile
    reaches an optimizer's .item() and waits in cudaStreamSynchronize (510-690), then launches a multiply (710):
    the device is idle 600-730, waiting for the host's sync and the launch after it; a 20 us gap (800-820) is a
    launch's latency, not counted."""
    step = _event(f"ProfilerStep#{n}", offset, offset + 1000)
    opt = _event("Optimizer.step", offset + 500, offset + 900, parent=step)
    item = _event("aten::item", offset + 500, offset + 700, parent=opt)
    sync = _event("cudaStreamSynchronize", offset + 510, offset + 690, parent=item)
    mm = _event("aten::mm", offset + 10, offset + 20, parent=step, id=100 + n)
    mul = _event("aten::mul_", offset + 710, offset + 720, parent=opt, id=200 + n)
    launch = _event("cudaLaunchKernel", offset + 711, offset + 715, parent=mul, linked=200 + n)
    kernels = [_event("gemm", offset + 20, offset + 600, linked=100 + n, kind="CUDA"),
               _event("mul_kernel", offset + 730, offset + 800, linked=200 + n, kind="CUDA"),
               _event("mul_kernel", offset + 820, offset + 830, linked=200 + n, kind="CUDA")]
    return [step, opt, item, sync, mm, mul, launch, *kernels]


def test_idle_gaps_name_what_the_host_was_doing_and_what_ended_them():
    """idle_gaps on events shaped like a GPU profile's (see _step): each gap of GAP_US or more is found, with the
    host's innermost open operators at its start (the sync under the optimizer's .item(), not the earlier and
    finished matmul launch) and the operator that launched the kernel ending it; the steps' own numbers
    (ProfilerStep#1, #2) do not split the groups. A gap between steps (830 to 1020) is found too: the host was
    still in the first step's optimizer, and the second step's matmul ended it."""
    from zerotrain.launcher.components.observe.torch_profile import GAP_US, gap_lines, idle_gaps

    assert GAP_US == 50.0  # the fixture's 20 us gap is under it, its 130 us gap over it
    events = _step(0, 1) + _step(1000, 2)
    gaps = idle_gaps(events)
    assert [(g.start, g.end) for g in gaps] == [(600, 730), (830, 1020), (1600, 1730)]
    assert gaps[0].host == ("cudaStreamSynchronize", "aten::item", "Optimizer.step")
    assert gaps[0].ended_by == ("aten::mul_", "Optimizer.step", "ProfilerStep")
    assert gaps[1].host == ("Optimizer.step", "ProfilerStep") and gaps[1].ended_by == ("aten::mm", "ProfilerStep")
    assert gaps[2] == gaps[0].__class__(1600, 1730, gaps[0].host, gaps[0].ended_by)
    lines = gap_lines(gaps, per=2, scope="2 step(s)")
    assert lines[0].startswith("device idle in gaps of 50 us or more over 2 step(s): 0.23 ms per step in 1.5 gaps")
    assert lines[2].split() == ["0.130", "1.0", "cudaStreamSynchronize", "<", "aten::item", "<", "Optimizer.step",
                                "->", "aten::mul_", "<", "Optimizer.step", "<", "ProfilerStep"]
    assert lines[3].split()[:2] == ["0.095", "0.5"] and len(lines) == 4
    assert idle_gaps([e for e in events if e.device_type.name == "CPU"]) == []
    assert gap_lines([], 1, "x") == ["no idle gap of 50 us or more over x"]
