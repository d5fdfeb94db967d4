"""launcher/components/observe/torch_profile.py: the profiler summary, on a real torch.profiler run on the CPU."""
import torch
from torch.profiler import ProfilerActivity, profile

from zerotrain.launcher.components.observe.torch_profile import host_syncs, summarize


def test_summary_lists_the_costliest_operators_and_counts_every_host_sync():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    mask = torch.rand(4096) > 0.5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # three "steps": a large matmul, two .item() and one nonzero each
            c = a @ b
            float(c.sum())
            int(mask.sum())
            mask.nonzero()
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
