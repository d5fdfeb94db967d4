"""The run's schedule hyper-parameters where the command line and the recipe leave them open, and where each
came from.

    resolve_hparams(cfg, profile_name=None, profile=None) -> RunConfig
        lr, min_lr, warmup_steps, max_steps, schedule, decay_fraction made concrete against the profile (loaded
        from cfg.parallel.profile when not given) and the model; cfg.sources names where each came from.
        Idempotent: a resolved config comes back as it is.
    describe_hparams(cfg) -> str        the start-up (and --dry-run) line: each value and its source
    size_in_tokens(cfg, tokens_per_step, resumed, started) -> RunConfig
        max_steps and warmup_steps from --total-tokens / --warmup-tokens / the warmup rule, once the tokens per
        step are known (run_plan.plan_run); describe_length(...) the `run length:` line saying what ends the run
    check_repeats(data, run_tokens, max_epochs, source)   the warning for sources read more than 4 times;
        the resolved max_epochs (launcher/settings.py) refuses

The first that says wins:
    lr              --lr | recipe | the --scaling-rule's lr law for the run's optimizer (modeling/scaling_rules.yaml)
                    | the profile's optimizer.params.lr, when the run uses the profile's optimizer section (the
                      default adamw) | the optimizer's own default (muon 0.02, lion 3e-4; launcher/optimizers.py)
                    | the per-size rule (modeling/sizes.py DEFAULT_LR_LAWS: GPT-3's learning rates by size)
    min_lr          --min-lr | recipe | the profile's scheduler cos_min_ratio x lr | lr / 10, except with an
                    explicit lr of at least 3e-4: 3e-4 (the fixed default before 0.2; kept so those run ids stay)
    warmup_steps    --warmup-steps | recipe | --warmup-tokens / tokens per step (rounded up) | the profile's
                    scheduler warmup_num_steps | the warmup rule: max(20, 1% of max_steps, rounded up)
    max_steps       --max-steps | recipe | --total-tokens / tokens per step (rounded up) | the profile's
                    scheduler total_num_steps | 100
    schedule        --schedule | recipe | cosine (kept as None in the config, so the run id is the one before wsd)
    decay_fraction  --decay-fraction | recipe | 0.2, with wsd only

The warmup rule is Pythia's (EleutherAI/pythia models/*/pythia-*.yml: "warmup": 0.01, which GPT-NeoX reads as
a fraction of the 143,000 training iterations: 1,430 warmup steps), floored at 20 steps, the fixed default it
replaced: every run of up to 2,000 steps warms up exactly as before. The 1.46B plan's own choice (100M warmup
tokens of 11B) is 0.9%. Tokens per step are known only once the batch is resolved against the world size
(run_plan.plan_run); `resolve_hparams` leaves the values that depend on them provisional (their source says
the rule) and `size_in_tokens` makes them exact. On resume they are sized from the checkpoint: max_steps =
its step + what is left of --total-tokens at this run's tokens per step (the world, and with it the tokens per
step, may have changed), and a warmup taken from a rule stays what the run started with.

A scaling rule's law comes before the profile: it was fitted for that model family and chosen with it; a
profile's lr is one value for whatever model runs on that hardware. The per-size rule is last: it is a
documented guess where nothing more specific says.

The profile's "scheduler" section (DeepSpeed's, in a profile written from a DeepSpeed config) never reaches
DeepSpeed: the schedule is zerotrain's (launcher/components/schedule.py). A WarmupCosineLR section is read as
above; any other type, or a setting zerotrain's schedule cannot honour, is refused with one line naming it,
never dropped silently.

The run id hashes the resolved values (launcher/config_resolve.py identity): a value a run took from its
profile is part of what it trains with, like one given by flag. Runs that gave their values keep the ids they
had; the CPU profiles' lr is 3e-3, the value every CPU run without --lr has trained with, so theirs stay too.
"""
from __future__ import annotations

import math

from zerotrain.launcher import model_spec, optimizers
from zerotrain.launcher.config import LEAVES, value, with_values
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import load_profile
from zerotrain.modeling.sizes import ModelArgs, count_params, default_lr

DEFAULTS = {"warmup_steps": 20, "max_steps": 100, "decay_fraction": 0.2}
WARMUP_FRACTION = 0.01  # Pythia's warmup: 1% of the training steps (the module docstring)
RULE_MAX_STEPS = "rule: --total-tokens / tokens per step"
RULE_WARMUP_TOKENS = "rule: --warmup-tokens / tokens per step"
RULE_WARMUP = "rule: max(20, 1% of max-steps), Pythia's warmup"
KEPT = " (kept from the run's start)"
LEGACY_MIN_LR = 3e-4  # min_lr's fixed default before 0.2, kept for runs that give --lr >= it
SCHEDULES = ("cosine", "wsd")
SCHEDULER_KEYS = ("warmup_num_steps", "total_num_steps", "cos_min_ratio", "warmup_min_ratio", "warmup_type")
SHOWN = ("lr", "min_lr", "warmup_steps", "max_steps", "schedule", "decay_fraction")


