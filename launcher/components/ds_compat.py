"""Every place zerotrain relies on a DeepSpeed name that is not its public API, in one module.

Each function below names the DeepSpeed file (and function) it matches and the releases it was
checked against. Nothing else in the project touches a `_`-prefixed DeepSpeed attribute, replaces
one of the engine's members, or depends on a name DeepSpeed keeps inside a C++ source; the few undocumented
attributes modeling/ and the config layer read (they may not import this module) are read in
zerotrain/ds_attributes.py, named in ELSEWHERE and listed in PRIVATE_NAMES (tests/test_ds_private_names.py).

`check_deepspeed_version()` runs once in the driver, before the engine is built: inside the range in
`VERIFIED` it is silent; outside it, every name in `PRIVATE_NAMES` is looked up in the installed
DeepSpeed. A missing name that a result depends on (a checkpoint write that cannot fail on one rank
alone, a rollback after a universal resume) is a UsageError, one line, exit 2; a missing name that is
only an optimisation (freeing memory between runs) is one warning line; all present is one warning
line saying the release is not verified. Checked: DeepSpeed 0.19.8 (the setup.cfg minimum: Muon as
we use it needs it).

DeepSpeed is imported inside the functions: this module is imported by light commands.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet

from zerotrain.launcher.errors import UsageError

VERIFIED = ">=0.19.8,<0.20"  # every function below was read against these releases' source


@dataclass(frozen=True)
class PrivateName:
    """One DeepSpeed name we rely on: `module` imported, then `name` (dotted) looked up in it; or, with
    `file`, that file of the installed package read. `source_has`: text the name's source must contain."""
    module: str
    name: str
    needed_for: str
    correctness: bool  # True: a result is wrong (or a launch hangs) without it; False: an optimisation
    source_has: str = ""
    file: str = ""


