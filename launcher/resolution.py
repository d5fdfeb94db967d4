"""From flags to a plan, once: `resolve` turns a config (its schedule resolved by launcher/hparams.py), a profile,
a world size and a machine into the batch, the schedule sized in tokens, every setting with its source and the exact
DeepSpeed dict. Torch-free, nothing read or written.

    resolve(cfg, profile_name, profile, world, node, model_args) -> Resolved

The run (launcher/run_plan.py `plan`), `zerotrain plan` (launcher/commands/plan.py) and `--dry-run` (through the
run's plan) all call it, and only it, so the three cannot disagree on a micro-batch, an accumulation, a step count,
a warmup, a ZeRO stage, an offload, a sequence-parallel size or an attention kernel (tests/test_resolution.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.hparams import size_in_tokens
from zerotrain.launcher.node import Node
from zerotrain.launcher.planning import size_auto_micro_batch, stage_key
from zerotrain.launcher.profiles import one_device_stage, resolve_ds_config
from zerotrain.launcher.profiles import precision as profile_precision  # attention_kernel has a local `precision`
from zerotrain.launcher.sequence.checks import check_sequence_parallel_plan
from zerotrain.launcher.settings import GIVEN, Settings, compile_at_stage
from zerotrain.launcher.settings import resolve as resolve_settings
from zerotrain.modeling.attention import KERNELS
from zerotrain.modeling.sizes import ModelArgs, choose_attention, math_kernel


def tokens_per_step(ds_config: dict, seq_len: int) -> int:
    """Tokens one optimizer step trains: the global batch's rows (DeepSpeed's train_batch_size) x the row length."""
    return ds_config["train_batch_size"] * seq_len


@dataclass(frozen=True)
class Resolved:
    """One run resolved for a world and a machine."""
    cfg: RunConfig  # the schedule sized in tokens at this world (max_steps, warmup_steps exact)
    profile: dict  # the profile resolved against (a --profile auto one with its micro-batch sized)
    settings: Settings  # every setting with its source; attention the kernel for the machine, compile at the stage
    ds_config: dict  # the exact dict for deepspeed.initialize: batch, offload, optimizer, ZeRO stage
    world: int
    stage_line: str = ""  # the ZeRO stage, where it is not the profile's (profiles.one_device_stage)

    @property
    def sequence_parallel(self) -> int:
        return self.settings.sequence_parallel

    @property
    def data_world(self) -> int:
        """Row groups: N ranks share each row under sequence parallelism."""
        return self.world // self.sequence_parallel

    @property
    def micro_batch(self) -> int:
        return self.ds_config["train_micro_batch_size_per_gpu"]

    @property
    def grad_accum(self) -> int:
        return self.ds_config["gradient_accumulation_steps"]

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.ds_config, self.cfg.data.seq_len)

    @property
    def zero_stage(self) -> int:
        return (self.ds_config.get("zero_optimization") or {}).get("stage", 0)

    @property
    def planner_row(self):
        """The planner's row for the dict: its ZeRO stage, or the offload variant it runs (planning.stage_key)."""
        return stage_key(self.ds_config)


def resolve(cfg: RunConfig, profile_name: str, profile: dict, world: int, node: Node, model_args,
            settings: Settings | None = None, started_stage: int | None = None, one_device: bool = True,
            one_rank: str = "this launch has 1") -> Resolved:
    """The run resolved (see the module docstring); UsageError, one line, for what cannot run. `settings`: the
    run's identity's (run_plan.identify resolved them once), else resolved here; `started_stage`: the ZeRO stage
    the run's first launch chose (kept on resume); `one_device`: False keeps the profile's stage on one device
    (`zerotrain plan --zero S`); `one_rank`: the end of the sequence-parallel refusal for a world of 1."""
    if settings is None:
        settings = resolve_settings(cfg, profile_name, profile)
    check_sequence_parallel_plan(cfg, settings, model_args, world, one_rank)
    # a profile --profile auto built: the micro-batch that fits its GPU (the planner's)
    profile = size_auto_micro_batch(profile, cfg, model_args, settings.values, world)
    ds_config = resolve_ds_config(profile, cfg, world // settings.sequence_parallel, f"profile {profile_name}")
    # the run's length and warmup when given in tokens, at this world's tokens per step (not part of the run id)
    cfg = size_in_tokens(cfg, tokens_per_step(ds_config, cfg.data.seq_len))
    settings = attention_kernel(cfg, settings, ds_config, node, model_args)
    stage_line = ""
    if one_device:
        ds_config, stage_line = one_device_stage(ds_config, world, node.device, started_stage)
    settings = compile_at_stage(settings, ds_config)
    return Resolved(cfg, profile, settings, ds_config, world, stage_line)


def attention_kernel(cfg: RunConfig, settings: Settings, ds_config: dict, node: Node, model_args: ModelArgs) -> Settings:
    """The settings with `attention` the kernel this run's model uses: --attention, else the profile's
    zerotrain.attention, else auto, resolved for the accelerator and precision (modeling/sizes.py
    `choose_attention`). One that cannot run here is refused (UsageError) before anything is written.

    A dry run names what the profile's hardware would run (a CUDA machine for a GPU profile, with a
    torch that has the varlen kernel); a real run asks this node (launcher/node.py). --deterministic keeps
    varlen: torch runs its flash backward deterministically once deterministic algorithms are on (not
    warn-only, components/determinism.py), and sdpa with packed documents and GQA would be torch's math kernel.
    """
    name, source = settings.attention, settings.sources["attention"]
    words = "--attention" if source in GIVEN or source == "default" else source
    precision = profile_precision(ds_config)
    device, installed = node.device, node.varlen
    try:
        kernel = choose_attention(name, device, precision, installed, model_args.n_kv_heads < model_args.n_heads)
    except ValueError as e:
        raise UsageError(f"{words} {name}: {e}") from None
    entry = KERNELS[kernel]  # modeling/attention.py: what the kernel supports
    if entry.compile_on_cpu_refusal and device == "cpu" and settings.compile:
        raise UsageError(f"{words} {kernel} with --compile: {entry.compile_on_cpu_refusal}")
    if not entry.sequence_parallel and settings.sequence_parallel > 1:
        raise UsageError(f"{words} {kernel}: this kernel does not run under --sequence-parallel")
    if name != "auto":
        return settings.replace("attention", kernel, source)
    why = f"rule: auto on {device}, {precision}"
    if math_kernel(kernel, device, model_args.n_kv_heads < model_args.n_heads):  # fp32, or a torch without varlen
        why += ("; with packed documents and GQA PyTorch runs its math kernel here: (B, H, T, T) fp32 scores per"
                " layer, counted by the fit check (flex, or varlen in bf16, keeps none)")
    return settings.replace("attention", kernel, why)
