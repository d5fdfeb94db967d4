"""The one way a DeepSpeed engine is built: the process group joined (or reused), the model (under
`deepspeed.zero.Init` at ZeRO-3, so that no rank ever holds it whole), its initial weights, the optimizer
(the registry's, launcher/optimizers.py, or DeepSpeed's own from ds_config), the LR schedule,
`deepspeed.initialize`, and the registry's check of what DeepSpeed really built.

    build_engine(spec_from_plan(plan))    the run (Trainer; pre-flight builds Trainers)
    build_engine(EngineSpec(...))         test harnesses and benchmarks, from explicit arguments

Nothing else in the repository calls `deepspeed.initialize`, `deepspeed.zero.Init` or
`deepspeed.init_distributed` (the last only in process_group.py; tests/test_engine.py walks every file),
so an engine a test measures is built the way the run builds it for the same inputs.

What is not here: the start-up lines about the engine (the Trainer says them), the data, resume.
Settings the spec carries through untouched are DeepSpeed's own: optimizer and parameter offload
(`zero_optimization.offload_optimizer` / `offload_param` in ds_config), a model-parallel unit (`mpu`)
handed to both `zero.Init` and `deepspeed.initialize`. `sequence_parallel` N > 1 (Ulysses) makes that unit
DeepSpeed's sequence-parallel one and gives the model its shard (launcher/sequence/groups.py sequence_shard:
modeling/model.py SequenceShard, with DeepSpeed's all-to-all); ds_config's batch is then counted over
world/N ranks. `tiled_mlp` gives every MLP DeepSpeed's TiledMLP (ds_compat.tiled_mlp).
deepspeed is imported inside the functions (heavy, and its import logs a line).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from zerotrain.launcher.components import determinism, ds_compat
from zerotrain.launcher.components.process_group import init_process_group
from zerotrain.launcher.components.schedule import make_scheduler
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.optimizers import check_engine, prepare_optimizer
from zerotrain.launcher.sequence.groups import sequence_shard, with_gradient_factor
from zerotrain.launcher.settings import COMM_TIMEOUT_S
from zerotrain.modeling.hf import hf_name, load_weights
from zerotrain.modeling.initial import first_nonfinite, weights_loaded_after
from zerotrain.modeling.model import ModelArgs, SequenceShard, Transformer, held_numel


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from. `run` given (the run's RunConfig): the optimizer is the
    registry's (`prepare_optimizer`, then `check_engine` on the built engine) and the LR schedule is the
    run's (`make_scheduler`); `optimizer` and `lr_scheduler` are then left None. Without `run`: DeepSpeed's
    optimizer from ds_config's "optimizer" section, or the client optimizer `optimizer(parameters)` builds,
    and `lr_scheduler` as deepspeed.initialize takes it (a callable optimizer -> scheduler) or None."""
    ds_config: dict  # as handed to deepspeed.initialize: batch numbers resolved; its zero_optimization's stage
    model_args: ModelArgs
    seed: int  # torch.manual_seed before the model is built: its initial weights
    deterministic: bool = False  # --deterministic: components/determinism.apply before anything is built
    run: Any = None  # launcher/config.RunConfig
    optimizer: Callable | None = None  # parameters -> torch.optim.Optimizer
    lr_scheduler: Callable | None = None
    init_from: str | Path | None = None  # a checked HF directory whose weights are loaded before initialize
    resumes: bool = False  # a checkpoint's load writes every parameter next: no initial weights drawn
    attention: str | None = None  # the attention kernel (None: the model's default)
    activation_checkpointing: bool | None = None  # None: the model's default (off)
    loss_chunk_tokens: int | None = None  # the chunked loss's tokens per chunk (None: the model's, sized for a CPU)
    compile: bool = False  # torch.compile every block in place (compile_blocks; parameter names do not change)
    compile_backend: str | None = None  # None: the accelerator's
    dist_backend: str | None = None  # the process group's, if this joins it (None: the accelerator's)
    comm_timeout_s: float | None = None  # the collectives' timeout, if this joins it (None: process_group's rule)
    mpu: Any = None  # DeepSpeed's model-parallel unit, for zero.Init and deepspeed.initialize
    sequence_parallel: int = 1  # ranks sharing each row (Ulysses); > 1 sets mpu to DeepSpeed's sequence-parallel unit
    tiled_mlp: bool = False  # every MLP over tiles of positions (DeepSpeed's TiledMLP, ds_compat.tiled_mlp)
    exchange_phase: Callable | None = None  # () -> a context manager around each all-to-all, forward and
    # backward: the trainer's PhaseClock phase "all_to_all" (not with compile: the exchange stays DeepSpeed's op)

    @property
    def zero_stage(self) -> int:
        return self.ds_config.get("zero_optimization", {}).get("stage", 0)


@dataclass
class Built:
    engine: Any  # the DeepSpeedEngine
    ds_config: dict  # the dict deepspeed.initialize got
    held: int  # parameter elements this rank held after construction (its ZeRO-3 partition, else all)

    @property
    def model(self):
        return self.engine.module


def spec_from_plan(plan, exchange_phase: Callable | None = None) -> EngineSpec:
    """The run's engine: `plan` is a RunPlan (launcher/run_plan.py, the layer above: read, not imported).
    The pretrained weights are loaded only on a fresh start (a resume loads its checkpoint instead).
    `exchange_phase`: EngineSpec's (the trainer's clock)."""
    cfg, s = plan.cfg, plan.settings  # the resolved settings (launcher/settings.py)
    return EngineSpec(ds_config=plan.ds_config, model_args=plan.model_args, seed=cfg.run.seed,
                      deterministic=bool(plan.deterministic), run=cfg,
                      init_from=plan.init_from if plan.resume_from is None else None,
                      resumes=plan.resume_from is not None, attention=plan.attention,
                      activation_checkpointing=bool(s.activation_checkpointing), compile=bool(s.compile),
                      loss_chunk_tokens=plan.loss_chunk_tokens, sequence_parallel=plan.sequence_parallel,
                      tiled_mlp=bool(s.tiled_mlp), exchange_phase=exchange_phase,
                      compile_backend=s.compile_backend, dist_backend=s.dist_backend, comm_timeout_s=s.comm_timeout_s)