NVME_RESUME = "a resume with the optimizer on NVMe restores the optimizer state DeepSpeed's load skips"
NVME_EXPORT = "zerotrain export reads the fp32 weights of a checkpoint saved with the optimizer on NVMe"
PRIVATE_NAMES = (
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._copy_recovery_script",
                "a failed checkpoint write on one rank fails the save on every rank (no hang)", True),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint",
                "a failed checkpoint write on one rank fails the save on every rank (no hang)", True,
                source_has="self.checkpoint_engine.makedirs"),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine.load_universal_checkpoint",
                "a rollback after a resume on another world size loads its own checkpoint", True,
                source_has="self._config.load_universal_checkpoint"),
    PrivateName("deepspeed.launcher.runner", "parse_args", "zerotrain launch: deepspeed flags checked", True),
    PrivateName("deepspeed.launcher.runner", "parse_inclusion_exclusion",
                "zerotrain launch --hostfile: the hosts DeepSpeed will use", True),
    PrivateName("deepspeed.launcher.runner", "apply_num_nodes_and_gpus",
                "zerotrain launch --hostfile: the hosts DeepSpeed will use", True),
    PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._optimizer_step",
                "zerotrain preflight compares the fp32 master partitions of a resumed ZeRO-3 run", True,
                source_has="fp32_partitioned_groups_flat"),
    PrivateName("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK",
                "a notebook's finished ZeRO-3 run frees its model", False),
    PrivateName("deepspeed.runtime.zero.partitioned_param_coordinator",
                "PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release",
                "a notebook's finished ZeRO-3 run frees its model", False),
    PrivateName("deepspeed.runtime.zero.muon.muon_optimizer", "MuonWithAuxAdam",
                "--optimizer muon: the built engine is checked to step with DeepSpeed's Muon", True),
    PrivateName("deepspeed.sequence.layer", "_dim_zero_all_to_all",
                "--sequence-parallel: the Ulysses all-to-all around attention", True,
                source_has="_dim_zero_all_to_all_op(input.contiguous(), group.group_name)"),
    PrivateName("deepspeed.sequence.layer", "register_all_to_all_group",
                "--sequence-parallel: the Ulysses all-to-all around attention", True),
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "initialize_sequence_parallel",
                "--sequence-parallel: ZeRO reduces and partitions over the sequence-data-parallel group", True),
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_release_sequence_parallel_groups",
                "--sequence-parallel: a second engine in one process with another sequence-parallel size", False),
    PrivateName("deepspeed.runtime.sequence_parallel.ulysses_sp", "TiledMLP",
                "--tiled-mlp: each MLP computed over tiles of positions", True,
                source_has="param.ds_grad_is_ready = False"),
    PrivateName("deepspeed.runtime.zero.stage3",
                "DeepSpeedZeroOptimizer_Stage3.reduce_independent_p_g_buckets_and_remove_grads",
                "--tiled-mlp at ZeRO-3: a weight's gradient is reduced once, summed over its tiles", True,
                source_has='getattr(param, "ds_grad_is_ready", True)'),
    PrivateName("deepspeed.runtime.zero.stage_1_and_2",
                "DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads",
                "--tiled-mlp at ZeRO-1/2: a weight's gradient is reduced once, summed over its tiles", True,
                source_has='getattr(param, "ds_grad_is_ready", True)'),
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
    PrivateName("deepspeed.runtime.sequence_parallel.parallel_state_sp", "_SEQUENCE_PARALLEL_GROUP",
                "--sequence-parallel: a second engine in one process reuses or replaces the groups", True),
    *(PrivateName("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.__init__",
                  "--sequence-parallel at ZeRO-3: the gradient factor of the engine's averaging path", True,
                  source_has=f"self.{name} = {name}") for name in ("all2all_process_group", "reduce_scatter")),
    # read in zerotrain/ds_attributes.py (ELSEWHERE below), for modeling/ and the config layer
    *(PrivateName("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param", needed_for, True,
                  source_has=text) for text, needed_for in (
        ("param.ds_id = Init.param_id", "a ZeRO-3 model loads its initial weights (modeling gathered, hf load)"),
        ("param.ds_shape = param.shape", "--optimizer muon at ZeRO-3: each matrix is checked by its real shape"),
        ("param.ds_tensor = None", "zerotrain preflight and the parameter count read each rank's ZeRO-3 partition"))),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._configure_optimizer",
                "--optimizer muon: the built engine is checked to step with DeepSpeed's Muon", True,
                source_has="self.basic_optimizer = basic_optimizer"),
    PrivateName("deepspeed", "", "each CPU launch removes its 66 MB /dev/shm buffer", False,
                source_has='#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"', file="ops/csrc/cpu/comm/shm.cpp"),
)