def is_resolved(cfg) -> bool:
    return (cfg.schedule.lr is not None and cfg.schedule.min_lr is not None and cfg.schedule.warmup_steps is not None
            and (cfg.schedule.shape != "wsd" or cfg.schedule.decay_fraction is not None))


def given(cfg, name: str) -> str | None:
    """Where a value the config holds came from ("flag", "recipe", "given" for the Python API), or None when it
    was not given. Without recorded sources (a RunConfig built directly) a value differing from the field's
    default counts as given."""
    if cfg.sources and name in cfg.sources:
        return cfg.sources[name] if cfg.sources[name] in ("flag", "recipe", "given") else None
    v = value(cfg, name)
    return "given" if v is not None and v != LEAVES[name].default else None


def resolve_hparams(cfg, profile_name: str | None = None, profile: dict | None = None):
    """The config with every schedule hyper-parameter concrete (see the module docstring); UsageError for a
    profile scheduler section that cannot be honoured or values that do not fit together."""
    if profile is None:
        if cfg.parallel.profile == "auto":
            raise RuntimeError("resolve_hparams: --profile auto is resolved on the rank, after detection (plan_run)")
        profile_name, profile = load_profile(cfg.parallel.profile)
    where = f"profile {profile_name}"
    sources = dict(cfg.sources or {})
    if is_resolved(cfg) and all(n in sources for n in ("lr", "min_lr", "warmup_steps", "max_steps", "schedule")):
        return cfg  # resolved before (config_from, then plan_run)
    for name in SHOWN:
        source = given(cfg, name)
        if source:
            sources[name] = source
    sched = profile_schedule(profile, where)
    values = {}

    lr, lr_source = _lr(cfg, where, profile)
    values["lr"], sources["lr"] = lr, sources.get("lr") or lr_source
    if cfg.schedule.min_lr is None:
        if "min_ratio" in sched:
            values["min_lr"], sources["min_lr"] = _round(lr * sched["min_ratio"]), f"{where}: scheduler cos_min_ratio x lr"
        elif given(cfg, "lr") and lr >= LEGACY_MIN_LR:
            values["min_lr"], sources["min_lr"] = LEGACY_MIN_LR, "default with an explicit lr"
        else:
            values["min_lr"], sources["min_lr"] = _round(lr / 10), "lr / 10"
    if given(cfg, "max_steps"):
        if sched.get("max_steps", cfg.schedule.max_steps) != cfg.schedule.max_steps:
            sources["max_steps"] += f"; {where}'s scheduler total_num_steps {sched['max_steps']} not used"
    elif cfg.schedule.total_tokens is not None:  # provisional until the tokens per step are known (size_in_tokens)
        sources["max_steps"] = RULE_MAX_STEPS + (f"; {where}'s scheduler total_num_steps {sched['max_steps']} not"
                                                 " used" if "max_steps" in sched else "")
    elif "max_steps" in sched:
        values["max_steps"], sources["max_steps"] = sched["max_steps"], f"{where}: scheduler total_num_steps"
    else:
        sources["max_steps"] = "default"
    if cfg.schedule.warmup_steps is None:
        if cfg.schedule.warmup_tokens is not None:  # provisional until the tokens per step are known (size_in_tokens)
            values["warmup_steps"], sources["warmup_steps"] = \
                warmup_rule(values.get("max_steps", cfg.schedule.max_steps)), RULE_WARMUP_TOKENS
        elif "warmup_steps" in sched:
            values["warmup_steps"], sources["warmup_steps"] = sched["warmup_steps"], f"{where}: scheduler warmup_num_steps"
        else:
            values["warmup_steps"], sources["warmup_steps"] = \
                warmup_rule(values.get("max_steps", cfg.schedule.max_steps)), RULE_WARMUP
    schedule = cfg.schedule.shape or "cosine"
    if schedule == "cosine":
        values["schedule"] = None  # the default, spelled out or not: the same run id
        sources["schedule"] = sources.get("schedule") or "default"
    if schedule == "wsd" and cfg.schedule.decay_fraction is None:
        values["decay_fraction"], sources["decay_fraction"] = DEFAULTS["decay_fraction"], "default"
    out = with_values(cfg, values, sources=sources)
    check_schedule(out)
    return out


