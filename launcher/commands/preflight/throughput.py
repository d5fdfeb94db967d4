"""Pre-flight v2, throughput: the micro-batch that trains fastest and fits, and a data loader that keeps up.

A micro-batch sweep (--sweep, default micro/2, micro, 2x, 4x; grad-accum 1; --sweep-steps steps each:
tokens/s per rank and peak memory, GPU max_memory_allocated or host peak RSS, max over ranks; the
planner's fit check first, larger ones skipped after one that does not fit or runs out of memory; the
fastest that fits marked); the data loader alone (--loader-seconds), tokens/s per rank, against what
the model consumes per rank (its step time minus the data wait; ratio >= DATA_RATIO_MIN); the fraction
of step time waiting on data (<= DATA_WAIT_MAX); both at the configured micro-batch.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

from zerotrain.dataio.pipeline.loader import Batches
from zerotrain.launcher.commands.preflight.measure import (DATA_RATIO_MIN, DATA_WAIT_MAX, GiB, disk_throughput,
                                                           peak_rss, rate, slowed)
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.offload import ops as offload
from zerotrain.launcher.planning import device_memory_here, fit_check
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import resolve_ds_config


class Throughput:
    """The v2 checks: the plan, the sweep, then the loader and the data wait at the configured micro-batch."""
    name, title = "v2", "throughput"

    def __init__(self, pf):  # pf: the harness's Preflight (harness.py, which imports this module)
        self.pf = pf
        self.base = None  # the run's plan at its own micro-batch (data read once; the candidates share it)

    def run(self) -> bool:
        self.pf.start_stage(self.name)
        self.pf.ensure_backend()
        self.pf.check("plan", self.c_plan, "the run does not plan: see the message")
        if not self.pf.passed("plan"):
            self.pf.skip(["micro-batch sweep", "data loader", "data wait"], "needs the plan")
            return self.pf.end_stage()
        nvme = offload.nvme_paths(self.base.ds_config)
        if nvme:  # every rank at once, as the run swaps
            self.pf.check("nvme throughput", lambda: self.c_nvme(nvme),
                          "--nvme-path cannot be written or read: see the message")
        sweep = self.pf.check("micro-batch sweep", self.c_sweep, "the configured --micro-batch does not fit: use the"
                                                                 " largest that fits (above), or see `zerotrain plan`")
        mine = next((c for c in sweep.get("candidates", []) if c["configured"] and "tokens_per_s_per_rank" in c), None)
        if mine is None:
            self.pf.skip(["data loader", "data wait"], "needs a run at the configured micro-batch")
            return self.pf.end_stage()
        self.pf.check("data loader", lambda: self.c_loader(mine),
                      "the loader cannot keep the model fed: `zerotrain prepare` the data (no tokenizing while"
                      " training), raise zerotrain.dataloader.workers in the profile, or use faster storage")
        wait = mine["data_wait_fraction"]
        self.pf.check("data wait", lambda: (wait <= DATA_WAIT_MAX, f"{wait:.1%} of step time waiting on data at"
                                            f" micro-batch {mine['micro_batch']} (at most {DATA_WAIT_MAX:.0%})",
                                            {"data_wait_fraction": wait, "seconds": 0.0}),
                      "steps wait on data: raise zerotrain.dataloader.workers / prefetch_factor, prepare the data, or"
                      " move it to local disk")
        return self.pf.end_stage()

    def c_plan(self):
        self.base = self.pf.plan(self.pf.scratch_cfg("v2", eval_every_steps=0))  # data read once; candidates share it
        ds = self.base.ds_config
        return True, (f"{self.base.model_label}, micro {ds['train_micro_batch_size_per_gpu']} x accum"
                      f" {ds['gradient_accumulation_steps']} x {self.pf.world} rank(s)"), {}

    def c_nvme(self, paths: list[str]):
        """Read and write throughput at each --nvme-path (measure.disk_throughput), this rank's, all ranks at
        once: informational (no threshold), it fails only when the directory cannot be written or read."""
        t0 = time.time()
        said, data = [], {}
        for path in paths:
            m = disk_throughput(Path(path))
            data[path] = m
            said.append(f"{path}: write {m['write_bytes_per_s'] / 1e9:.2f} GB/s, read {m['read_bytes_per_s'] / 1e9:.2f}"
                        f" GB/s ({m['bytes'] // 2**20} MiB per rank, {self.pf.world} rank(s) at once; fsync'd, read"
                        " after dropping the page cache)")
        return True, "; ".join(said), {"nvme": data, "seconds": time.time() - t0}

    def planner_says(self, cfg, ds_config) -> tuple[float | None, str | None]:
        """(the planner's bytes per rank, or its refusal) for a candidate; (None, None) with --no-fit-check
        (then every candidate runs)."""
        if getattr(self.pf.cfg, "fit_check", None) is False:
            return None, None
        try:
            m = fit_check(cfg, self.base.model_args, ds_config, self.base.settings.values, self.pf.world)
        except UsageError as e:
            return None, str(e)
        return m.total, None

    def device_bytes(self) -> float | None:
        """Memory one rank may use: the planner's view of this device (GPU memory, or RAM / local ranks)."""
        try:
            return device_memory_here(self.pf.settings.hardware.get("accelerator", "cuda"),
                                      int(os.environ.get("LOCAL_WORLD_SIZE", self.pf.world)))[0]
        except (UsageError, TypeError, ValueError):
            return None

    def c_sweep(self):
        micro = self.base.ds_config["train_micro_batch_size_per_gpu"]
        limit = self.pf.from_main(self.device_bytes)  # RAM available differs between ranks' moments: rank 0's
        rows, ran_out = [], None
        for m in sorted(set(self.pf.opts.sweep or [max(1, micro // 2), micro * 2, micro * 4]) | {micro}):
            row = {"micro_batch": m, "configured": m == micro}
            rows.append(row)
            if ran_out is not None:
                row["skipped"] = ran_out
                continue
            name = f"v2-mb{m}"
            cfg = self.pf.scratch_cfg(name, micro_batch=m, grad_accum=1, global_batch_tokens=None,
                                      max_steps=self.pf.opts.sweep_steps, save_every_steps=0, eval_every_steps=0)
            ds = resolve_ds_config(self.pf.profile, cfg, self.pf.world, f"profile {self.pf.profile_name}")
            predicted, refusal = self.pf.from_main(lambda: self.planner_says(cfg, ds))
            if predicted:
                row["planner_gib"] = round(predicted / GiB, 3)
            if refusal:
                row["skipped"] = ran_out = f"the planner says it does not fit ({refusal[:200]})"
                continue
            run_dir = Path(cfg.run.out) / name
            row.update(self.measure(dataclasses.replace(self.base, cfg=cfg, ds_config=ds, run_dir=run_dir,
                                                        eval_rows=None, resume_from=None, resume_meta=None,
                                                        checkpoints_seen=tuple(checkpoint.complete_checkpoints(
                                                            run_dir / "checkpoints"))), name))
            if row.get("oom"):
                ran_out = f"micro-batch {m} ran out of memory"
            row["fits"] = not row.get("oom") and (limit is None or row["peak_gib"] * GiB <= limit)
        fitting = [r for r in rows if r.get("fits")]
        best = max(fitting, key=lambda r: r["tokens_per_s_per_rank"]) if fitting else None
        mine = next(r for r in rows if r["configured"])
        for r in rows:
            r["best"] = r is best
        parts = [f"{r['micro_batch']}: " + (f"skipped, {r['skipped']}" if "skipped" in r else "out of memory"
                                             if r.get("oom") else
                                             f"{rate(r['tokens_per_s_per_rank'])} tok/s/rank, {r['peak_gib']:.2f} GiB"
                                             + (" (best)" if r["best"] else "")
                                             + ("" if r["fits"] else " (more than the device has)")) for r in rows]
        detail = "micro-batch " + "; ".join(parts)
        if best is not None and best is not mine and mine.get("fits"):
            gain = best["tokens_per_s_per_rank"] / mine["tokens_per_s_per_rank"] - 1
            detail += f"; --micro-batch {best['micro_batch']} gives {gain:+.0%} tokens/s over the configured {micro}"
        return bool(mine.get("fits")), detail, {"candidates": rows, "device_gib": limit and round(limit / GiB, 2)}

    def measure(self, plan, name: str) -> dict:
        """A few steps at one micro-batch: tokens/s per rank, data wait, peak memory (max over ranks)."""
        gpu = self.pf.accel.device_name() != "cpu"
        trainer, oom = None, False
        self.pf.fresh_peaks()
        try:
            trainer = self.pf.build(plan)
            trainer.loader = self.pf.hooks.preflight_loader(trainer.loader, self.pf.rank, plan.cfg.schedule.micro_batch)
            trainer.train()
        except RuntimeError as e:  # torch.OutOfMemoryError is one; the CPU allocator words it differently
            if "out of memory" not in str(e).lower() and "can't allocate memory" not in str(e):
                self.pf.release(trainer)
                raise
            oom = True
        # agreed before any rank frees, gathers or tries the next candidate: after an out-of-memory on one rank
        # the others may still be inside the step's collectives
        if self.pf.outcomes(name, "oom" if oom else "ok") is None:
            if not oom:
                raise RuntimeError(f"another rank did not finish micro-batch {plan.cfg.schedule.micro_batch}")
            self.pf.end_after_oom(f"micro-batch {plan.cfg.schedule.micro_batch} ran out of memory here while another rank"
                                  " was still inside the step's collectives; pre-flight ends now rather than at the"
                                  f" comm timeout ({self.pf.settings.comm_timeout_s:g} s): sweep micro-batches below"
                                  f" {plan.cfg.schedule.micro_batch} (--sweep)")
        self.pf.release(trainer)
        every = self.pf.gather((oom, self.pf.accel.max_memory_allocated() if gpu else (peak_rss() or 0)))
        self.pf.drop_checkpoints(name)
        if any(o for o, _ in every):
            return {"oom": True}
        records, _ = self.pf.records(name)
        timed = records[1:] or records  # step 1 is start-up
        # what the model alone consumes: the step's tokens over its time minus the wait for data
        model = [r["tokens_per_s"] * r["step_s"] / max(r["step_s"] - r["data_wait_s"], 1e-9) for r in timed]
        return {"tokens_per_s_per_rank": round(statistics.median(r["tokens_per_s"] for r in timed) / self.pf.world, 1),
                "model_tokens_per_s_per_rank": round(statistics.median(model) / self.pf.world, 1),
                "data_wait_fraction": round(statistics.median(r["data_wait_s"] / r["step_s"] for r in timed), 4),
                "peak_gib": round(max(p for _, p in every) / GiB, 3), "steps": len(records),
                "memory": "max_memory_allocated" if gpu else "peak RSS"}

    def c_loader(self, mine):
        base, cfg = self.base, self.base.cfg
        loader = slowed(Batches(base.data, self.pf.rank, self.pf.world, cfg.run.seed, cfg.data.seq_len,
                                base.ds_config["train_micro_batch_size_per_gpu"], base.loader_settings,
                                base.loader_settings["packing"]), self.pf.hooks)
        loader.next()  # start-up (worker processes) is not the steady rate
        n, t0 = 0, time.time()
        while time.time() - t0 < self.pf.opts.loader_seconds:
            batch = loader.next()
            if batch is None:
                break
            n += batch["input_ids"].numel()
        rates = self.pf.gather(n / (time.time() - t0))
        loader.close()
        need = mine["model_tokens_per_s_per_rank"]
        ratio = min(rates) / need if need else math.inf
        return ratio >= DATA_RATIO_MIN, (f"loader {rate(min(rates))} tokens/s per rank (slowest rank) vs the model's"
                                         f" {rate(need)} (its step time minus the wait for data): {ratio:,.1f}x (at"
                                         f" least {DATA_RATIO_MIN:g}x)"), \
            {"loader_tokens_per_s_per_rank": [round(r, 1) for r in rates], "model_tokens_per_s_per_rank": need,
             "ratio": round(ratio, 3)}
