"""Test harness for the optimizer registry (launcher/optimizers.py) under a real `deepspeed` launch.

For each ZeRO stage and each optimizer asked for, on the debug model with the cpu profile's
settings (fp32, gradient clipping 1.0), the stage overridden:

1. the engine is built by the driver's own builder (launcher/components/engine.py: zero.Init at stage 3,
   the registry's optimizer, our schedule, check_engine) from resolve_ds_config's dict;
2. update rule: from the fixed initial state, STEPS_CHECKED steps on fixed batches, and after each
   the parameters are compared with a plain-PyTorch reference written here, independently of
   DeepSpeed and of launcher/client_optimizers.py (same gradients: the mean over the ranks'
   micro-batches, clipped by global norm; same lr per step from launcher/components/schedule.Schedule).
   Per tensor, err = |dW_ds - dW_ref| / |dW_ref| with dW the change from the initial weights;
   `contrast` is the same measure against AdamW on every tensor (what a wrong rule would score);
3. the loss falls: STEPS_TRAINED steps on a small repeating byte corpus;
4. optimizer state bytes per parameter held, on rank 0;
5. with --resume OPT...: exact resume at each of --resume-stages (default 3): 0 -> 4 saving at 2, then a
   fresh engine loads step 2 and trains 2 -> 4: weights (torch.equal) and losses must be identical.

6. with --against-the-run MIX: the run's own engine (plan_run -> spec_from_plan -> build_engine, as
   Trainer._build_engine does) and this harness's, for the same inputs (the cpu profile at ZeRO-3, AdamW,
   the debug model): the dict DeepSpeed got, the ZeRO stage, the optimizer classes, each parameter's
   shape and this rank's partition of it, the initial weights and the lr schedule must be the same.

Rank 0 writes one JSON object: results[stage][optimizer] = {max_err, worst, contrast, losses, ...},
results["resume-STAGE"][optimizer] = {weights_equal, losses_equal, ...} and
results["against-the-run"] = {same (per rank), run, harness (rank 0's signatures)}.

Usage: deepspeed --num_gpus 2 tests/helpers/optim_harness.py OUT.json STAGES OPTIMIZER [OPTIMIZER ...]
                 [--resume OPTIMIZER ...] [--resume-stages S,S] [--against-the-run MIX.json]
       (STAGES e.g. 0,1,2,3; an optimizer may carry its --optimizer-args after '=':
       'ademamix={"warmup_steps": 2}')
With TORCHDYNAMO_DISABLE=1 (as tests/test_optimizers.py runs it) DeepSpeed's torch.compile'd Muon
update runs eagerly, the same arithmetic without a 30-60 s compile on a CPU.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from zerotrain.launcher.components import startup_gc  # noqa: E402

startup_gc.pause()  # a rank's start-up without the cyclic collector, as launcher/train.py's (off for a short
# harness's life unless it runs the trainer, whose loop resumes it)
warnings.filterwarnings("ignore", category=FutureWarning)

SEED, SEQ_LEN, MICRO, ACCUM = 1234, 64, 1, 2
STEPS_CHECKED, STEPS_TRAINED, WINDOWS = 3, 10, 8
CORPUS = Path(json.__file__).with_name("decoder.py").read_bytes()
REFERENCES: dict = {}  # (optimizer spec, clip[, "wrong"]) -> the reference's parameters after each step


def batch(step: int, micro: int, rank: int, world: int):
    """input_ids (MICRO, SEQ_LEN) of this micro-batch: byte windows of a small fixed corpus, cycled."""
    import torch

    rows = []
    for i in range(MICRO):
        w = (((step * ACCUM + micro) * world + rank) * MICRO + i) % WINDOWS
        rows.append(list(CORPUS[w * SEQ_LEN:(w + 1) * SEQ_LEN]))
    return torch.tensor(rows, dtype=torch.long)


# ------------------------------------------------------------------------------------------------
# Reference update rules: one step on full fp64 tensors, state in a dict per parameter
# ------------------------------------------------------------------------------------------------

def newton_schulz(g, steps=5):
    """Keller Jordan's quintic Newton-Schulz iteration (the polynomial DeepSpeed's Muon evaluates), in fp64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if transposed else x


