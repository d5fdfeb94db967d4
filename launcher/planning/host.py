"""Host memory and the host link with offload (DeepSpeed 0.19.8's allocations, read from its
runtime/zero/stage_1_and_2.py, stage3.py and swap_tensor/), per node: with P/N the rank's partition, a the model's
dtype (2 in bf16/fp16, 4 in fp32), o the optimizer's state bytes (Adam 8):
- optimizer in host memory: fp32 master partition and optimizer states (4 + o)·P/N; gradients: at ZeRO-3
  the flat partition buffer in the model's dtype (the gradient accumulation dtype, DeepSpeed's default) and
  the fp32 gradients the optimizer steps, (a + 4)·P/N; at ZeRO-1/2 the fp32 partition 4·P/N, plus a·P/N
  accumulated per parameter on the host when grad-accum > 1; buffers at ZeRO-1/2: the 16-bit copy of the
  partition a·P/N and a staging buffer of the largest parameter;
- optimizer on NVMe: the gradient buffer a·P/N and `buffer_count` (4) swap buffers of the largest sub-group
  (min(sub_group_size, P/N) fp32 elements);
- parameters in host memory (ZeRO-3): their 16-bit partition a·P/N; on NVMe: min(max_in_cpu, P/N) of it
  and `buffer_count` × `buffer_size` swap buffers (5 × 1e8 elements by default);
- each rank's own resident memory before the model (0.6 GiB, measured here on CPU; a CUDA process maps
  more: not measured).
On a CPU node untouched pages cost nothing, so a swap buffer counts at most what is swapped (as buckets do
in memory.py), and host and device are the same RAM: the fit check adds the ranks' memory to it. Checked against
the CPU runs' offloaded tensors in tests/test_offload_runs.py (within 20%).

Traffic (`offload_traffic`): each step moves state over each GPU's host link, at the profile's
`zerotrain.hardware.host_link_gb_s` (GB/s, its source in `host_link_note`): the optimizer's gradients to the
host once per micro-batch and the updated 16-bit partition back once per step (a·P/N each), offloaded
parameters to the device for every forward, recomputation and backward (a·P/N each); not overlapped with
compute (an upper bound; DeepSpeed overlaps part of it), and neither CPU Adam's time nor NVMe's reads and
writes are counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.planning.hardware import HOST_PROCESS_BYTES, Setup
from zerotrain.launcher.planning.memory import DS_DEFAULTS, OFFLOAD, largest_layer, memory
from zerotrain.launcher.planning.units import GiB, gib, size_text
from zerotrain.modeling.sizes import count_params

# DeepSpeed 0.19.8's defaults for the swap sections (runtime/zero/offload_config.py)
DS_OFFLOAD_DEFAULTS = {"offload_param": {"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
                       "offload_optimizer": {"buffer_count": 4}}


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory a node's offloaded state takes, by component (ranks per node x one rank's)."""
    optimizer: float
    gradients: float
    parameters: float
    buffers: float
    processes: float  # the ranks' own resident memory (0 when nothing is offloaded)

    @property
    def state(self) -> float:
        return sum((self.optimizer, self.gradients, self.parameters, self.buffers))

    @property
    def total(self) -> float:
        return self.state + self.processes

    def as_dict(self) -> dict[str, float]:
        """The components, the state, the ranks' own memory and the total, in this order (the plan's)."""
        return {"optimizer": self.optimizer, "gradients": self.gradients, "parameters": self.parameters,
                "buffers": self.buffers, "state": self.state, "processes": self.processes, "total": self.total}


@dataclass(frozen=True)
class Traffic:
    """What one GPU moves over its host link per optimizer step with offload."""
    bytes_per_gpu: float
    seconds: float | None  # at the profile's host link (None: it names none; 0 when nothing moves)


def offload_devices(stage, zero: dict) -> dict[str, str]:
    """{"optimizer"/"parameters": "cpu" or "nvme"} a planner row offloads: an offload row its variant (on the
    device the profile's section names, else cpu), another row what its zero section says (ZeRO-3 with only
    the optimizer offloaded is row 3)."""
    sections = {"optimizer": "offload_optimizer", "parameters": "offload_param"}
    said = {what: (zero.get(section) or {}).get("device", "none") for what, section in sections.items()}
    if stage in OFFLOAD:
        wanted = ("optimizer",) if stage == "zero2_offload" else ("optimizer", "parameters")
        return {what: said[what] if said[what] != "none" else "cpu" for what in wanted}
    return {what: device for what, device in said.items() if device != "none"}


def host_memory(args, setup: Setup, stage, grad_accum: int = 1) -> HostMemory:
    """Bytes of host memory one node's offloaded state takes, by component (per rank x ranks per node), and
    `total` with the ranks' own memory; all 0 when the row offloads nothing."""
    devices = offload_devices(stage, setup.zero)
    if not devices:
        return HostMemory(0.0, 0.0, 0.0, 0.0, 0.0)
    part = count_params(args)["total"] / setup.world  # this rank's partition
    a = 2 if setup.mixed else 4
    section = {k: {**DS_OFFLOAD_DEFAULTS[k], **(setup.zero.get(k) or {})} for k in DS_OFFLOAD_DEFAULTS}
    out = {"optimizer": 0.0, "gradients": 0.0, "parameters": 0.0, "buffers": 0.0}
    zero_stage = int(stage[4]) if stage in OFFLOAD else stage
    _optimizer_on_host(out, devices.get("optimizer"), args, setup, zero_stage, part, a, grad_accum)
    _parameters_on_host(out, devices.get("parameters"), setup, part, a, section["offload_param"])
    n = setup.gpus_per_node
    return HostMemory(*(v * n for v in out.values()), processes=HOST_PROCESS_BYTES * n)