# The modules besides this one that read a DeepSpeed name listed above (the layers below components/ may not import
# this module): module -> the attribute names it reads. tests/test_ds_private_names.py fails on any other.
ELSEWHERE = {"zerotrain/ds_attributes.py": ("ds_id", "ds_shape", "ds_tensor", "basic_optimizer")}


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, from its package metadata (DeepSpeed itself is not imported)."""
    return importlib.metadata.version("deepspeed")


def is_verified(version: str) -> bool:
    return SpecifierSet(VERIFIED).contains(version, prereleases=True)


def missing(names=None) -> list[PrivateName]:
    """The entries of `names` (default PRIVATE_NAMES) the installed DeepSpeed does not have."""
    gone = []
    for entry in PRIVATE_NAMES if names is None else names:
        try:
            module = importlib.import_module(entry.module)
            if entry.file:
                text = (Path(module.__file__).parent / entry.file).read_text()
            else:
                obj = module
                for part in entry.name.split("."):
                    obj = getattr(obj, part)
                text = inspect.getsource(obj) if entry.source_has else ""
        except (ImportError, AttributeError, OSError, TypeError):
            gone.append(entry)
            continue
        if entry.source_has and entry.source_has not in text:
            gone.append(entry)
    return gone


def check_deepspeed_version() -> str | None:
    """Start-up check (the driver, before building the engine). None inside VERIFIED; outside it, a
    warning line to print, or a UsageError (exit 2) naming a missing name a result depends on."""
    version = deepspeed_version()
    if is_verified(version):
        return None
    gone = missing()
    where = f"DeepSpeed {version} is outside the range zerotrain was verified with ({VERIFIED})"
    broken = [m for m in gone if m.correctness]
    if broken:
        raise UsageError(f"{where} and lacks {_label(broken[0])}, needed so that {broken[0].needed_for};"
                         f" install deepspeed{VERIFIED}")
    if gone:
        return (f"zerotrain: warning: {where} and lacks {_label(gone[0])}: {gone[0].needed_for} no longer holds"
                f" (training is unaffected)")
    return f"zerotrain: warning: {where}; the DeepSpeed internals it relies on are present"


def _label(entry: PrivateName) -> str:
    return f"{entry.module}:{entry.file or entry.name}" + (f" ({entry.source_has!r})" if entry.source_has else "")


# -- the engine -------------------------------------------------------------------------------------

def route_checkpoint_writes(engine, guard) -> None:
    """Send every file write of `engine.save_checkpoint` through `guard` (components/checkpoints/checkpointer.py's
    _WriteGuard, which has the checkpoint engine's interface).

    Matches deepspeed/runtime/engine.py (0.19.8): save_checkpoint, _save_checkpoint,
    _save_zero_checkpoint and _create_checkpoint_file write only through `self.checkpoint_engine`
    (makedirs, save); rank 0 also copies the recovery scripts with `self._copy_recovery_script(save_path)`
    (a shutil.copyfile outside the checkpoint engine), which is wrapped here.
    """
    engine.checkpoint_engine = guard
    copy_scripts = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        engine._copy_recovery_script = lambda save_path: guard.run(copy_scripts, save_path)


def stop_loading_universal(engine) -> None:
    """After a universal resume: later load_checkpoint calls of this engine (a rollback to one of our
    own same-world tags) read the regular layout again.

    Matches deepspeed/runtime/engine.py (0.19.8): DeepSpeedEngine.load_universal_checkpoint() returns
    `self._config.load_universal_checkpoint`, read only inside load_checkpoint and _load_checkpoint.
    """
    engine._config.load_universal_checkpoint = False


def release_zero3_globals(module) -> None:
    """For the notebook's repeated runs: ZeRO-3 module-level state that keeps a finished run's module (and through its hooks
    the engine) alive after engine.destroy(); a notebook's next run() would add ~1 GB each time.

    Matches (0.19.8) deepspeed/runtime/zero/parameter_offload.py: DeepSpeedZeRoOffload.
    setup_zero_stage3_hooks appends the top module to the global FWD_MODULE_STACK and never pops it;
    deepspeed/runtime/zero/partitioned_param_coordinator.py: PartitionedParameterCoordinator.
    __params_to_release is an unbounded functools.lru_cache keyed by (coordinator, submodule), wrapped
    by instrument_w_nvtx (deepspeed/utils/nvtx.py: a closure, no __wrapped__), so the cache is found
    in the wrapper's closure. Each part is skipped when absent (check_deepspeed_version warns).
    """
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if stack is not None:
        stack[:] = [m for m in stack if m is not module]
    release = vars(PPC).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(release, "__closure__", None) or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def zero_master_tensors(engine) -> tuple[object, list]:
    """(the torch optimizer inside DeepSpeed's ZeRO wrapper, the tensors it updates on this rank: the
    fp32 master partitions under ZeRO; the parameters without ZeRO).

    Matches (0.19.8) deepspeed/runtime/zero/stage_1_and_2.py and stage3.py: the wrapper keeps the torch
    optimizer as `.optimizer` (`init_optimizer`); ZeRO-1/2 put their fp32 partitions in its param_groups;
    ZeRO-3 hands its `fp32_partitioned_groups_flat` to it only for the length of a step (`_optimizer_step`
    swaps them in), so they are read from the wrapper.
    """
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    return inner, list(flats) if flats is not None else [p for g in inner.param_groups for p in g["params"]]


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


# -- the CPU shared-memory all-reduce ---------------------------------------------------------------

SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME (checked in PRIVATE_NAMES above)


def shm_buffer_path(rank: int) -> Path:
    """The file DeepSpeed's CPU shared-memory all-reduce maps for `rank` of this launch.

    Matches deepspeed/ops/csrc/cpu/comm/shm.cpp (0.19.8), shm_initialize: SHM_BUFFER_NAME
    "deepspeed_allreduce_buffer", then "_%d_%s_%s" of getuid(), MASTER_ADDR, MASTER_PORT, then "_%d"
    of the rank; shm_open puts it under /dev/shm.
    """
    return Path(f"/dev/shm/{SHM_BUFFER_NAME}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def allreduce_buffer_files(port: int | str | None = None) -> list[Path]:
    """This user's CPU shared-memory all-reduce buffers in /dev/shm (named as shm_buffer_path says): those of
    the launch whose MASTER_PORT is `port`, or of every launch (None). A killed launch leaves its buffers
    (~66 MB a rank) behind; whoever started it removes them with these names."""
    pattern = f"{SHM_BUFFER_NAME}_{os.getuid()}_*" + (f"_{port}_*" if port is not None else "")
    return sorted(Path("/dev/shm").glob(pattern))


def unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's ~66 MB shared-memory all-reduce buffer, which DeepSpeed creates in
    init_distributed and never removes (a test suite or a notebook leaks RAM with every launch).

    Safe once init_distributed has returned and a collective has completed: every rank has mapped every
    buffer by then (shm.cpp's shm_initialize spins until they exist), and the mappings stay valid until
    the processes exit; only the name goes.
    """
    try:
        os.unlink(shm_buffer_path(rank))
    except OSError:
        pass


# -- DeepSpeed's launcher (deepspeed/launcher/runner.py) -------------------------------------------

def runner_parse_args(argv: list[str]):
    """DeepSpeed's runner flags parsed by the runner's own parser (SystemExit on an error, as argparse).

    Matches deepspeed/launcher/runner.py (0.19.8) parse_args(args): the `deepspeed` command's parser,
    module-level, not part of DeepSpeed's documented API.
    """
    from deepspeed.launcher.runner import parse_args

    return parse_args(argv)


def runner_active_hosts(hosts, include: str, exclude: str, num_nodes: int, num_gpus: int):
    """The hosts and slots DeepSpeed's runner will use, by its own filters.

    Matches deepspeed/launcher/runner.py (0.19.8): parse_inclusion_exclusion(resource_pool,
    inclusion, exclusion) (ValueError on a bad filter), then apply_num_nodes_and_gpus(active_resources,
    num_nodes, num_gpus), as its main() applies them.
    """
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    return apply_num_nodes_and_gpus(parse_inclusion_exclusion(hosts, include, exclude), num_nodes, num_gpus)


def muon_optimizer_class():
    """DeepSpeed's Muon optimizer class, which the engine builds for `"optimizer": {"type": "Muon"}`
    (deepspeed/runtime/zero/muon/muon_optimizer.py MuonWithAuxAdam; engine.py `_configure_basic_optimizer`
    puts it in `engine.basic_optimizer`): optimizers.check_engine asks the built engine for it."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    return MuonWithAuxAdam


# -- Ulysses sequence parallelism -------------------------------------------------------------------

def sequence_parallel_mpu(size: int):
    """DeepSpeed's sequence-parallel unit for `size` ranks a row, its groups created once per process
    (a later engine of another size releases them first): the module
    deepspeed/runtime/sequence_parallel/parallel_state_sp.py (0.19.8), handed as `mpu` to zero.Init and
    deepspeed.initialize. Its groups: ranks [i*size, (i+1)*size) share rows (sequence-parallel rank =
    rank % size, data-parallel rank = rank // size); the sequence-data-parallel group is every rank.
    DeepSpeed recognises it by its `initialize_sequence_parallel` attribute (utils/groups.py): the engine
    then reduces gradients and partitions ZeRO state over the sequence-data-parallel group, divides the
    reduced gradients by world/size (stage_1_and_2.py and stage3.py: `/ float(self.sequence_parallel_size)`),
    and config.py takes the batch's world size as world/size.
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if getattr(mpu, "_SEQUENCE_PARALLEL_GROUP", None) is not None:
        if mpu.get_sequence_parallel_world_size() == size:
            return mpu
        mpu._release_sequence_parallel_groups()
    mpu.initialize_sequence_parallel(size)
    return mpu


def sequence_all_to_all(group):
    """tensor -> tensor: DeepSpeed's differentiable all-to-all over dimension 0 within `group` (dim 0's
    length must be the group's size; its backward is the same exchange).

    Matches deepspeed/sequence/layer.py (0.19.8): `_dim_zero_all_to_all(group, input)`, the exchange
    UlyssesSPAttentionHF uses (a registered custom op, so torch.compile keeps its backward), which resolves
    the group by name from a registry that `register_all_to_all_group` fills, outside any compiled region.
    """
    from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

    register_all_to_all_group(group)
    return functools.partial(_dim_zero_all_to_all, group)


def tiled_mlp(mlp, x, tiles: int):
    """--tiled-mlp: `mlp.compute(x)` over `tiles` stretches of x's positions with DeepSpeed's TiledMLP
    (modeling/model.py MLP calls it with sizes.mlp_tiles).

    Matches deepspeed/runtime/sequence_parallel/ulysses_sp.py (0.19.8) `TiledMLP.apply(fn, self, x, shards,
    compute_params)`: forward runs `fn(self, tile)` on `torch.chunk(x, shards, dim=-2)` under no_grad and keeps
    only x; backward recomputes each tile with grad and back-propagates it, with `ds_grad_is_ready` False on
    every compute_param until the last tile, so that ZeRO's gradient hooks (stage_1_and_2.py and stage3.py
    `reduce_independent_p_g_buckets_and_remove_grads`) reduce each weight's gradient once, summed over the
    tiles. At ZeRO-3 the weights are gathered by their own modules' forward hooks, in both passes (the
    sub-modules are called, not their weights read). Measured on a CPU: the output and the input's gradient are
    bit-identical to the untiled MLP's, the weights' gradients equal to rounding (summed tile by tile;
    tests/test_tiled_mlp.py).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    return TiledMLP.apply(_mlp_compute, mlp, x, tiles, list(mlp.parameters()))


def _mlp_compute(mlp, x):
    return mlp.compute(x)


def sequence_parallel_gradient_factor(engine, size: int) -> float:
    """What each rank's loss share's gradient must be multiplied by so that the gradient the optimizer
    gets is the mean, over the data-parallel groups, of each row group's gradient (the sum over its `size`
    ranks), for the engine DeepSpeed built.

    DeepSpeed 0.19.8 sums the gradients over every rank (the sequence-data-parallel group) and divides by:
    world/size in ZeRO-0 (engine.py _reduce_non_expert_gradients), ZeRO-1/2 (stage_1_and_2.py, both
    allreduce_bucket and the reduce-scatter path: `/ float(self.sequence_parallel_size)`) and ZeRO-3's
    contiguous all-reduce path (stage3.py __avg_scatter_contiguous_grads); but by the whole world in
    ZeRO-3's reduce-scatter path (stage3.py __avg_scatter_grads -> coalesced_collectives.py
    reduce_scatter_coalesced, `div_(world_sz)`, no sequence-parallel correction). ZeRO-3 takes the latter
    for every bucket when zero_optimization.reduce_scatter is on (its default), the former only for buckets
    within reduce_bucket_size when it is off: a mix no single factor corrects, so it is refused, as is
    ZeRO-3's quantized-gradient all-to-all (not read). Measured on 2 CPU ranks: without the factor ZeRO-3's
    gradients came out exactly 1/2 at size 2 (tests/test_sequence_parallel.py).
    """
    if engine.zero_optimization_stage() != 3:
        return 1.0
    if getattr(engine.optimizer, "all2all_process_group", None) is not None:
        raise ValueError("sequence parallelism with ZeRO-3's quantized gradients (zero_quantized_gradients) is not"
                         " supported: DeepSpeed's averaging on that path was not verified")
    if not getattr(engine.optimizer, "reduce_scatter", True):
        raise ValueError("sequence parallelism at ZeRO-3 needs zero_optimization.reduce_scatter on (its default):"
                         " with it off DeepSpeed 0.19.8 averages some buckets over world/N ranks, others over all")
    return float(size)
