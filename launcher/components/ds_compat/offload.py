"""ZeRO-Offload's internals: the host-side state an offloaded optimizer holds (measured against the planner), and
a checkpoint saved with the optimizer on NVMe restored (resume) and read (export). The offload room is
launcher/offload/; this is its DeepSpeed part."""
from __future__ import annotations

from pathlib import Path

from zerotrain.launcher.components.ds_compat.names import PrivateName

NVME_RESUME = "a resume with the optimizer on NVMe restores the optimizer state DeepSpeed's load skips"
NVME_EXPORT = "zerotrain export reads the fp32 weights of a checkpoint saved with the optimizer on NVMe"
CPU_ADAM_RESUME = "a resume with ZeRO-Offload's CPU Adam continues the uninterrupted run's bias correction"

# the DeepSpeed names this part relies on (ds_compat.PRIVATE_NAMES gathers them; check_deepspeed_version)
NAMES = (
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._get_zero_ckpt_name", NVME_RESUME, True),
    *(PrivateName("deepspeed.runtime.zero.stage3", f"DeepSpeedZeroOptimizer_Stage3.{name}", NVME_RESUME, True)
      for name in ("_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups")),
    PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers", NVME_RESUME,
                True, source_has="self._prepare_sub_group(sub_group_id, timer_names)"),
    PrivateName("deepspeed.runtime.swap_tensor.optimizer_utils", "OptimizerSwapper._get_state_tensors", NVME_RESUME,
                True, source_has="value.ds_id = state_name + '-' + parameter.ds_id"),
    PrivateName("deepspeed.runtime.swap_tensor.optimizer_utils", "OptimizerSwapper.purge_state", NVME_RESUME, True,
                source_has="swap_info.has_state_tensors = False"),
    PrivateName("deepspeed.runtime.swap_tensor.optimizer_utils", "SwapTensorContext.__init__", NVME_EXPORT, True,
                source_has="f'{OptimizerSwapper.parameter_id(tensor)}.tensor.swp'"),
    PrivateName("deepspeed.utils.zero_to_fp32", "_get_fp32_state_dict_from_zero3_checkpoint", NVME_EXPORT, True),
    PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._configure_offloading", NVME_RESUME,
                True, source_has="self.swap_optimizer = offload_optimizer_config.device == OffloadDeviceEnum.nvme"),
    PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict", NVME_RESUME,
                True, source_has="self.loss_scaler = state_dict[LOSS_SCALER]"),
    PrivateName("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param", NVME_EXPORT, True,
                source_has="param.ds_id = Init.param_id"),  # a swapped partition's file is named by its ds_id
    PrivateName("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam.step", CPU_ADAM_RESUME, True,
                source_has="self.ds_opt_adam.adam_update(self.opt_id, state['step'], group['lr'], beta1, beta2,"),
    PrivateName("deepspeed", "", CPU_ADAM_RESUME, True, file="ops/csrc/includes/cpu_adam.h",
                source_has="if (step == _step + 1) {  // first optimizer step increase"),
)


# DeepSpeed 0.19.8's attributes that hold an offloaded run's host-side state (stage_1_and_2.py `__init__` and
# `async_accumulate_grad_in_cpu_via_gpu`; stage3.py `_create_fp16_partitions_with_defragmentation`,
# `_create_fp32_partitions`, `_setup_for_real_optimizer`): name -> what the planner calls it
OFFLOADED_STATE = {"single_partition_of_fp32_groups": "optimizer", "fp32_partitioned_groups_flat": "optimizer",
                   "grad_partitions_flat_buffer": "gradients", "accumulated_grads_in_cpu": "gradients",
                   "param_groups_fp16_flat_cpu_memory": "parameters",
                   "param_buffer_of_bit16_for_cpu_offload_groups": "buffers",
                   "temp_grad_buffer_for_cpu_offload": "buffers"}


