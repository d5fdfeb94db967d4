"""What the memory of a run depends on besides the model: the hardware, the precision, the ZeRO section and the
optimizer (`Setup`, built from a profile and the run's resolved settings by `setup_from`), and the memory of this
machine (`available_ram`, `device_memory_here`).

- context: the CUDA context, cuBLAS/NCCL workspaces: the profile's `zerotrain.hardware.context_gib` (with
  its reason in `context_note`: the NVSwitch H100 profiles add NCCL's NVLS buffers), else 1 GiB per GPU
  process; or on a CPU node the resident size of a driver rank before it builds the model (0.6 GiB,
  measured here).
- fragmentation: 10% of everything but the context (PyTorch's caching allocator on a GPU, glibc's
  arenas on a CPU).
- the host's size: the profile's `zerotrain.hardware.host_memory_gib` (`zerotrain plan`, `--dry-run`), the RAM
  available now (a real run), or on a CPU node the RAM available.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.node import Node
from zerotrain.launcher.optimizers import state_bytes_per_param
from zerotrain.launcher.planning.units import GiB
from zerotrain.launcher.profiles import precision
from zerotrain.modeling.sizes import choose_attention, count_params

CUDA_CONTEXT_BYTES = 1.0 * GiB  # CUDA context + cuBLAS workspace + NCCL buffers per GPU process
CPU_PROCESS_BYTES = 0.6 * GiB  # RSS of a driver rank before the model (torch, deepspeed, datasets imported)
FRAGMENTATION = 0.10
HOST_PROCESS_BYTES = CPU_PROCESS_BYTES  # a rank's own resident memory before the model, measured on CPU


def optimizer_state_bytes(optimizer: str | None, args) -> float:
    """Bytes of optimizer state per parameter (Adam's 8 in DeepSpeed's formula): the optimizer registry's
    (launcher/optimizers.py `state_bytes_per_param`; Muon keeps 4 on 2-D block weights, 8 on embeddings, head and
    norms). `args`: the model, for an optimizer whose state differs between the two (None: the default's only)."""
    if args is None:
        return state_bytes_per_param(optimizer)
    counts = count_params(args)
    norms = args.n_layers * 2 * args.dim + args.dim
    return state_bytes_per_param(optimizer, counts["non_embedding"] - norms, counts["total"])


@dataclass(frozen=True)
class Setup:
    """What memory depends on besides the model: hardware, precision, ZeRO settings."""
    accelerator: str  # "cuda" or "cpu"
    gpus_per_node: int
    nodes: int
    device_bytes: float  # per GPU, or per rank on a CPU node
    mixed: bool  # bf16 / fp16
    zero: dict  # the profile's zero_optimization section
    optimizer_bytes: float = 8
    attention: str = "auto"  # as asked (--attention / zerotrain.attention); `kernel` is what runs
    context_bytes: float = CUDA_CONTEXT_BYTES  # per GPU process: the profile's hardware.context_gib, else 1 GiB
    sequence_parallel: int = 1  # ranks sharing each row: each holds the activations of seq_len / N positions
    host_bytes: float | None = None  # RAM of a node: hardware.host_memory_gib, or on a CPU node the RAM available
    host_link_bytes_per_s: float | None = None  # each GPU's link to the host: hardware.host_link_gb_s
    interconnect_bytes_per_s: float | None = None  # GPU to GPU within a node, per direction: hardware.interconnect_gb_s
    internode_bytes_per_s: float | None = None  # per GPU between nodes, per direction: hardware.internode_gb_s
    tiled_mlp: bool = False  # --tiled-mlp: the MLP's intermediates not kept (activation_bytes)
    compiled: bool = False  # blocks compiled (--compile, zerotrain.compile): fewer intermediates kept (activation_bytes)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def cpu(self) -> bool:
        return self.accelerator == "cpu"

    @property
    def kernel(self) -> str:
        """The attention kernel: auto resolved for this hardware and precision (varlen assumed in torch)."""
        return choose_attention(self.attention, self.accelerator, "bf16" if self.mixed else "fp32")


def setup_from(ds_config: dict, knobs: dict, world: int | None = None, nodes: int | None = None,
               device_bytes: float | None = None, optimizer: str | None = None, args=None,
               attention: str | None = None) -> Setup:
    """A Setup from a profile (DeepSpeed dict + the run's resolved settings, `plan.settings.values`: hardware,
    attention; a profile's zerotrain section holds the same keys), with hardware overrides.
    `attention`: --attention, else the profile's zerotrain.attention, else auto; one that cannot run
    on this hardware and precision is refused (UsageError)."""
    hw = knobs.get("hardware") or {}
    accel = hw.get("accelerator", "cuda")
    nodes = nodes or hw.get("nodes", 1)
    per_node = world // nodes if world else hw.get("devices_per_node", 1)
    if device_bytes is None:
        device_bytes = hw["device_memory_gib"] * GiB if "device_memory_gib" in hw else \
            available_ram() / per_node if accel == "cpu" else None
    if device_bytes is None:
        raise UsageError("the profile does not say how much memory a GPU has (zerotrain.hardware.device_memory_gib);"
                         " give --gpu-mem GiB")
    mixed = precision(ds_config) != "fp32"
    setup = Setup(accel, per_node, nodes, float(device_bytes), mixed, dict(ds_config.get("zero_optimization", {})),
                  optimizer_state_bytes(optimizer, args),
                  attention or knobs.get("attention") or "auto",
                  float(hw.get("context_gib", CUDA_CONTEXT_BYTES / GiB)) * GiB,
                  int(knobs.get("sequence_parallel") or 1),
                  float(hw["host_memory_gib"]) * GiB if "host_memory_gib" in hw else
                  available_ram() if accel == "cpu" else None,
                  float(hw["host_link_gb_s"]) * 1e9 if "host_link_gb_s" in hw else None,
                  *(float(hw[key]) * 1e9 if key in hw else None for key in ("interconnect_gb_s", "internode_gb_s")),
                  bool(knobs.get("tiled_mlp")), bool(knobs.get("compile")))
    try:
        setup.kernel
    except ValueError as e:
        raise UsageError(f"--attention {setup.attention}: {e}") from None
    return setup


def available_ram() -> float:
    """Bytes of RAM available now (MemAvailable), the budget of a CPU node's ranks."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory_here(accelerator: str, local_world: int) -> tuple[float, str, str]:
    """(bytes this rank may use, "cuda" or "cpu", what that is): the GPU's total memory, or the RAM
    available now divided among this node's ranks."""
    if accelerator != "cpu":
        node = Node.here()
        if node.device == "cuda":
            return node.memory, "cuda", f"{node.name}, {node.memory / GiB:.1f} GiB"
    ram = available_ram()
    return ram / local_world, "cpu", f"{ram / GiB:.1f} GiB RAM available / {local_world} local rank(s)"