def _resident(setup: Setup, buffer_bytes: float, used_bytes: float) -> float:
    """A swap buffer's bytes: on a CPU node untouched pages cost nothing, so at most what is swapped."""
    return min(buffer_bytes, used_bytes) if setup.cpu else buffer_bytes


def _optimizer_on_host(out: dict, device: str | None, args, setup: Setup, stage: int, part: float, a: int,
                       grad_accum: int) -> None:
    """One rank's host bytes (into `out`) of an optimizer offloaded to `device` ("cpu", "nvme" or None)."""
    if device == "cpu":
        out["optimizer"] = (4 + setup.optimizer_bytes) * part
        if stage == 3:
            out["gradients"] = (a + 4) * part
        else:
            out["gradients"] = 4 * part + (a * part if grad_accum > 1 else 0)
            out["buffers"] += a * part + a * largest_layer(args)
    elif device == "nvme":
        sub_group = min(float(setup.zero.get("sub_group_size", DS_DEFAULTS["sub_group_size"])), part)
        count = {**DS_OFFLOAD_DEFAULTS["offload_optimizer"], **(setup.zero.get("offload_optimizer") or {})}
        out["gradients"] = a * part
        out["buffers"] += _resident(setup, count["buffer_count"] * sub_group * 4, (4 + setup.optimizer_bytes) * part)


def _parameters_on_host(out: dict, device: str | None, setup: Setup, part: float, a: int, swap: dict) -> None:
    """One rank's host bytes (into `out`) of ZeRO-3 parameters offloaded to `device` ("cpu", "nvme" or None)."""
    if device == "cpu":
        out["parameters"] = a * part
    elif device == "nvme":
        out["parameters"] = a * min(float(swap["max_in_cpu"]), part)
        out["buffers"] += _resident(setup, swap["buffer_count"] * float(swap["buffer_size"]) * a, a * part)


def offload_traffic(args, setup: Setup, stage, grad_accum: int, checkpointing: bool) -> Traffic:
    """Bytes one GPU moves over its host link per optimizer step with offload, and the seconds that takes at
    the profile's host link bandwidth (None when the profile names none; 0 bytes when nothing is offloaded)."""
    devices = offload_devices(stage, setup.zero)
    P = count_params(args)["total"]
    part = P / setup.world
    a = 2 if setup.mixed else 4
    moved = 0.0
    if "optimizer" in devices:  # gradients to the host every micro-batch, the updated partition back every step
        moved += a * part * grad_accum + a * part
    if "parameters" in devices:  # fetched for the forward, the recomputation under AC, and the backward
        moved += a * part * grad_accum * (3 if checkpointing else 2)
    rate = setup.host_link_bytes_per_s
    seconds = 0.0 if not moved else moved / rate if rate else None
    return Traffic(moved, seconds)


def host_verdict(need: float, host: float | None, what: str) -> str | None:
    """The one-line refusal when a node's host memory cannot hold the offloaded state (None: it can, or the
    host's size is unknown)."""
    if host is None or need <= host:
        return None
    return (f"does not fit on the host: the offloaded state needs {size_text(need / GiB)} of host memory per node,"
            f" {what} has {size_text(host / GiB)}; offload less (--offload optimizer or none), more nodes, or"
            " --nvme-path DIR")


def host_need(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
              grad_accum: int) -> tuple[HostMemory, float]:
    """(host_memory's components, the bytes a node's host memory must hold): the offloaded state and the ranks'
    own memory; on a CPU node, where host and device are the same RAM, the ranks' device memory as well."""
    host = host_memory(args, setup, stage, grad_accum)
    need = host.total
    if setup.cpu and offload_devices(stage, setup.zero):
        need += setup.gpus_per_node * memory(args, setup, stage, micro, seq_len, checkpointing).total
    return host, need


def offload_summary(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool,
                    grad_accum: int) -> dict:
    """The plan's `host_memory` (GiB per node by component, the node's need, the host's size, what is offloaded
    where, whether it fits) and `offload_traffic` (GB per step per GPU, the link's GB/s, the seconds it adds)."""
    host, need = host_need(args, setup, stage, micro, seq_len, checkpointing, grad_accum)
    traffic = offload_traffic(args, setup, stage, grad_accum, checkpointing)
    return {"host_memory": {**{f"{k}_gib": gib(v) for k, v in host.as_dict().items()}, "per_node_gib": gib(need),
                            "host_memory_gib": None if setup.host_bytes is None else gib(setup.host_bytes),
                            "offloaded": offload_devices(stage, setup.zero),
                            "fits": setup.host_bytes is None or need <= setup.host_bytes},
            "offload_traffic": {"gb_per_step_per_gpu": round(traffic.bytes_per_gpu / 1e9, 3),
                                "host_link_gb_s": None if setup.host_link_bytes_per_s is None
                                else setup.host_link_bytes_per_s / 1e9,
                                "seconds_per_step": 0.0 if setup.cpu else traffic.seconds}}


def host_check(args, setup: Setup, stage, micro: int, seq_len: int, checkpointing: bool, grad_accum: int,
               what: str) -> None:
    """Refuse (UsageError, one line) an offloaded run whose state a node's host memory (setup.host_bytes; None:
    unknown, not checked) cannot hold: the driver's fit check (the RAM available now) and --dry-run (the
    profile's zerotrain.hardware.host_memory_gib)."""
    if not offload_devices(stage, setup.zero):
        return
    need = host_need(args, setup, stage, micro, seq_len, checkpointing, grad_accum)[1]
    problem = host_verdict(need, setup.host_bytes, what)
    if problem:
        raise UsageError(f"{problem} [`zerotrain plan` for the table; --no-fit-check to try anyway]")