def offloaded_state_bytes(engine) -> dict[str, int]:
    """Bytes of the tensors an offloaded ZeRO optimizer keeps on the host, by the planner's components
    (launcher/planning `host_memory`), each storage counted once: the fp32 master partitions and the inner
    optimizer's state ("optimizer"), the fp32 gradients the optimizer steps (the master partitions' .grad) and
    DeepSpeed's gradient buffers ("gradients"), the offloaded 16-bit parameter partitions ("parameters"), the
    16-bit copy and staging buffers ("buffers"); attributes per OFFLOADED_STATE (DeepSpeed 0.19.8). Read after
    the first optimizer step (Adam's moments exist only then)."""
    import torch

    wrapper = engine.optimizer
    seen: set[int] = set()
    out = {"optimizer": 0, "gradients": 0, "parameters": 0, "buffers": 0}

    def add(what: str, obj) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                out[what] += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                add(what, v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                add(what, v)

    for name, what in OFFLOADED_STATE.items():
        add(what, getattr(wrapper, name, None))
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # the fp32 gradients
        add("gradients", [t.grad for t in getattr(wrapper, name, None) or () if t.grad is not None])
    add("optimizer", list(getattr(wrapper, "optimizer", wrapper).state.values()))
    return out


# -- the optimizer swapped to NVMe -----------------------------------------------------------------

def restore_swapped_optimizer_state(engine, tag_dir: Path) -> bool:
    """After `engine.load_checkpoint(tag_dir)` with the optimizer swapped to NVMe: restore what DeepSpeed's load
    skips, so the resume continues as the uninterrupted run would, bit for bit (tests/test_offload_runs.py).
    False, and nothing done, when the engine does not swap its optimizer.

    Matches DeepSpeed 0.19.8. engine.py load_checkpoint: with `zero_nvme_offload_optimizer()` it skips
    `_load_zero_checkpoint` (so stage3.py `_rigid_load_state_dict` never runs), copies TAG/offloaded_tensors/rankNN
    (the swap files of the fp32 master partitions and of Adam's moments) back into the swap folder and calls
    `optimizer.reset_swap_buffers()`. What stays lost is what `_rigid_load_state_dict` would have restored
    from this rank's ZeRO file (`engine._get_zero_ckpt_name`): the inner optimizer's state_dict (Adam's `step`
    per partition, so bias correction restarted; the param_groups' lr, betas, eps, weight decay) and the
    loss scaler (`loss_scaler`, `dynamic_loss_scale`, `overflow`). Worse than the step count: the swapper
    (runtime/swap_tensor/optimizer_utils.py) reads a partition's moments back from their files only once
    `optimizer.state[partition]` holds them (`_get_state_tensors`, at the next `_get_param_swap_info`), so
    with an empty state DeepSpeedCPUAdam starts new zero moments and overwrites the copied files.

    Restored here as `_rigid_load_state_dict` does it (`_set_fp32_optimizer_param_groups`, the inner
    optimizer's `load_state_dict`, `_clear_fp32_optimizer_param_groups`). The saved moments are the empty
    tensors the swapper leaves in memory (`release_memory`): each becomes a tensor of the partition's length
    (`fp16_partitioned_groups_flat_numel`), which the swapper can register, and `reset_swap_buffers()` once
    more swaps every sub-group in (the moments read from the copied files into those tensors) and out again,
    leaving the state as a run that never stopped has it between steps. Before that the swapper forgets the
    state tensors it had registered (`optimizer_swapper.purge_state()`, as `_rigid_load_state_dict` does after its
    own load): in a live engine (a rollback, --on-spike rollback) it holds those load_state_dict replaced.
    """
    import torch

    wrapper = engine.optimizer
    if not getattr(wrapper, "swap_optimizer", False):
        return False
    saved = engine.checkpoint_engine.load(engine._get_zero_ckpt_name(str(tag_dir.parent), tag_dir.name),
                                          map_location=torch.device("cpu"))["optimizer_state_dict"]
    wrapper.loss_scaler = saved["loss_scaler"]
    wrapper.dynamic_loss_scale = saved["dynamic_loss_scale"]
    wrapper.overflow = saved["overflow"]
    inner = wrapper.optimizer
    wrapper._set_fp32_optimizer_param_groups()
    try:
        inner.load_state_dict(saved["optimizer_state_dict"])
    finally:
        wrapper._clear_fp32_optimizer_param_groups()
    for sub_group, partition in enumerate(wrapper.fp32_partitioned_groups_flat):
        numel = int(wrapper.fp16_partitioned_groups_flat_numel[sub_group])
        state = inner.state.get(partition, {})
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == 0 < numel:  # released by the swapper
                state[key] = torch.zeros(numel, dtype=value.dtype)  # its values: read from the file below
    wrapper.optimizer_swapper.purge_state()  # a live engine's (a rollback's) swapper holds the replaced tensors
    wrapper.reset_swap_buffers()
    return True


def cache_cpu_info() -> None:
    """py-cpuinfo's get_cpu_info() answers from a Python subprocess it starts on every call (0.6-1.1 CPU-s each on
    a 2-core host) and keeps nothing; DeepSpeed asks it at each CPU op's load (OpBuilder.cpu_arch and simd_width)
    and in every DeepSpeedCPUAdam and DeepSpeedCPULion: 3 calls a rank for a run with `--offload optimizer`
    (6.4 of a 2-rank debug launch's 18.5 CPU-s, measured), more where a process builds several engines. The CPU
    does not change under a running process, so the first answer is kept for the process (a copy handed to each
    caller). Wrapped once (py-cpuinfo is a dependency of DeepSpeed's and ours: setup.cfg)."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "zerotrain_cached", False):
        return
    ask, answer = cpuinfo.get_cpu_info, []

    def get_cpu_info() -> dict:
        if not answer:
            answer.append(ask())
        return dict(answer[0])

    get_cpu_info.zerotrain_cached = True
    cpuinfo.get_cpu_info = get_cpu_info


def continue_cpu_adam_bias_correction(optimizer) -> int:
    """After a checkpoint's state is loaded into DeepSpeedCPUAdam (ZeRO-Offload's optimizer): bring its C++
    optimizer's bias-correction terms to the values the uninterrupted run holds, so that the resumed run's
    updates are that run's bit for bit. Returns the step replayed to (0: not a DeepSpeedCPUAdam, or no state).

    Matches DeepSpeed 0.19.8, csrc/includes/cpu_adam.h `Adam_Optimizer::IncrementStep`: the C++ object (one per
    `opt_id`) keeps beta1**t and beta2**t in float, multiplied by beta once per step when steps come one by one,
    and recomputed as `std::pow(beta, step)` when the step it is given jumps. A resumed run's new object meets
    step s + 1 first and takes the pow, where the uninterrupted run holds s + 1 products: they differ in the last
    bit for some s (5 of this project's 6-step test, betas 0.9/0.95: the exported weights 7.5e-9 apart, 30 of 39
    tensors, with every logged loss equal), and the difference lives on in every later update. The C++ state
    has no setter; its one way in is `adam_update`, which steps the given tensors: the calls the run made
    (steps 1..s, each param group's betas in order) are made again on one scratch element, leaving the C++
    object as the uninterrupted run's. Cost at start-up: 0.15 s for 100,000 steps on this project's CPU host."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return 0
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    if not steps:
        return 0
    step = max(steps)  # the same for every partition: each is stepped once per optimizer step
    scratch = [torch.zeros(1) for _ in range(4)]  # a parameter, its gradient and Adam's two moments
    for k in range(1, step + 1):
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, k, group["lr"], beta1, beta2, group["eps"],
                                              group["weight_decay"], group["bias_correction"], *scratch)
    return step


