"""`zerotrain plan`: memory, time and money of a run before it starts (the memory model is
zerotrain.launcher.planning; this is its command line)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from zerotrain.cli_args import Parser
from zerotrain.dataio.format.errors import DataNotHere
from zerotrain.dataio.sources.tokenizer import load_tokenizer
from zerotrain.launcher import model_spec
from zerotrain.launcher.node import Node
from zerotrain.launcher.planning import STAGES, GiB, describe_cost, eval_cost, every_steps, make_plan, render, setup_from
from zerotrain.launcher.config import SETTINGS, RunConfig, add_train_flags, load_recipe, over_recipe
from zerotrain.launcher.config_resolve import validate
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.hparams import check_repeats, length_from_tokens, resolve_hparams
from zerotrain.launcher.profiles import detect_profile, load_profile
from zerotrain.launcher.resolution import resolve
from zerotrain.launcher.settings import parse_every
from zerotrain.launcher.settings import resolve as resolve_settings


# `--gpus N --gpu-mem G` without --profile: DeepSpeed's defaults (ZeRO-0, i.e. plain data parallelism), bf16.
GENERIC_GPU_PROFILE = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
                       "zerotrain": {"hardware": {"accelerator": "cuda"}, "expected_mfu": 0.4}}


def plan_main(argv: list[str]) -> dict:
    """`zerotrain plan`: the driver's flags plus hardware and budget; prints the table (or --json)."""
    p = Parser(prog="zerotrain plan", description="Memory per GPU, time and money of a run, before it starts.",
               usage="%(prog)s [-h] [plan flags below] [training flags: those of zerotrain train]",
               epilog="Every --dashed-flag is also accepted as --underscored_flag.")
    p.add_argument("--gpus", type=int, help="GPUs (ranks on a CPU node) per node; default: the profile's")
    p.add_argument("--gpu-mem", type=float, help="GiB per GPU as torch reports it (CPU: per rank); default: the"
                                                 " profile's, or available RAM / ranks on a CPU node")
    p.add_argument("--nodes", type=int, help="nodes; default: the profile's")
    p.add_argument("--zero", type=int, help="ZeRO stage the verdict is for (default: the profile's)")
    p.add_argument("--mfu", type=float, help="assumed MFU (default: the profile's expected_mfu)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU (default: the profile's)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size (default: the --tokenizer's)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_train_flags(p.add_argument_group("training flags (as for zerotrain train)"))
    ns = p.parse_args(argv)
    check_plan_flags(ns)
    flags = {name: getattr(ns, name) for name in SETTINGS if getattr(ns, name) is not None}
    values = {**(over_recipe(load_recipe(ns.config), flags) if ns.config else {}), **flags}
    cfg = RunConfig.from_flat({**values, "data": values.get("data") or "(not needed to plan)"},
                              sources={k: "flag" if k in flags else "recipe" for k in values})
    validate(cfg)  # the driver's own checks and messages

    auto = None  # --profile auto: the profile this machine detects (or builds: profiles.detect_profile)
    if values.get("profile") is None and ns.gpus is not None:
        name, profile = "generic GPU", json.loads(json.dumps(GENERIC_GPU_PROFILE))
    else:
        spec, auto = detect_profile() if cfg.parallel.profile == "auto" else (cfg.parallel.profile, None)
        name, profile = load_profile(spec)
    if ns.zero is not None:
        profile.setdefault("zero_optimization", {})["stage"] = ns.zero
    cfg = resolve_hparams(cfg, name, profile)  # lr and the schedule, as the run resolves them (launcher/hparams.py)
    settings = resolve_settings(cfg, name, profile)  # the profile's knobs under the flags given (settings.py)
    data_here = bool(values.get("data")) and Path(values["data"]).exists()  # else unknown: data_checks
    tokenizer = load_tokenizer(cfg.data.tokenizer) if ns.vocab_size is None or data_here else None
    if ns.vocab_size is not None:
        vocab, vocab_from = ns.vocab_size, "--vocab-size"
    else:  # the tokenizer the run would train with: its vocabulary sizes the embedding and the head
        vocab, vocab_from = tokenizer.vocab_size, f"tokenizer {tokenizer.name}"
    args, _, _ = model_spec.resolve(cfg, vocab)
    hw = settings.hardware
    nodes = ns.nodes or hw.get("nodes", 1)
    per_node = ns.gpus or hw.get("devices_per_node", 1)
    # the batch, the schedule sized in tokens, every setting and the DeepSpeed dict, as the run resolves them
    # (launcher/resolution.py) on the profile's machine; one device runs ZeRO as the run does
    # (profiles.one_device_stage); --zero is planned as given
    r = resolve(cfg, name, profile, per_node * nodes, Node.of_profile(hw), args, settings=settings,
                one_device=ns.zero is None, one_rank=f"profile {name} plans 1 (give --gpus N, or a GPU --profile)")
    cfg, settings, stage_line = r.cfg, r.settings, r.stage_line
    setup = setup_from(r.ds_config, settings.values, r.world, nodes, ns.gpu_mem * GiB if ns.gpu_mem else None,
                       cfg.schedule.optimizer, args, attention=settings.attention)
    micro, accum = r.micro_batch, r.grad_accum
    ac = bool(settings.activation_checkpointing)
    peak = ns.peak_tflops * 1e12 if ns.peak_tflops else settings.peak_flops_per_device
    mfu = ns.mfu or settings.expected_mfu
    plan = make_plan(args, setup, r.planner_row, micro, accum, cfg.data.seq_len, ac,
                     peak, mfu, cfg.schedule.total_tokens, cfg.budget.max_hours, cfg.budget.budget_usd,
                     cfg.budget.gpu_hour_usd, cfg.schedule.max_steps,
                     length_from_tokens(cfg))
    plan["profile"], plan["vocab_from"] = name, vocab_from
    if stage_line:
        plan["zero_note"] = stage_line
    cost = plan_eval_tasks(cfg, settings, plan["tokens_per_step"], plan["steps"])
    if cost is not None:
        plan["eval_tasks"] = cost.as_dict()
    plan["warnings"], plan["data_unknown"] = data_checks(cfg, tokenizer, plan["tokens"], settings, data_here,
                                                         values.get("data"))
    unknown = f"\nepochs and repetition: unknown without the data ({plan['data_unknown']})" \
        if plan["data_unknown"] else ""
    if auto:
        plan["profile_auto"] = auto
    print(json.dumps(plan, indent=2) if ns.json else (f"profile auto: {auto}\n" if auto else "")
          + f"profile {name}; vocabulary {vocab:,} ({vocab_from})\n"
          + render(plan) + (f"\nzero: {stage_line}" if stage_line else "") + unknown
          + (f"\n{describe_cost(cost)}" if cost is not None else "")
          + "".join(f"\nwarning: {w}" for w in plan["warnings"]))
    return plan


def plan_eval_tasks(cfg, settings, tokens_per_step: int, steps: int):
    """--eval-tasks: the scorings over the planned steps (planning/evaluation.py). The tasks are not loaded here
    (lm_eval and their data need not be on the planning machine), so their time is the first scoring's."""
    if not settings.eval_tasks:
        return None
    every = settings.eval_tasks_every
    every = every_steps(parse_every(every), tokens_per_step) if every is not None else cfg.eval.eval_every_steps
    return eval_cost(0, steps, every)


def check_plan_flags(ns) -> None:
    """The plan's own flags, each refused in one line (UsageError)."""
    for name in ("gpus", "nodes", "vocab_size"):
        v = getattr(ns, name)
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer, got {v}")
    for name in ("gpu_mem", "peak_tflops"):
        v = getattr(ns, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive number, got {v}")
    if ns.mfu is not None and not 0 < ns.mfu <= 1:
        raise UsageError(f"--mfu: must be a fraction in (0, 1], got {ns.mfu}")
    if ns.zero is not None and ns.zero not in STAGES:
        raise UsageError(f"--zero: must be 0, 1, 2 or 3, got {ns.zero}")


def data_checks(cfg, tokenizer, tokens: int, settings, data_here: bool, data: str | None) -> tuple[list, str | None]:
    """(the repetition warnings, why the data is unknown or None). The data may not exist yet when a run is planned
    (not written, or a hub dataset not downloaded, offline): then what needs it is unknown and the rest is planned."""
    if not data_here:
        return [], f"--data {data}: not here" if data else "no --data given"
    try:
        return list(repeats(cfg, tokenizer, tokens, settings)), None
    except DataNotHere as e:  # a file not written yet, a hub dataset not cached offline: plan the rest
        return [], str(e)


def repeats(cfg, tokenizer, tokens: int, settings) -> tuple[str, ...]:
    """With --data: the warning for sources the plan's tokens read more than 4 times (hparams.check_repeats;
    UsageError past the resolved max_epochs). The sources are read as the run reads them (hub sources not fetched)."""
    from zerotrain.dataio.pipeline.loader import load_data, open_data  # imports torch: only when a plan names its data

    data = load_data(open_data(cfg.data.path, tokenizer, fetch=False), seq_len=cfg.data.seq_len, verify="quick")
    return check_repeats(data, tokens, settings.max_epochs, settings.sources["max_epochs"])
