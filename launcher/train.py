"""The zerotrain driver: resolve config -> build model -> build engine -> build data -> loop -> save.

Starts the same way under `deepspeed`, `torchrun`, `accelerate launch` and plain `python`
(one process: it sets up the single-rank environment itself). Bad input is refused before
anything is built or written (exit status 2, one line). See README.md for the flags.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable without an install
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataio.errors import DataError  # noqa: E402
from launcher import checkpoint  # noqa: E402
from launcher.config import RunConfig, resolve_config  # noqa: E402
from launcher.errors import UsageError, fail  # noqa: E402
from launcher.profiles import detect_profile, load_profile, resolve_ds_config  # noqa: E402
from launcher.schedule import make_scheduler  # noqa: E402


# DeepSpeed 0.19 still calls torch.distributed's deprecated *_tensor collectives under ZeRO-3.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def single_process_env() -> None:
    """Plain `python launcher/train.py`: become rank 0 of a world of 1."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def plan_run(cfg: RunConfig, world: int) -> dict:
    """Everything decided before any process touches disk or builds a model. Raises UsageError."""
    from dataio.loader import dataloader_settings, open_data
    from dataio.packing import check_packing
    from dataio.tokenizer import load_tokenizer
    from launcher import model_spec

    why = None
    if cfg.profile == "auto":
        name, why = detect_profile()
        cfg.profile = name
    profile_name, profile = load_profile(cfg.profile)
    ds_config = resolve_ds_config(profile, cfg, world, f"profile {profile_name}")
    zt = profile.get("zerotrain", {})
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
        data = open_data(cfg.data, tokenizer)  # a mix file or a prepared shard directory
        loader_settings = dataloader_settings(zt.get("dataloader"), f"profile {profile_name}")
        loader_settings["packing"] = check_packing(cfg.packing or "best-fit")
    except DataError as e:
        raise UsageError(str(e)) from None
    model_args, model_label, init_from = model_spec.resolve(cfg, tokenizer.vocab_size)

    run_id = cfg.run_id or f"{model_label}-{profile_name}-{cfg.identity_hash()}"
    run_dir = Path(cfg.out) / run_id
    ckpt_dir = run_dir / "checkpoints"
    resume_from = None
    if cfg.resume == "auto":
        done = checkpoint.complete_checkpoints(ckpt_dir)
        resume_from = done[-1] if done else None
    elif cfg.resume != "never":
        resume_from = Path(cfg.resume)
        if not (resume_from / checkpoint.MARKER).is_file():
            raise UsageError(f"--resume {cfg.resume}: not a complete zerotrain checkpoint (no {checkpoint.MARKER})")
    elif checkpoint.complete_checkpoints(ckpt_dir):
        raise UsageError(f"--resume never: {run_dir} already holds checkpoints; pick another --run-id")
    if resume_from is not None:
        meta = checkpoint.read_meta(resume_from)
        if meta["world_size"] != world:
            raise UsageError(f"checkpoint {resume_from}: saved by {meta['world_size']} ranks, this launch has {world};"
                             " resuming on another world size would replay or skip data")
        if meta.get("loader_workers", 0) != loader_settings["workers"]:
            raise UsageError(f"checkpoint {resume_from}: its data loader ran {meta.get('loader_workers', 0)} worker(s)"
                             f" per rank, this profile has {loader_settings['workers']}; the document order depends"
                             " on it (set zerotrain.dataloader.workers back)")
        if meta["step"] >= cfg.max_steps:
            raise UsageError(f"checkpoint {resume_from}: already at step {meta['step']} >= --max-steps {cfg.max_steps}")
    saved = run_dir / "config.json"
    if saved.is_file() and resume_from is not None and resume_from.parent == ckpt_dir:
        old = json.loads(saved.read_text())["run"]
        drift = sorted(k for k, v in cfg.to_dict().items()
                       if k not in RunConfig.RESUMABLE_CHANGES and old.get(k) != v)
        if drift:
            raise UsageError(f"config drift against {saved}: " + ", ".join(f"{k} {old.get(k)!r} -> {getattr(cfg, k)!r}"
                             for k in drift) + "; start a new --run-id instead")
    return dict(profile_name=profile_name, profile_why=why, profile=profile, ds_config=ds_config, specs=data.specs,
                data=data, loader_settings=loader_settings,
                tokenizer=tokenizer, model_args=model_args, model_label=model_label, init_from=init_from,
                run_dir=run_dir, ckpt_dir=ckpt_dir,
                resume_from=resume_from, zerotrain=zt)