def swapped_fp32_state_dict(tag_dir: Path) -> dict:
    """The consolidated fp32 weights of a ZeRO-3 checkpoint saved with the optimizer swapped to NVMe, which
    DeepSpeed 0.19.8's zero_to_fp32 cannot build itself: each rank's ZeRO file holds an empty tensor for every
    fp32 master partition that was swapped (the swapper's released memory), the values being in the swap
    file the save copied to TAG/offloaded_tensors/rankNN/.

    Matches DeepSpeed 0.19.8. engine.py save_checkpoint copies the swap folder of global rank N (dp rank N
    without model or sequence parallelism) to offloaded_tensors/rank{N:02d} (`dp_index_to_str`); stage3.py
    `_create_fp32_partitions` names a swapped partition `ds_id` "FIRST_LAST" (the ds_ids of its sub-group's
    first and last parameters), an attribute torch.save keeps with the empty tensor;
    swap_tensor/optimizer_utils.py `SwapTensorContext` writes it raw (no header) to `{ds_id}.tensor.swp`, its
    length rounded up to the I/O alignment, so the partition is the file's first `numel` values. A sub-group's
    length on each rank is the sum of its parameters' ZeRO-3 partitions (ceil(numel / world)), its
    parameters being `param_shapes[sub_group]` in the model-states file (engine.py `_get_zero_param_shapes`:
    one dict per stage-3 sub-group, `fp16_groups`). The files read are those DeepSpeed's own zero_to_fp32
    reads (utils/zero_to_fp32.py parse_model_states, parse_optim_states), then each swapped partition is
    read from its file, and the rest is zero_to_fp32's own consolidation
    (`_get_fp32_state_dict_from_zero3_checkpoint`, `to_torch_tensor`). ValueError when a file is missing or
    short.
    """
    import math

    import torch
    from deepspeed.utils import zero_to_fp32 as z

    model_states = z.parse_model_states(z.get_model_state_files(str(tag_dir)))
    stage, world, flat_groups, _ = z.parse_optim_states(z.get_optim_files(str(tag_dir)), str(tag_dir))
    if stage != 3:
        raise ValueError(f"its ZeRO files are of stage {stage}; DeepSpeed swaps an optimizer to NVMe at ZeRO-3 only")
    lengths = [sum(math.ceil(shape.numel() / world) for shape in group.values())
               for group in model_states[0].param_shapes]
    for rank, groups in enumerate(flat_groups):
        if len(groups) != len(lengths):
            raise ValueError(f"rank {rank}'s ZeRO file has {len(groups)} fp32 partitions, its model states"
                             f" {len(lengths)} sub-groups")
        for sub_group, (flat, numel) in enumerate(zip(groups, lengths)):
            if flat.numel() == numel:  # kept in memory (too small to swap): saved with its values
                continue
            swap = tag_dir / "offloaded_tensors" / f"rank{rank:02d}" / f"{getattr(flat, 'ds_id', '?')}.tensor.swp"
            if not swap.is_file() or swap.stat().st_size < numel * flat.element_size():
                raise ValueError(f"rank {rank}'s fp32 partition {sub_group} ({numel:,} values) was swapped, and"
                                 f" {swap} is missing or shorter")
            groups[sub_group] = torch.from_file(str(swap), shared=False, size=numel, dtype=flat.dtype)
    merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states,
                                                          exclude_frozen_parameters=False)
    return z.to_torch_tensor(merged)
