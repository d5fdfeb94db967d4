"""ZeRO's and the engine's internals outside a feature: a notebook's finished ZeRO-3 run freed, the fp32 master
partitions pre-flight compares, DeepSpeed's Muon class (its module imported without compiling ahead), and the
zero.Init attributes zerotrain/ds_attributes.py reads (ELSEWHERE in ds_compat/__init__.py)."""
from __future__ import annotations

import functools
import sys

from zerotrain.launcher.components.ds_compat.names import PrivateName

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"

# the DeepSpeed names this part relies on (ds_compat.PRIVATE_NAMES gathers them; check_deepspeed_version)
NAMES = (
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
    # read in zerotrain/ds_attributes.py (ELSEWHERE below), for modeling/ and the config layer
    *(PrivateName("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param", needed_for, True,
                  source_has=text) for text, needed_for in (
        ("param.ds_id = Init.param_id", "a ZeRO-3 model loads its initial weights (modeling gathered, hf load)"),
        ("param.ds_shape = param.shape", "--optimizer muon at ZeRO-3: each matrix is checked by its real shape"),
        ("param.ds_tensor = None", "zerotrain preflight and the parameter count read each rank's ZeRO-3 partition"))),
    *(PrivateName(module, name, "a rank's start-up does not compile-wrap DeepSpeed's Muon kernels ahead of use",
                  False, source_has=text) for module, name, text in (
        ("deepspeed.runtime.compiler", "compile", "return torch.compile"),
        ("deepspeed.runtime.zero.muon.original_muon", "muon_update", "@compiler.compile()"))),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._configure_optimizer",
                "--optimizer muon: the built engine is checked to step with DeepSpeed's Muon", True,
                source_has="self.basic_optimizer = basic_optimizer"),
)


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


def import_muon_compiling_on_first_use() -> None:
    """Import DeepSpeed's Muon module with its `@torch.compile` decorators deferred to each function's first call.

    Why: DeepSpeed (0.19.8) imports deepspeed.runtime.zero.muon.muon_optimizer inside every ZeRO engine build, Muon
    or not (zero/utils.py `is_zero_supported_optimizer`, the stage 3 optimizer's __init__, stage 1/2's
    partitioning), to test `isinstance(optimizer, MuonWithAuxAdam)`; original_muon.py decorates three kernels with
    `@compiler.compile()`, which is `torch.compile`, and wrapping them there builds dynamo's and inductor's
    compile wrappers: ~1 CPU-s of every rank's start-up (`import torch, deepspeed, torch._dynamo` then the Muon
    module: 4.3 CPU-s eagerly, 3.2-3.7 deferred, against 3.0 without it; 2-vCPU host, 2026-11-28), paid again at
    each restart. torch.compile itself compiles nothing until the first call, so deferring the wrapping to the
    first call runs the same compiled code: a Muon run compiles at its first step as before. Done once a process,
    before the engine is built; torch.compile is replaced only for the length of that one import."""
    if MUON_MODULE in sys.modules:
        return
    import torch

    compile_now = torch.compile

    def compile_on_first_use(model=None, **options):
        if model is None:  # used as @torch.compile(mode=...)
            return functools.partial(compile_on_first_use, **options)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = compile_on_first_use
    try:
        __import__(MUON_MODULE)
    except ImportError:
        pass  # DeepSpeed without Muon: its own imports of the module fail the same way and are handled there
    finally:
        torch.compile = compile_now


def muon_optimizer_class():
    """DeepSpeed's Muon optimizer class, which the engine builds for `"optimizer": {"type": "Muon"}`
    (deepspeed/runtime/zero/muon/muon_optimizer.py MuonWithAuxAdam; engine.py `_configure_basic_optimizer`
    puts it in `engine.basic_optimizer`): optimizers.check_engine asks the built engine for it."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    return MuonWithAuxAdam