def main(argv: list[str] | None = None) -> None:
    single_process_env()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    from dataio.loader import MODEL_KEYS, Batches, batch_digest, load_data

    try:
        cfg = resolve_config(argv)
        plan = plan_run(cfg, world)
        data = load_data(plan["data"])  # reads every source / verifies every shard: bad data stops here
    except (UsageError, DataError) as e:
        fail(str(e))

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from modeling.model import Transformer, count_params, flops_per_token, held_numel

    zt, ds_config, run_dir = plan["zerotrain"], plan["ds_config"], plan["run_dir"]
    deepspeed.init_distributed(dist_backend=zt.get("dist_backend") or get_accelerator().communication_backend_name())
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks on this node
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    is_main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    if plan["profile_why"]:
        say(f"profile auto -> {plan['profile_name']} ({plan['profile_why']})")

    # -- run directory: the resolved config and the exact DeepSpeed dict ------------------------
    if is_main:
        plan["ckpt_dir"].mkdir(parents=True, exist_ok=True)
        resolved = {"run": cfg.to_dict(), "run_id": run_dir.name, "profile": plan["profile_name"],
                    "world_size": world, "model": plan["model_args"].to_dict(), "tokenizer": plan["tokenizer"].name,
                    "sources": [s.__dict__ for s in plan["specs"]]}
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    dist.barrier()

    # -- model and engine --------------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    args = plan["model_args"]
    if ds_config["zero_optimization"].get("stage", 0) == 3:
        # No rank ever holds the full model. The dtype comes from the config's bf16/fp16 sections:
        # do not pass dtype= here, DeepSpeed 0.19 turns an explicit float32 into bfloat16 on CPU
        # (an operator-precedence slip in Init._set_dtype), which made fp32 runs 8x slower.
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = Transformer(args)
    else:
        model = Transformer(args)
    if plan["init_from"] is not None and plan["resume_from"] is None:  # before deepspeed.initialize copies them
        from modeling.hf import load_weights

        load_weights(model, plan["init_from"])
        say(f"initialised from {plan['init_from']}")
    held = [None] * world
    dist.all_gather_object(held, held_numel(model))
    ac = cfg.activation_checkpointing if cfg.activation_checkpointing is not None else zt.get("activation_checkpointing")
    model.activation_checkpointing = bool(ac)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=make_scheduler(cfg))
    if cfg.compile:  # DeepSpeed compiles the module in place: parameter names do not change
        engine.compile(backend=zt.get("compile_backend") or accel.get_compile_backend())
    n_params = count_params(args)
    say(f"model {plan['model_label']}: {n_params['total'] / 1e6:.2f}M params"
        f" ({n_params['non_embedding'] / 1e6:.2f}M non-embedding),"
        f" profile {plan['profile_name']}, ZeRO-{ds_config['zero_optimization'].get('stage', 0)}, world {world},"
        f" batch {ds_config['train_micro_batch_size_per_gpu']} x {ds_config['gradient_accumulation_steps']} x {world}"
        f" x {cfg.seq_len} tokens")
    say(f"parameters held per rank after construction: {', '.join(f'{n:,}' for n in held)} of {n_params['total']:,}"
        + (", compiled with torch.compile" if cfg.compile else ""))

    # -- data -------------------------------------------------------------------------------
    from dataio.commands import describe_data

    for line in describe_data(data, cfg.max_steps * ds_config["train_batch_size"] * cfg.seq_len):
        say(line)
    loader = Batches(data, rank, world, cfg.seed, cfg.seq_len, ds_config["train_micro_batch_size_per_gpu"],
                     plan["loader_settings"], plan["loader_settings"]["packing"])
    stop_possible = any(s.on_exhausted == "stop" for s in data.specs)
    final_loader_state = None  # set when the data runs out: the state before the unfinished step

    # -- resume -----------------------------------------------------------------------------
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if plan["resume_from"] is not None:
        state = checkpoint.load(engine, plan["resume_from"])["zerotrain"]
        step, tokens_seen, elapsed_before = state["step"], state["tokens_seen"], state["elapsed_s"]
        try:
            loader.load_state_dict(state["loader_states"][rank])
        except DataError as e:
            fail(str(e))
        say(f"resumed from {plan['resume_from']} at step {step}")
    metrics_path = run_dir / "metrics.jsonl"
    if is_main and metrics_path.exists():  # drop steps logged after the checkpoint we resume from
        kept = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= step]
        metrics_path.write_text("".join(line + "\n" for line in kept))

    def save_checkpoint() -> Path:
        states = [None] * world
        dist.all_gather_object(states, final_loader_state or loader.state_dict())
        client_state = {"zerotrain": {"step": step, "tokens_seen": tokens_seen, "loader_states": states,
                                      "elapsed_s": elapsed_before + time.time() - t_start}}
        meta = {"step": step, "tokens_seen": tokens_seen, "world_size": world, "run_id": run_dir.name,
                "loader_workers": plan["loader_settings"]["workers"]}
        return checkpoint.save(engine, plan["ckpt_dir"], step, client_state, meta)

    # -- loop -------------------------------------------------------------------------------
    accum = ds_config["gradient_accumulation_steps"]
    tokens_per_step = ds_config["train_batch_size"] * cfg.seq_len
    flops = flops_per_token(args, cfg.seq_len)
    peak = zt.get("peak_flops_per_device")
    bar = None
    if is_main:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    t_start = time.time()
    last_saved = None
    with open(metrics_path, "a") if is_main else open(os.devnull, "w") as metrics:
        while step < cfg.max_steps:
            t0 = time.time()
            lr = engine.get_lr()[0]
            loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)  # NCCL needs it on the GPU
            state_before = loader.state_dict() if stop_possible else None
            try:
                batches = [loader.next() for _ in range(accum)]  # every rank: the same count, or all stop
            except DataError as e:  # a bad record met mid-stream (streamed sources), on any rank
                print(f"zerotrain: error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
            ended = any(b is None for b in batches)
            mine = torch.tensor([int(ended), 0 if ended else batch_digest(batches)], dtype=torch.int64,
                                device=engine.device)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            if any(int(t[0]) for t in every):
                final_loader_state = state_before
                say(f"data ran out before step {step + 1} (a source with on_exhausted: stop"
                    f"{': ' + repr(loader.exhausted) if loader.exhausted else ' on another rank'}); stopping")
                break
            tokens_sha = hashlib.blake2b(b"".join(int(t[1]).to_bytes(8, "little") for t in every),
                                         digest_size=8).hexdigest()
            for batch in batches:
                batch = {k: batch[k].to(engine.device) for k in MODEL_KEYS}
                loss = engine(**batch)
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().double()
            dist.all_reduce(loss_sum)
            loss_value = loss_sum.item() / (accum * world)
            step += 1
            tokens_seen += tokens_per_step
            dt = time.time() - t0
            if not math.isfinite(loss_value):
                fail(f"step {step}: loss is {loss_value}; stopping. Last checkpoint: {last_saved or 'none'}", code=3)
            grad_norm = engine.get_global_grad_norm()
            record = {"step": step, "loss": loss_value, "lr": lr, "tokens_sha": tokens_sha,
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "tokens_seen": tokens_seen, "tokens_per_s": round(tokens_per_step / dt, 1),
                      "elapsed_s": round(elapsed_before + time.time() - t_start, 3)}
            if peak:
                record["mfu"] = round(flops * tokens_per_step / dt / (peak * world), 5)
            if cfg.log_data_every_steps and step % cfg.log_data_every_steps == 0:
                per_source = torch.tensor(loader.tokens_per_source(), dtype=torch.float64, device=engine.device)
                dist.all_reduce(per_source)
                shares = (per_source / per_source.sum()).tolist()
                record["data_shares"] = {s.name: round(x, 5) for s, x in zip(data.specs, shares)}
                if is_main:
                    bar.write(f"step {step}: token shares " + ", ".join(
                        f"{s.name} {x:.2%} (weight {s.weight:.2%})" for s, x in zip(data.specs, shares)))
            if is_main:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
            if cfg.save_every_steps and step % cfg.save_every_steps == 0 and step < cfg.max_steps:
                last_saved = save_checkpoint()
    last_saved = save_checkpoint()
    if bar is not None:
        bar.close()
    say(f"saved checkpoint {last_saved}")
    if cfg.compile:
        from torch._dynamo.utils import counters

        say(f"torch.compile: {counters['stats']['unique_graphs']} graphs compiled")
    say(f"run directory: {run_dir.resolve()}")


if __name__ == "__main__":
    main(sys.argv[1:])