def warmup_rule(max_steps: int) -> int:
    """The default warmup: 1% of the run's steps, rounded up (Pythia's), at least 20 (the fixed default before)."""
    return max(DEFAULTS["warmup_steps"], math.ceil(WARMUP_FRACTION * max_steps))


def steps_for(tokens: int, tokens_per_step: int) -> int:
    """Optimizer steps that train `tokens` tokens, the last one whole (rounded up)."""
    return -(-tokens // tokens_per_step)


def size_in_tokens(cfg, tokens_per_step: int, resumed: tuple[int, int] | None = None,
                   started: dict | None = None):
    """The config with max_steps and warmup_steps exact for `tokens_per_step` (optimizer steps over all ranks x
    seq len): each one whose source is a token rule (resolve_hparams left it provisional) is computed here.

    `resumed`: (step, tokens trained) of the checkpoint the run resumes from: --total-tokens then counts from
    there (max_steps = step + the tokens left / tokens per step), so a world that changed the tokens per step
    still ends at the budget. `started`: config.json's "run" of that run: a warmup taken from a rule stays the
    one it started with (the schedule it has been following). Pure; the sources say which rule gave what."""
    sources, values = dict(cfg.sources or {}), {}
    if length_from_tokens(cfg):
        if resumed is not None:
            step, seen = resumed
            values["max_steps"] = step + steps_for(max(0, cfg.schedule.total_tokens - seen), tokens_per_step)
            left = max(0, cfg.schedule.total_tokens - seen)
            sources["max_steps"] = f"{RULE_MAX_STEPS}: step {step:,} + {left:,} tokens left / {tokens_per_step:,}"
        else:
            values["max_steps"] = steps_for(cfg.schedule.total_tokens, tokens_per_step)
    warmup_source = sources.get("warmup_steps", "")
    if warmup_source.startswith((RULE_WARMUP, RULE_WARMUP_TOKENS)):
        if started is not None and isinstance(started.get("warmup_steps"), int):
            values["warmup_steps"] = started["warmup_steps"]
            sources["warmup_steps"] = warmup_source.removesuffix(KEPT) + KEPT
        elif warmup_source.startswith(RULE_WARMUP_TOKENS):
            values["warmup_steps"] = steps_for(cfg.schedule.warmup_tokens, tokens_per_step)
        else:
            values["warmup_steps"] = warmup_rule(values.get("max_steps", cfg.schedule.max_steps))
    return with_values(cfg, values, sources=sources)


def length_from_tokens(cfg) -> bool:
    """Whether --total-tokens sets the run's length (max_steps from the rule), rather than being a budget."""
    return cfg.schedule.total_tokens is not None and (cfg.sources or {}).get("max_steps", "").startswith(RULE_MAX_STEPS)


def token_budget(cfg) -> int | None:
    """--total-tokens as a budget stop (components/guards.py Budget): only when something else sets the run's
    length. When it sets the length itself the run ends at max_steps, its last step whole."""
    return None if length_from_tokens(cfg) else cfg.schedule.total_tokens


def run_end(cfg, tokens_per_step: int, step: int = 0, tokens_seen: int = 0) -> tuple[int, str]:
    """(the step the run ends at, the flag that ends it: "max-steps" or "total-tokens"), from `step` having
    trained `tokens_seen` tokens (a resume)."""
    budget = token_budget(cfg)
    if budget is not None:
        last = step + max(0, budget - tokens_seen) // tokens_per_step
        if last < cfg.schedule.max_steps:
            return last, "total-tokens"
    return cfg.schedule.max_steps, "max-steps"


def run_tokens(cfg, tokens_per_step: int, step: int = 0, tokens_seen: int = 0) -> int:
    """Tokens the whole run trains (earlier launches included) by the step `run_end` names."""
    return tokens_seen + (run_end(cfg, tokens_per_step, step, tokens_seen)[0] - step) * tokens_per_step


def describe_length(cfg, tokens_per_step: int, step: int = 0, tokens_seen: int = 0) -> str:
    """The start-up (and --dry-run) line saying how long the run is, in steps and tokens, and what ends it."""
    src = (cfg.sources or {}).get("max_steps", "given")
    end, ender = run_end(cfg, tokens_per_step, step, tokens_seen)
    tokens = run_tokens(cfg, tokens_per_step, step, tokens_seen)
    per = f"{tokens_per_step:,} tokens per step"
    total, max_steps = cfg.schedule.total_tokens, cfg.schedule.max_steps
    if length_from_tokens(cfg):
        return (f"run length: --total-tokens {total:,} -> {end:,} steps of {per} = {tokens:,} tokens"
                f" ({src}, rounded up); the schedule spans them")
    if ender == "total-tokens":
        return (f"run length: --total-tokens {total:,} ends the run at step {end:,} ({tokens:,} tokens at"
                f" {per}; a budget stop, exit 5), before --max-steps {max_steps:,} ({src}): the schedule spans"
                f" {max_steps:,} steps and stops at {end / max_steps:.0%} of it")
    line = f"run length: --max-steps {cfg.schedule.max_steps:,} ({src}) x {per} = {tokens:,} tokens"
    if cfg.schedule.total_tokens is not None:
        line += f"; --total-tokens {cfg.schedule.total_tokens:,} never binds (the run ends first)"
    return line


REPEAT_WHY = ("beyond ~4 epochs repeated tokens are worth much less than new ones (Muennighoff et al. 2023, Scaling"
              " Data-Constrained Language Models)")


def check_repeats(data, run_tokens: int, max_epochs: float | None, source: str = "given") -> tuple[str, ...]:
    """The warning for sources a run of `run_tokens` tokens reads more than the mix's warn_epochs (default 4)
    times, naming each with its epochs and unique tokens; UsageError when one goes past `max_epochs` (the
    resolved setting, launcher/settings.py; `source`: where it came from)."""
    read = data.epochs(run_tokens)  # sources of unknown size (streamed from the hub) are not judged
    over = [(name, epochs, size) for name, epochs, size in read if epochs > data.warn_epochs]
    named = ", ".join(f"{name!r} ~{epochs:,.1f} epochs of {size:,} unique tokens" for name, epochs, size in over)
    if max_epochs is not None:
        beyond = [(name, epochs) for name, epochs, _ in read if epochs > max_epochs]
        if beyond:
            name, epochs = max(beyond, key=lambda x: x[1])
            raise UsageError(f"--max-epochs {max_epochs:g} ({source}):"
                             f" this run of {run_tokens:,} tokens reads source {name!r} ~{times(epochs)} times"
                             f" ({len(beyond)} source(s) over); more data, fewer tokens, or a larger --max-epochs")
    if not over:
        return ()
    return (f"{len(over)} source(s) read more than {data.warn_epochs:g} epochs over the run's {run_tokens:,} tokens:"
            f" {named}; {REPEAT_WHY}. More data, fewer tokens, or --max-epochs E to refuse such runs",)


def times(epochs: float) -> str:
    """Epochs as the repetition lines say them: one decimal, and two significant digits below 1 (a --max-epochs
    below 1 must not read as ~0.0 times)."""
    return f"{epochs:,.1f}" if epochs >= 1 else f"{epochs:.2g}"


def hashed_warmup(cfg) -> int | None:
    """What the run id hashes for warmup_steps: a warmup taken from a rule must not change the id with the run's
    length (max_steps may grow on resume and is not part of the id): --warmup-tokens is hashed instead (None
    here), the default rule as 20, the fixed default it replaced (so the ids of earlier runs stay)."""
    source = (cfg.sources or {}).get("warmup_steps", "")
    if source.startswith(RULE_WARMUP_TOKENS):
        return None
    if source.startswith(RULE_WARMUP):
        return DEFAULTS["warmup_steps"]
    return cfg.schedule.warmup_steps


def profile_schedule(profile: dict, where: str) -> dict:
    """{warmup_steps, max_steps, min_ratio} a profile's DeepSpeed "scheduler" section gives (each optional);
    UsageError (one line) for a section zerotrain's schedule cannot honour."""
    section = profile.get("scheduler")
    if section is None:
        return {}
    advice = ("zerotrain runs its own schedule (--schedule cosine|wsd, --warmup-steps, --min-lr, --max-steps);"
              " remove the section or set those")
    if not isinstance(section, dict) or section.get("type") != "WarmupCosineLR":
        kind = section.get("type") if isinstance(section, dict) else section
        raise UsageError(f"{where}: scheduler {kind!r} is not read (only a WarmupCosineLR section is): {advice}")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise UsageError(f"{where}: scheduler.params must be an object")
    unknown = sorted(set(params) - set(SCHEDULER_KEYS))
    if unknown:
        raise UsageError(f"{where}: scheduler.params.{unknown[0]} is not read by zerotrain's schedule: {advice}")
    if params.get("warmup_min_ratio", 0) not in (0, 0.0):
        raise UsageError(f"{where}: scheduler.params.warmup_min_ratio {params['warmup_min_ratio']!r}: zerotrain's"
                         " warmup rises linearly from lr / warmup-steps at step 1 (use 0 or remove it)")
    if params.get("warmup_type", "linear") != "linear":
        raise UsageError(f"{where}: scheduler.params.warmup_type {params['warmup_type']!r}: zerotrain's warmup is"
                         " linear (set \"linear\" or remove it)")
    out = {}
    for key, name in (("warmup_num_steps", "warmup_steps"), ("total_num_steps", "max_steps")):
        v = params.get(key, "auto")
        if v == "auto":
            continue
        lowest = 0 if name == "warmup_steps" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
            raise UsageError(f"{where}: scheduler.params.{key} must be an integer >= {lowest} or \"auto\", got {v!r}")
        out[name] = v
    ratio = params.get("cos_min_ratio", "auto")
    if ratio != "auto":
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise UsageError(f"{where}: scheduler.params.cos_min_ratio must be a number in [0, 1], got {ratio!r}")
        out["min_ratio"] = float(ratio)
    return out


def _lr(cfg, where: str, profile: dict) -> tuple[float, str]:
    if cfg.schedule.lr is not None:
        return cfg.schedule.lr, "given"
    names = optimizers.law_names(cfg.schedule.optimizer if isinstance(cfg.schedule.optimizer, str) else None)
    law = model_spec.rule_law_lr(vars(cfg.model), names)
    if law is not None:
        return law, f"rule {cfg.model.scaling_rule}: lr law for {names[0]}"
    section = profile.get("optimizer")
    if isinstance(section, dict) and _runs_profile_optimizer(cfg, section):
        lr = (section.get("params") or {}).get("lr", "auto")
        if lr != "auto":
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
                raise UsageError(f"{where}: optimizer.params.lr must be a positive number or \"auto\", got {lr!r}")
            return float(lr), f"{where}: optimizer.params.lr"
    own = optimizers.default_lr(cfg.schedule.optimizer if isinstance(cfg.schedule.optimizer, str) else None)
    if own is not None:
        return own, f"optimizer {cfg.schedule.optimizer}'s default"
    args, _, _ = model_spec.resolve(cfg, ModelArgs.vocab_size)  # the vocabulary does not count
    p = count_params(args)["non_embedding"]
    return float(f"{default_lr(p):.3g}"), f"per-size rule for {p / 1e6:,.1f}M non-embedding parameters"


def _round(x: float) -> float:
    """Without the float noise of a product (3e-3 / 10 is 0.00030000000000000003): 3e-4, the value a person
    would write, and the one hashed into run ids before these were derived."""
    return float(f"{x:.12g}")


def _runs_profile_optimizer(cfg, section: dict) -> bool:
    """Whether the run trains with the profile's optimizer section (launcher/optimizers.py resolve_ds_optimizer):
    the default optimizer, or adamw given by name when the profile's section is an AdamW."""
    if cfg.schedule.optimizer is None and not cfg.schedule.optimizer_args:
        return True
    return cfg.schedule.optimizer in (None, "adamw") and str(section.get("type", "")).lower() == "adamw"


def check_schedule(cfg) -> None:
    """The resolved values fit together; the message says where each came from."""
    src = cfg.sources or {}

    def named(name):
        return f"{flag(name)} {value(cfg, name):g} ({src.get(name, 'given')})"

    for name in ("lr", "min_lr"):
        v = value(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{flag(name)}: must be a non-negative number, got {v!r}")
    if cfg.schedule.lr == 0 or cfg.schedule.min_lr > cfg.schedule.lr:
        raise UsageError(f"{named('lr')} / {named('min_lr')}: need 0 <= min-lr <= lr and lr > 0")
    if cfg.schedule.shape not in (None, *SCHEDULES):
        raise UsageError(f"--schedule: must be cosine or wsd, got {cfg.schedule.shape!r}")
    if cfg.schedule.decay_fraction is not None:
        f = cfg.schedule.decay_fraction
        if cfg.schedule.shape != "wsd":
            raise UsageError(f"--decay-fraction {f}: only used with --schedule wsd")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise UsageError(f"--decay-fraction: must be a number in (0, 1], got {f!r}")


def describe_hparams(cfg) -> str:
    """'hyper-parameters: lr 0.0003 (profile a100-80g-x8: optimizer.params.lr), min-lr 3e-05 (lr / 10), ...'"""
    src = cfg.sources or {}
    parts = []
    for name in SHOWN:
        v = value(cfg, name)
        if name == "schedule":
            v = v or "cosine"
        if v is None:
            continue
        parts.append(f"{flag(name)[2:]} {v:g} ({src.get(name, 'given')})" if isinstance(v, float) else
                     f"{flag(name)[2:]} {v} ({src.get(name, 'given')})")
    return "hyper-parameters: " + ", ".join(parts)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