def adamw_step(p, g, st, lr, betas, eps, wd):
    st.setdefault("m", p.new_zeros(p.shape)), st.setdefault("v", p.new_zeros(p.shape))
    st["t"] = st.get("t", 0) + 1
    t, (b1, b2) = st["t"], betas
    p.mul_(1 - lr * wd)
    st["m"] = b1 * st["m"] + (1 - b1) * g
    st["v"] = b2 * st["v"] + (1 - b2) * g * g
    p.sub_(lr * (st["m"] / (1 - b1 ** t)) / ((st["v"] / (1 - b2 ** t)).sqrt() + eps))


def muon_step(p, g, st, lr, momentum, wd):
    st.setdefault("buf", p.new_zeros(p.shape))
    st["buf"] = momentum * st["buf"] + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * st["buf"]  # Nesterov
    o = newton_schulz(u) * math.sqrt(max(1.0, p.size(0) / p.size(1)))
    p.mul_(1 - lr * wd)
    p.sub_(lr * o)


def lion_step(p, g, st, lr, betas, wd):
    st.setdefault("m", p.new_zeros(p.shape))
    b1, b2 = betas
    c = b1 * st["m"] + (1 - b1) * g
    p.mul_(1 - lr * wd)
    p.sub_(lr * c.sign())
    st["m"] = b2 * st["m"] + (1 - b2) * g


def decaying_wd_step(p, g, st, lr, peak, betas, eps, wd, timescale):
    st.setdefault("m", p.new_zeros(p.shape)), st.setdefault("v", p.new_zeros(p.shape))
    st["t"] = st.get("t", 0) + 1
    t, (b1, b2) = st["t"], betas
    p.mul_(1 - wd * (lr / peak) / (1 + t / timescale))
    st["m"] = b1 * st["m"] + (1 - b1) * g
    st["v"] = b2 * st["v"] + (1 - b2) * g * g
    p.sub_(lr * (st["m"] / (1 - b1 ** t)) / ((st["v"] / (1 - b2 ** t)).sqrt() + eps))


def ademamix_step(p, g, st, lr, betas, alpha, warmup, eps, wd):
    for k in ("m1", "m2", "v"):
        st.setdefault(k, p.new_zeros(p.shape))
    st["t"] = st.get("t", 0) + 1
    t, (b1, b2, b3) = st["t"], betas
    # Paper, section 3: alpha linear, beta3 so that the slow EMA's half-life grows linearly (eq. 3)
    f = min(1.0, t / warmup)
    alpha_t = alpha * f
    b3_t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - f) * math.log(b3) + f * math.log(b1))), b3)
    st["m1"] = b1 * st["m1"] + (1 - b1) * g
    st["m2"] = b3_t * st["m2"] + (1 - b3_t) * g
    st["v"] = b2 * st["v"] + (1 - b2) * g * g
    p.mul_(1 - lr * wd)
    p.sub_(lr * (st["m1"] / (1 - b1 ** t) + alpha_t * st["m2"]) / ((st["v"] / (1 - b2 ** t)).sqrt() + eps))