def sequence_parallel(spec: EngineSpec) -> tuple[Any, SequenceShard | None]:
    """(the mpu the engine is built with, the model's SequenceShard or None); the process group must exist."""
    if spec.sequence_parallel <= 1:
        return spec.mpu, None
    if spec.mpu is not None:
        raise ValueError("EngineSpec: sequence_parallel > 1 brings its own mpu; give one or the other")
    return sequence_shard(spec.sequence_parallel, spec.model_args,
                          spec.exchange_phase if not spec.compile else None)


def check_finite(model, init_from: str) -> None:
    """Refuse (UsageError, one line, every rank alike) pretrained weights holding NaN or infinity: a corrupt or
    badly converted checkpoint, otherwise found only as a non-finite loss at step 1 (exit 3, as if diverged). Each
    rank checks what it holds (a ZeRO-3 partition), and one tiny all-gather names the first found."""
    found = first_nonfinite(model)
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, found)
        found = next((name for name in every if name is not None), None)
    if found is not None:
        raise UsageError(f"--init-from {init_from}: tensor {hf_name(found)} holds NaN or infinite values (a corrupt"
                         " or badly converted checkpoint)")


def build_model(spec: EngineSpec, mpu=None, shard: SequenceShard | None = None):
    """The model, seeded, under zero.Init at ZeRO-3, with its pretrained weights if any (the process
    group must exist: build_engine joins it); `mpu` and `shard` from `sequence_parallel(spec)`."""
    import deepspeed

    torch.manual_seed(spec.seed)
    # a resume's load, or --init-from's, writes every parameter next: no initial weights drawn
    # (modeling.initial.weights_loaded_after; load_weights sets every value of every parameter)
    drawn = weights_loaded_after() if spec.resumes or spec.init_from is not None else contextlib.nullcontext()
    if spec.zero_stage == 3:
        # The dtype comes from the config's bf16/fp16 sections: do not pass dtype= here, DeepSpeed 0.19 turns
        # an explicit float32 into bfloat16 on CPU (an operator-precedence slip in Init._set_dtype), which made
        # fp32 runs 8x slower.
        with deepspeed.zero.Init(config_dict_or_path=spec.ds_config, mpu=mpu if mpu is not None else spec.mpu), drawn:
            model = Transformer(spec.model_args)
    else:
        with drawn:
            model = Transformer(spec.model_args)
    if spec.init_from is not None:  # before deepspeed.initialize copies them
        load_weights(model, spec.init_from)
        check_finite(model, spec.init_from)
    if spec.activation_checkpointing is not None:
        model.activation_checkpointing = bool(spec.activation_checkpointing)
    if spec.attention is not None:
        model.attention = spec.attention
    if spec.loss_chunk_tokens is not None:
        model.lm_head.chunk_tokens = spec.loss_chunk_tokens
    model.sequence_parallel = shard
    for layer in model.layers:
        layer.mlp.tiled = ds_compat.tiled_mlp if spec.tiled_mlp else None
    return model


def build_engine(spec: EngineSpec) -> Built:
    """Join (or reuse) the process group, build the model, its optimizer and schedule, and the engine."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ds_compat.cache_cpu_info()  # DeepSpeed's CPU ops and CPU Adam ask py-cpuinfo again and again: asked once
    ds_compat.import_muon_compiling_on_first_use()  # every ZeRO build imports it: its kernels wrapped when used
    init_process_group(spec.dist_backend, spec.comm_timeout_s or COMM_TIMEOUT_S)
    determinism.apply(torch, spec.deterministic)  # before cuBLAS starts
    mpu, shard = sequence_parallel(spec)
    model = build_model(spec, mpu, shard)
    held = held_numel(model)
    ds_config, optimizer, scheduler = spec.ds_config, None, spec.lr_scheduler
    if spec.run is not None:
        ds_config, optimizer, _ = prepare_optimizer(spec.run, ds_config, model)
        scheduler = make_scheduler(spec.run)
    elif spec.optimizer is not None:
        optimizer = spec.optimizer(model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                           config=ds_config, lr_scheduler=scheduler, mpu=mpu)
    if shard is not None:  # known only now: which reduction DeepSpeed built
        model.sequence_parallel = with_gradient_factor(shard, engine)
    if spec.run is not None:
        check_engine(spec.run, engine, model, ds_compat.muon_optimizer_class)
    if spec.compile:
        compile_blocks(model, spec.compile_backend or get_accelerator().get_compile_backend())
    return Built(engine, ds_config, held)


def compile_blocks(model, backend: str) -> None:
    """Regional compilation (torchtitan's per-block form): each transformer block compiled in place, so its
    norms, RoPE, SwiGLU and residual adds fuse; every block has the same code and shapes, so dynamo compiles one
    graph and reuses it for the others (a whole-model compile traces every layer). Parameter names do not
    change (nn.Module.compile keeps the module), so checkpoints and exports are the eager run's. The embedding,
    the final norm and the chunked loss stay eager (the loss is its own autograd function, sized by chunks).
    The document layout arrives computed on the host (Transformer.document_layout) with a fixed max_seqlen, so
    the blocks meet no host sync and no new constant from one step to the next."""
    for layer in model.layers:
        layer.compile(backend=backend)
