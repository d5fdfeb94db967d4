"""Pre-flight v1, stability: the launch works end to end, once, on every rank.

backend on every rank; all-reduce and all-gather values; with --sequence-parallel N > 1, the run's checks of N
(world, --seq-len, heads) and one layer's forward all-to-all timed over the sequence-parallel group, next to
the planner's figure for the profile's link; the data (prepared shards: every checksum,
`zerotrain.dataio.format.shards.verify`; a mix: every local source read, the first record of a streamed one);
the model and engine build; one training step; one checkpoint written and verified against its
marker; read back into a fresh engine and compared tensor by tensor (sha256 of every parameter and
optimizer-state tensor this rank holds, the loader state, step and tokens); one evaluation on all
ranks (the run's eval rows, else rows of the training mix); one resumed step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from pathlib import Path

from zerotrain.dataio.format import shards
from zerotrain.dataio.pipeline.loader import open_data
from zerotrain.dataio.sources.holdout import mix_rows
from zerotrain.dataio.sources.readers import load_text_source
from zerotrain.dataio.sources.streamed import open_streamed, record_text
from zerotrain.dataio.sources.tokenizer import load_tokenizer
from zerotrain.launcher.commands.preflight.measure import all_to_all_seconds, master_tensors, state_digests
from zerotrain.launcher import planning
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.config import with_values
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.profiles import precision, resolve_ds_config
from zerotrain.launcher.sequence.checks import check_sequence_parallel_plan
from zerotrain.launcher.sequence.groups import sequence_groups


class Stability:
    """The v1 checks, in order; a check whose prerequisite failed is skipped (on every rank alike)."""
    name, title = "v1", "stability"

    def __init__(self, pf):  # pf: the harness's Preflight (harness.py, which imports this module)
        self.pf = pf
        self.a = self.b = self.plan_a = None  # the engine trained one step; the one resumed from its checkpoint

    def run(self) -> bool:
        self.pf.start_stage(self.name)
        checks = [  # name, what it needs (None: the read-back engine), the check, what to fix
            ("backend", "", self.c_backend, "the process group did not start on every rank: check MASTER_ADDR/PORT,"
                                            " the hostfile, the network interface (NCCL_SOCKET_IFNAME), the driver"),
            ("collectives", "backend", self.c_collectives, "collectives give wrong values: check the NCCL/gloo"
                                                           " settings, the interconnect and the devices"),
            *([("sequence parallel", "collectives", self.c_sequence_parallel,
                "--sequence-parallel N must divide the world size, --seq-len and the attention heads (kv heads: divide"
                " by N or divide it); a slow all-to-all: check the interconnect between the group's ranks")]
              if self.pf.settings.sequence_parallel > 1 else []),
            ("data", "backend", self.c_data, "fix or re-prepare the data named above (`zerotrain verify DIR` for"
                                             " shards)"),
            ("build", "data", self.c_build, "the model or engine did not build: see the log; `zerotrain plan` for"
                                            " memory"),
            ("step", "build", self.c_step, "one training step failed: see the log"),
            ("checkpoint write", "step", self.c_write, "the checkpoint is incomplete or does not verify: check the"
                                                       " disk (space, quota, the shared filesystem)"),
            ("checkpoint read-back", "checkpoint write", self.c_readback,
             "the checkpoint does not read back as written: check the filesystem (caching, consistency) and the"
             " DeepSpeed version"),
            ("evaluation", None, self.c_eval, "the evaluation failed or disagreed between ranks: see the log"),
            ("resume", None, self.c_resume, "the resumed run did not train on: see the log")]
        try:
            for name, need, fn, fix in checks:
                if need and not self.pf.passed(need):
                    self.pf.skip([name], f"needs a passing {need} check")
                elif need is None and self.b is None:
                    self.pf.skip([name], "needs the engine resumed from the checkpoint")
                else:
                    self.pf.check(name, fn, fix)
            return self.pf.end_stage()
        finally:
            self.pf.release(self.a)
            self.pf.release(self.b)
            if self.pf.locked:
                self.pf.drop_checkpoints("v1")

    def c_backend(self):
        t0 = time.time()
        backend = self.pf.ensure_backend()
        ranks, hosts = zip(*self.pf.gather((self.pf.rank, socket.gethostname())))
        ok = list(ranks) == list(range(self.pf.world))
        return ok, (f"{self.pf.world} rank(s) on {len(set(hosts))} host(s), {backend}" if ok else
                    f"ranks reported {list(ranks)}, expected 0..{self.pf.world - 1}"), \
            {"hosts": sorted(set(hosts)), "backend": backend, "seconds": time.time() - t0}

    def c_collectives(self):
        torch, dist, world = self.pf.torch, self.pf.dist, self.pf.world
        device = self.pf.accel.current_device_name()
        x = torch.tensor([float(self.pf.rank + 1)], dtype=torch.float64, device=device)
        dist.all_reduce(x)
        got = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(got, torch.tensor([self.pf.rank * 7 + 3], dtype=torch.int64, device=device))
        big = torch.ones(1 << 22, dtype=torch.float32, device=device)  # 16 MiB: a gradient bucket's size
        dist.barrier()
        t0 = time.time()
        dist.all_reduce(big)
        self.pf.accel.synchronize()
        dt = time.time() - t0
        problems = []
        if float(x.item()) != world * (world + 1) / 2:
            problems.append(f"all-reduce of rank+1 gave {x.item()}, not {world * (world + 1) / 2}")
        if [int(t.item()) for t in got] != [r * 7 + 3 for r in range(world)]:
            problems.append(f"all-gather gave {[int(t.item()) for t in got]}")
        if not bool((big == world).all()):
            problems.append("the 16 MiB all-reduce gave wrong values")
        bus = 2 * (world - 1) / world * big.numel() * 4 / dt if world > 1 else None
        return not problems, "; ".join(problems) or (
            f"all-reduce and all-gather correct; 16 MiB all-reduce {dt * 1e3:.0f} ms"
            + (f" ({bus / 1e9:.2f} GB/s bus bandwidth)" if bus else "")), \
            {"allreduce_16mib_s": round(dt, 4), "bus_gb_s": bus and round(bus / 1e9, 3)}

    def c_sequence_parallel(self):
        """--sequence-parallel N: the run's own checks (launcher/sequence/checks.py), then one layer's forward
        all-to-all (q, k, v and the kernel's output at the run's shapes and dtype) timed over DeepSpeed's
        sequence-parallel group, next to the planner's figure for the profile's link (planning.all_to_all_bytes, sequence_link)."""
        pf, sp, cfg, args = self.pf, self.pf.settings.sequence_parallel, self.pf.cfg, self.pf.model_args
        check_sequence_parallel_plan(cfg, pf.settings, args, pf.world)  # UsageError: this check's FAIL, one line
        torch, dist = pf.torch, pf.dist
        ds = resolve_ds_config(pf.profile, cfg, pf.world // sp, f"profile {pf.profile_name}")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision(ds)]
        micro = ds["train_micro_batch_size_per_gpu"]
        mpu, exchange = sequence_groups(sp)  # the groups the engine builder uses (made once per process)
        group = mpu.get_sequence_parallel_group()
        kv = max(args.n_kv_heads, sp)  # fewer kv heads than N are repeated before the exchange
        shapes = [(sp, micro, cfg.data.seq_len // sp, heads // sp, args.head_dim) for heads in (args.n_heads, kv, kv,
                                                                                           args.n_heads)]

        def synchronize():
            pf.accel.synchronize()
            dist.barrier(group=group)

        seconds = all_to_all_seconds(exchange, shapes, dtype, pf.accel.current_device_name(), synchronize)
        sent = planning.all_to_all_bytes(args, micro, cfg.data.seq_len, dtype.itemsize, sp, False).forward
        local = int(os.environ.get("LOCAL_WORLD_SIZE", pf.world))
        nodes = max(1, pf.world // max(1, local))
        setup = planning.setup_from(ds, {**pf.settings.values, "sequence_parallel": sp}, world=pf.world, nodes=nodes,
                                   device_bytes=1.0)
        rate, link, key = planning.sequence_link(setup)
        measured = sent / seconds
        planned = (f"planner: {sent / rate * 1e3:.3g} ms at {rate / 1e9:g} GB/s {link}" if rate else
                   f"planner: no bandwidth in the profile for the link {link}")
        # Judged, not failed: a profile that states a faster link than the machine has (NVLink written, PCIe
        # found) makes the plan's step time optimistic, which the user should know before a long run; the run
        # itself is still correct. Half the stated rate is the line: one small exchange is latency-bound, so a
        # healthy link measures under its peak here.
        slower = rate / measured if rate and measured < rate / 2 else None
        if slower:
            planned += (f"; measured at {slower:.3g}x below the profile's link, so the plan's all-to-all time is"
                        f" optimistic: set {key} to {measured / 1e9:.3g}, or find the slow link")
        detail = (f"N = {sp} divides the world ({pf.world}), --seq-len {cfg.data.seq_len}, heads {args.n_heads} and"
                  " kv heads"
                  f" {args.n_kv_heads}; one layer's forward all-to-all (q, k, v, output, {str(dtype)[6:]}, micro-batch"
                  f" {micro}): {seconds * 1e3:.3g} ms, {sent / 1e6:.3g} MB sent per rank = {measured / 1e9:.3g}"
                  f" GB/s; {planned}")
        return True, detail, {"all_to_all_s": round(seconds, 6), "all_to_all_bytes": sent,
                              "all_to_all_gb_s": round(measured / 1e9, 4), "planned_s": rate and sent / rate,
                              "planned_gb_s": rate and rate / 1e9, "slower_than_planned": slower and round(slower, 3)}

    def c_data(self):
        """The data read the way training reads it, on every rank (nodes may have their own disks)."""
        tokenizer = load_tokenizer(self.pf.cfg.data.tokenizer)
        parts = []
        for path in [self.pf.cfg.data.path] + ([self.pf.cfg.eval.eval_data] if self.pf.cfg.eval.eval_data else []):
            data = open_data(path, tokenizer)
            if data.kind == "shards":
                results = shards.verify(Path(data.path), data.manifest, tokenizer)
                parts.append(f"{path}: {len(results)} shard(s), {sum(r['bytes'] for r in results) / 1e6:,.1f} MB,"
                             " sha256 and counts verified")
                continue
            for spec in data.specs:
                if spec.streamed:
                    record = next(iter(open_streamed(spec, self.pf.rank, self.pf.world)), None)
                    if record is None or record_text(spec, record, lambda why: None) is None:
                        raise UsageError(f"{spec.where()}: the first streamed record has no text")
                else:
                    load_text_source(spec)
            parts.append(f"{path}: {len(data.specs)} source(s) read")
        return True, "; ".join(parts), {}

    def c_build(self):
        plan = self.plan_a = self.pf.plan(self.pf.scratch_cfg("v1", max_steps=1))
        self.a = self.pf.build(plan)
        ds = plan.ds_config
        return True, (f"{plan.model_label}, ZeRO-{ds['zero_optimization'].get('stage', 0)}, micro"
                      f" {ds['train_micro_batch_size_per_gpu']} x accum {ds['gradient_accumulation_steps']} x"
                      f" {self.pf.world} rank(s)"), {}

    def c_step(self):
        result = self.a.train()
        records, _ = self.pf.records("v1")
        if result.exit_code != 0 or not records:
            return False, f"the step ended {result.stop}: {result.message}", {}
        r = records[-1]
        return True, f"loss {r['loss']:.4f}, grad norm {r.get('grad_norm') or 0:.3g}, {r['step_s']:.2f} s", \
            {"loss": r["loss"], "seconds": r["step_s"]}

    def c_write(self):
        t0, tag = time.time(), self.a.state.last_saved
        if tag is None:
            return False, "no checkpoint was written after the step", {}
        problem, files = self.pf.from_main(lambda: (checkpoint.verify(tag) if (tag / checkpoint.MARKER).is_file() else
                                                    f"{tag}: no completion marker ({checkpoint.MARKER})",
                                                    checkpoint.read_meta(tag).get("files", {})
                                                    if (tag / checkpoint.MARKER).is_file() else {}))
        if problem:
            return False, problem, {}
        stop = [e for e in self.pf.records("v1")[1] if e.get("event") == "stop"]
        save_s = stop[-1].get("save_blocked_s", 0.0) if stop else 0.0
        size = sum(f.get("size", 0) for f in files.values())
        return True, (f"{tag.name}: {len(files)} file(s), {size / 1e6:,.1f} MB, sizes and sha256 verified; the save"
                      f" blocked training {save_s:.2f} s"), {"save_s": save_s, "bytes": size,
                                                              "seconds": save_s + time.time() - t0}

    def c_readback(self):
        """A fresh engine resumed from the checkpoint holds what the first one wrote, tensor by tensor."""
        a = self.a
        written, loader_state, counters, tag = state_digests(a.engine), a.loader.state_dict(), \
            (a.state.step, a.state.tokens_seen), a.state.last_saved
        self.pf.release(a)  # never two engines at once: the real model may fill the device
        self.a = None
        found = checkpoint.find_resume(tag.parent, None, say=lambda *_: None)  # the resume path: files verified
        if found != tag:
            return False, f"resume would start from {found}, not {tag}", {}
        cfg = with_values(self.plan_a.cfg, {"resume": "auto", "max_steps": 2})
        b = self.b = self.pf.build(dataclasses.replace(self.plan_a, cfg=cfg, resume_from=found,
                                                       resume_meta=checkpoint.read_meta(found),
                                                       checkpoints_seen=tuple(checkpoint.complete_checkpoints(
                                                           tag.parent))))  # what A wrote: B's plan sees it
        if self.pf.hooks.preflight_readback == "perturb":  # test hook: a read-back that differs from what was written
            master_tensors(b.engine)[1][0].data.view(-1)[0] += 1.0
        read = state_digests(b.engine)
        problems = [f"tensors written and read differ: {sorted(set(read) ^ set(written))[:3]}"] \
            if set(read) != set(written) else []
        differ = [k for k in written if k in read and read[k][0] != written[k][0]]
        problems += [f"{k} differs (sum {written[k][1]:.9g} written, {read[k][1]:.9g} read)" for k in differ[:3]]
        if len(differ) > 3:
            problems.append(f"and {len(differ) - 3} more tensor(s)")
        if (b.state.step, b.state.tokens_seen) != counters:
            problems.append(f"step/tokens {b.state.step}/{b.state.tokens_seen} read, {counters[0]}/{counters[1]} written")
        if json.dumps(b.loader.state_dict(), sort_keys=True) != json.dumps(loader_state, sort_keys=True):
            problems.append("the data loader's state differs")
        optimizer = sum("fp32 master" in k for k in written)
        same = (f"{len(written)} tensors identical (sha256, on every rank: {len(written) - optimizer} parameters,"
                f" {optimizer} fp32 master and optimizer state); loader state, step and tokens identical")
        return not problems, "; ".join(problems) or same, {"tensors": len(written), "optimizer_tensors": optimizer}

    def c_eval(self):
        b = self.b
        evaluator, what = b.evaluator, "the run's eval rows"
        if evaluator is None:  # the run evaluates nothing: rows of the training mix
            plan, micro = b.plan, b.plan.ds_config["train_micro_batch_size_per_gpu"]
            rows = mix_rows(plan.data, self.pf.cfg.data.seq_len, self.pf.cfg.data.seq_len * micro * plan.data_world)
            # by row group, as the Trainer builds its own: a sequence-parallel group's ranks share each row
            evaluator = Evaluator(rows, plan.data_rank, plan.data_world, micro, plan.sequence_parallel,
                                  self.pf.rank % plan.sequence_parallel)
            what = "rows of the training mix"
        val = evaluator.evaluate(b.engine, device=b.engine.device)
        losses = self.pf.gather(val["val_loss"])
        ok = all(math.isfinite(v) for v in losses) and len(set(losses)) == 1
        return ok, (f"val_loss {val['val_loss']:.4f} on {val['val_tokens']:,} tokens ({what}), the same on every"
                    " rank" if ok else f"val_loss per rank {losses}"), {"val_loss": val["val_loss"]}

    def c_resume(self):
        start = self.b.state.step
        result = self.b.train()
        records, events = self.pf.records("v1")
        last = records[-1] if records else {}
        resumed = any(e.get("event") == "resume" and e.get("step") == start for e in events)
        ok = result.exit_code == 0 and resumed and last.get("step") == start + 1 \
            and math.isfinite(last.get("loss", math.nan))
        return ok, (f"resumed at step {start}; step {start + 1} loss {last['loss']:.4f}" if ok else
                    f"the resumed run ended {result.stop} at step {result.step}: {result.message}"), {}