def reference_update(name, hp, cfg, ds_config):
    """update(param_name, p, g, state, lr_multiplier) for the optimizer `name` with its resolved args."""
    if name in (None, "adamw"):
        prm = ds_config["optimizer"]["params"]
        lr = cfg.schedule.lr
        return lambda n, p, g, st, f: adamw_step(p, g, st, lr * f, prm["betas"], prm["eps"], prm["weight_decay"])
    if name == "muon":
        def update(n, p, g, st, f):
            if p.dim() >= 2 and "embed" not in n and "lm_head" not in n:
                muon_step(p, g, st, cfg.schedule.lr * f, hp["momentum"], hp["weight_decay"])
            else:
                adamw_step(p, g, st, hp["adam_lr"] * f, hp["betas"], hp["eps"], hp["weight_decay"])
        return update
    if name == "lion":
        return lambda n, p, g, st, f: lion_step(p, g, st, cfg.schedule.lr * f, hp["betas"], hp["weight_decay"])
    if name == "adamw-decaying-wd":
        ts = hp["wd_timescale"] or max(1, cfg.schedule.max_steps // 10)
        lr = cfg.schedule.lr
        return lambda n, p, g, st, f: decaying_wd_step(p, g, st, lr * f, lr, hp["betas"], hp["eps"],
                                                       hp["weight_decay"], ts)
    if name == "ademamix":
        warm = hp["warmup_steps"] or cfg.schedule.max_steps
        lr = cfg.schedule.lr
        return lambda n, p, g, st, f: ademamix_step(p, g, st, lr * f, hp["betas"], hp["alpha"], warm, hp["eps"],
                                                    hp["weight_decay"])
    raise ValueError(name)


def reference_run(args, init: dict, world: int, update, sched, clip: float):
    """Parameters (fp64) after each of STEPS_CHECKED steps of the reference, from `init`."""
    import torch

    from zerotrain.modeling.model import Transformer

    model = Transformer(args).double()
    model.load_state_dict({k: v.double() for k, v in init.items()})
    state, out = {}, []
    for s in range(STEPS_CHECKED):
        grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in range(world):  # DeepSpeed averages over the ranks and the accumulated micro-batches
            for j in range(ACCUM):
                model.zero_grad()
                ids = batch(s, j, r, world)
                model(input_ids=ids, labels=ids).backward()
                for n, p in model.named_parameters():
                    grads[n] += p.grad / (world * ACCUM)
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        coef = min(1.0, clip / (float(norm) + 1e-6)) if clip else 1.0
        with torch.no_grad():
            for n, p in model.named_parameters():
                update(n, p, grads[n] * coef, state.setdefault(n, {}), sched(s))
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def full_params(model) -> dict:
    """Every parameter whole, as fp64 on the CPU (a collective under ZeRO-3)."""
    import deepspeed

    params = list(model.parameters())
    ctx = deepspeed.zero.GatheredParameters(params) if hasattr(params[0], "ds_id") else _null()
    with ctx:
        return {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def rel_errors(ds_params: dict, ref_params: dict, init: dict) -> dict:
    out = {}
    for n, ref in ref_params.items():
        d_ref = ref - init[n].double()
        d_ds = ds_params[n] - init[n].double()
        out[n] = float((d_ds - d_ref).norm() / max(float(d_ref.norm()), 1e-30))
    return out


def state_bytes_per_param(engine) -> float:
    """Optimizer state held by this rank / trainable elements it updates."""
    import torch

    opt = engine.basic_optimizer
    held = sum(p.numel() for g in opt.param_groups for p in g["params"])
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    zero = engine.optimizer  # ZeRO keeps Muon's momentum itself (outside the basic optimizer's state)
    for attr in ("muon_momentum_buffer_partitioned_groups_flat",):
        for t in (getattr(zero, attr, None) or {}).values():
            state += t.numel() * t.element_size()
    if held == 0:  # ZeRO-3 hands the basic optimizer its fp32 partitions under other names
        held = sum(t.numel() for t in getattr(zero, "fp32_partitioned_groups_flat", []))
    return state / held if held else float("nan")


def spec(stage: int, opt_spec: str, world: int):
    """The engine's EngineSpec (launcher/components/engine.py) for the debug model at `stage` with the
    optimizer `opt_spec` (its arguments after '='), the cpu profile's other settings."""
    from zerotrain.launcher.components.engine import EngineSpec
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.profiles import load_profile, resolve_ds_config
    from zerotrain.modeling.model import preset

    name, _, args_json = opt_spec.partition("=")
    values = {"data": "-", "seq_len": SEQ_LEN, "micro_batch": MICRO, "grad_accum": ACCUM, "max_steps": STEPS_TRAINED,
              "warmup_steps": 2, "seed": SEED, "optimizer": name}
    if args_json:
        values["optimizer_args"] = args_json
    # the lr: the optimizer's default (muon 0.02, lion 3e-4), else the cpu profile's (adamw, 3e-3) or the per-size
    # rule (launcher/hparams.py)
    cfg = config_from(values)
    _, profile = load_profile("cpu")
    profile["zero_optimization"]["stage"] = stage
    ds_config = resolve_ds_config(profile, cfg, world, f"cpu at stage {stage}")
    return EngineSpec(ds_config, preset("debug", max_seq_len=SEQ_LEN), seed=cfg.run.seed, run=cfg)


def build(stage: int, opt_spec: str, world: int):
    """(cfg, ds_config, model, engine, initial full parameters), built by the driver's builder."""
    from zerotrain.launcher.components.engine import build_engine

    s = spec(stage, opt_spec, world)
    built = build_engine(s)
    model = built.model
    return s.run, built.ds_config, model, built.engine, full_params(model)  # as built: no step taken yet


def train_step(engine, s: int, rank: int, world: int) -> float:
    """One optimizer step (ACCUM micro-batches); the loss averaged over ranks and micro-batches."""
    import torch

    total = 0.0
    for j in range(ACCUM):
        ids = batch(s, j, rank, world).to(engine.device)
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
    t = torch.tensor([total], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / (world * ACCUM)


def run_one(stage: int, opt_spec: str, world: int, rank: int) -> dict:
    from zerotrain.launcher.optimizers import resolve
    from zerotrain.launcher.components.schedule import Schedule
    from zerotrain.modeling.model import preset

    t0 = time.time()
    cfg, ds_config, model, engine, init = build(stage, opt_spec, world)
    build_s = time.time() - t0
    args = preset("debug", max_seq_len=SEQ_LEN)
    _, hp = resolve(cfg.schedule.optimizer, cfg.schedule.optimizer_args)
    update = reference_update(cfg.schedule.optimizer, hp, cfg, ds_config)
    sched = Schedule(cfg.schedule.lr, cfg.schedule.min_lr, cfg.schedule.warmup_steps, cfg.schedule.max_steps)
    clip = ds_config.get("gradient_clipping", 0.0)
    ref = contrast_ref = None
    if rank == 0:  # the same for every stage (same start, data, schedule): computed once per optimizer
        key = (opt_spec, clip)
        if key not in REFERENCES:
            REFERENCES[key] = reference_run(args, init, world, update, sched, clip)
        ref = REFERENCES[key]
    if rank == 0 and cfg.schedule.optimizer not in (None, "adamw") and (opt_spec, clip, "wrong") not in REFERENCES:
        # What a wrong rule would score: AdamW (the profile's betas, eps, weight decay) on every
        # tensor at that tensor's lr; for Muon, DeepSpeed's silent fallback (all AdamW at adam_lr).
        wrong_lr = hp["adam_lr"] if cfg.schedule.optimizer == "muon" else cfg.schedule.lr
        REFERENCES[opt_spec, clip, "wrong"] = reference_run(args, init, world, lambda n, p, g, st, f: adamw_step(
            p, g, st, wrong_lr * f, [0.9, 0.95], 1e-8, 0.1), sched, clip)
    if rank == 0:
        contrast_ref = REFERENCES.get((opt_spec, clip, "wrong"))
    losses, errs, contrast, t1 = [], [], [], time.time()
    for s in range(STEPS_TRAINED):
        losses.append(train_step(engine, s, rank, world))
        if s < STEPS_CHECKED:
            now = full_params(model)
            if rank == 0:
                errs.append(rel_errors(now, ref[s], init))
                if contrast_ref is not None:
                    contrast.append(max(rel_errors(now, contrast_ref[s], init).values()))
    train_s = time.time() - t1
    result = {"lr": cfg.schedule.lr, "hp": hp, "build_s": round(build_s, 2), "train_s": round(train_s, 2),
              "losses": losses, "state_bytes_per_param": state_bytes_per_param(engine),
              "optimizer_class": type(engine.basic_optimizer).__name__, "ds_optimizer": ds_config.get("optimizer"),
              "gradient_clipping": clip}
    if rank == 0:
        worst = max(errs[-1], key=errs[-1].get)
        result.update(max_err=[max(e.values()) for e in errs], worst=worst, errors=errs[-1],
                      contrast=contrast or None)
    if hasattr(engine, "destroy"):
        engine.destroy()
    return result


def resume_one(stage: int, opt_spec: str, world: int, rank: int, ckpt_dir: Path) -> dict:
    """Train 0 -> N saving at K; a fresh engine loads K and trains K -> N: bit-identical weights and losses?"""
    import torch
    import torch.distributed as dist

    n, k = 4, 2
    _, _, model, engine, _ = build(stage, opt_spec, world)
    first = []
    for s in range(n):
        first.append(train_step(engine, s, rank, world))
        if s + 1 == k:
            engine.save_checkpoint(str(ckpt_dir), tag=f"step{k}")
    end_a = full_params(model)
    engine.destroy()
    _, _, model, engine, _ = build(stage, opt_spec, world)
    engine.load_checkpoint(str(ckpt_dir), tag=f"step{k}")
    second = first[:k] + [train_step(engine, s, rank, world) for s in range(k, n)]
    end_b = full_params(model)
    engine.destroy()
    dist.barrier()
    same = all(torch.equal(end_a[name], end_b[name]) for name in end_a)
    return {"losses_a": first, "losses_b": second, "weights_equal": same, "losses_equal": first == second}


def engine_signature(engine, ds_config: dict) -> dict:
    """What an engine was built as, on this rank (gathering the weights is a collective under ZeRO-3)."""
    digest = hashlib.sha256()
    for name, t in full_params(engine.module).items():
        digest.update(name.encode())
        digest.update(t.numpy().tobytes())
    return {"ds_config": ds_config, "zero_stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
            "partition": [[n, list(getattr(p, "ds_shape", p.shape)), getattr(p, "ds_tensor", p).numel()]
                          for n, p in engine.module.named_parameters()],
            "weights": digest.hexdigest(), "lr": engine.get_lr(),
            "lr_multipliers": [engine.lr_scheduler.lr_lambdas[0](s) for s in range(STEPS_TRAINED)]}


def against_the_run(mix: str, world: int, rank: int, work: Path) -> dict:
    """The run's engine and this harness's, built from the same inputs: their signatures on every rank."""
    import torch.distributed as dist

    from zerotrain.launcher.components.engine import build_engine, spec_from_plan
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.run_plan import plan_run

    values = {"data": mix, "model": "debug", "profile": "cpu", "seq_len": SEQ_LEN, "micro_batch": MICRO,
              "grad_accum": ACCUM, "max_steps": STEPS_TRAINED, "warmup_steps": 2, "seed": SEED, "out": str(work),
              "resume": "never"}
    built = build_engine(spec_from_plan(plan_run(config_from(values), world, rank)))  # as Trainer._build_engine
    run = engine_signature(built.engine, built.ds_config)
    built.engine.destroy()
    _, ds_config, _, engine, _ = build(3, "adamw", world)
    harness = engine_signature(engine, ds_config)
    engine.destroy()
    same = [None] * world
    dist.all_gather_object(same, run == harness)
    return {"same": same, "run": run, "harness": harness}


def main(argv: list[str]) -> None:
    import argparse

    from zerotrain.launcher.components.process_group import init_process_group

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("stages")
    p.add_argument("optimizers", nargs="*")
    p.add_argument("--resume", nargs="*", default=[], help="optimizers whose exact resume is checked")
    p.add_argument("--resume-stages", default="3")
    p.add_argument("--against-the-run", default=None, help="a mix: compare the run's engine with this harness's")
    ns, _ = p.parse_known_args(argv)  # the deepspeed launcher adds --local_rank
    dist, _ = init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}

    def report(key, spec, r):
        if rank == 0:
            print(f"{key} {spec}: " + (r["error"] if "error" in r else json.dumps(
                {k: r[k] for k in ("max_err", "contrast", "state_bytes_per_param", "build_s", "train_s",
                                   "weights_equal", "losses_equal") if k in r})), flush=True)

    for stage in (int(s) for s in ns.stages.split(",")):
        for spec in ns.optimizers:
            try:
                r = run_one(stage, spec, world, rank)
            except Exception as e:  # noqa: BLE001 - reported per combination, the others still run
                r = {"error": f"{type(e).__name__}: {e}"}
            results.setdefault(str(stage), {})[spec] = r
            report(f"stage {stage}", spec, r)
    for stage in (int(s) for s in ns.resume_stages.split(",")):
        for i, spec in enumerate(ns.resume):
            try:
                r = resume_one(stage, spec, world, rank, Path(ns.out).with_suffix("") / f"ckpt-{stage}-{i}")
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {e}"}
            results.setdefault(f"resume-{stage}", {})[spec] = r
            report(f"resume at stage {stage}", spec, r)
    if ns.against_the_run:
        try:
            results["against-the-run"] = against_the_run(ns.against_the_run, world, rank,
                                                         Path(ns.out).with_suffix("") / "against-the-run")
        except Exception as e:  # noqa: BLE001 - reported; the results above still written
            results["against-the-run"] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        Path(ns.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from harness_exit import exit_after  # leaves with os._exit once the body returns (why: harness_exit.py)

    with exit_after():
        main(sys.argv[1:])
