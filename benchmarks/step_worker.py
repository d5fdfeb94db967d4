"""One compared training program, run until the benchmark controller (benchmarks/harness.py) has
what it needs. Started as `python`, under `deepspeed --num_gpus N` or under `torchrun`:

    step_worker.py zt --profile P [--compile] zerotrain's real driver: zerotrain.launcher.trainer.plan_run +
                                             Trainer(plan).train(), unmodified; a metrics sink
                                             (the interface --log sinks use) paces it
                   [--sequence-parallel N]   each row shared by N ranks (benchmarks/sequence_parallel.py)
    step_worker.py plain [--fused] ...       our zerotrain.modeling.model.Transformer, torch.optim.AdamW
                                             (as written by a user, or fused=True), clip_grad_norm_;
                   [--attention K]           with attention kernel K (default: auto, sdpa on a CPU)
                   [--one-document]          positions of each row as one document (no mask: what HF pays)
    step_worker.py ddp ...                   the same loop inside DistributedDataParallel (torchrun)
    step_worker.py hf ...                    transformers' LlamaForCausalLM (our weights through
                                             modeling/hf.py), the same loop
    step_worker.py hf-trainer ...            that model in the Hugging Face Trainer with DeepSpeed
                                             ZeRO-2 (the cpu profile's optimizer and clipping)

Every program trains on the same packed rows (input_ids, position_ids, labels) of the demo mix:
zerotrain reads them live through its loader; the others cycle through the first batches that
loader gave, saved by the controller (benchmarks/steps.py) as .npy files. Same shape, batch, seed,
AdamW hyper-parameters (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1) and clipping at 1.0.

Timing: the wall time between consecutive optimizer steps, every step synchronised (the loss is
read back, as each program does to log it). Only rank 0 talks to the controller; other ranks just
keep training and wait in the programs' own collectives while rank 0 is paused.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

T_PROCESS = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
REPO = Path(__file__).resolve().parent.parent


class Pacer:
    """Rank 0's side of the protocol. `begin()` waits for the first command; `tick(record)` after
    every optimizer step times it and, at the end of a chunk, reports and waits for the next one."""

    def __init__(self, name: str, setup: dict):
        host, port = os.environ["ZT_BENCH_CTRL"].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.rfile = self.sock.makefile("r")
        self._send({"hello": name, "setup": setup})
        self.counter = None

    def _send(self, msg: dict) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def begin(self) -> None:
        cmd = json.loads(self.rfile.readline() or '{"cmd": "quit"}')
        if cmd["cmd"] == "quit":
            self._send({"bye": True})
            while True:  # the controller kills this process group now
                time.sleep(60)
        self.want, self.step_s, self.records = cmd["steps"], [], []
        if cmd.get("count"):
            self.counter = CallCounter()
            self.counter.install()
        self.t_last = time.perf_counter()

    def tick(self, record: dict | None = None) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self.t_last)
        if record is not None:
            self.records.append({k: record[k] for k in ("step_s", "data_wait_s") if k in record})
        if len(self.step_s) < self.want:
            self.t_last = time.perf_counter()
            return
        result = {"step_s": self.step_s, "records": self.records}
        if self.counter is not None:
            self.counter.remove()
            result["counts"] = self.counter.per_step(len(self.step_s))
            self.counter = None
        self._send(result)
        self.begin()


class CallCounter:
    """Counts, per caller, collectives (torch.distributed) and host synchronisations (a tensor's
    value read into Python: .item(), .tolist(), float(), int(), bool()), split into calls made by
    zerotrain's own code (launcher/, dataio/, modeling/) and by DeepSpeed. Nested calls (e.g.
    all_gather inside all_gather_object) count once. Only used in a counting chunk, never timed."""

    COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                   "barrier", "reduce_scatter_tensor", "all_gather_into_tensor", "reduce", "gather", "scatter",
                   "all_to_all_single", "reduce_scatter")
    SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall time inside each counted call (a collective's wait)
        self.local = threading.local()
        self.saved = []

    def _origin(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename
            if "/deepspeed/" in path:
                return "deepspeed"
            if path.startswith(str(REPO)) and "/benchmarks/" not in path and "site-packages" not in path:
                return f"zerotrain {Path(path).relative_to(REPO)}:{f.f_code.co_name}"
            f = f.f_back
        return "other"

    def _wrap(self, kind: str, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter.local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            key = f"{kind} {name} <- {counter._origin()}"
            counter.counts[key] = counter.counts.get(key, 0) + 1
            counter.local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                counter.seconds[key] = counter.seconds.get(key, 0.0) + time.perf_counter() - t0
                counter.local.depth = 0
        return wrapper

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        for name in self.COLLECTIVES:
            if hasattr(dist, name):
                self.saved.append((dist, name, dist.__dict__.get(name, None)))
                setattr(dist, name, self._wrap("collective", name, getattr(dist, name)))
        for name in self.SYNCS:
            self.saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name, None)))
            setattr(torch.Tensor, name, self._wrap("host-sync", name, getattr(torch.Tensor, name)))

    def remove(self) -> None:
        for owner, name, original in reversed(self.saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.saved = []

    def per_step(self, steps: int) -> dict[str, list[float]]:
        """{"kind name <- origin": [calls per step, seconds per step]}"""
        return {k: [v / steps, self.seconds.get(k, 0.0) / steps] for k, v in sorted(self.counts.items())}


class PaceSink:
    """A metrics sink (launcher/components/observe/metrics.py's interface: write/close) that paces the real driver:
    the Trainer calls write() once per step record after the step, its collectives and logging."""

    def __init__(self, pacer: Pacer):
        self.pacer = pacer

    def write(self, record: dict) -> None:
        if "event" not in record and "step" in record:
            self.pacer.tick(record)

    def close(self) -> None:
        pass


# -- the programs ----------------------------------------------------------------------------------

def model_args(a):
    from zerotrain.modeling import sizes
    from zerotrain.modeling.model import preset

    if a.shape == "debug":
        return preset("debug", max_seq_len=a.seq)
    depth = int(a.shape.removeprefix("d"))  # d8: the depth rule, head dim 64 (benchmarks/steps.py SHAPES)
    return sizes.depth_args(depth, 64, 64, vocab_size=258, max_seq_len=a.seq)


def fixed_batches(a, rank: int):
    """The controller's saved batches for this rank: a list of dicts of (micro, seq) tensors."""
    import numpy as np
    import torch

    arrays = {k: np.load(Path(a.batches) / f"rank{rank}.{k}.npy", allow_pickle=False)
              for k in ("input_ids", "position_ids", "labels")}
    n = len(arrays["input_ids"])
    return [{k: torch.from_numpy(v[i]).long() for k, v in arrays.items()} for i in range(n)]


def our_model(a):
    import torch

    from zerotrain.modeling.model import Transformer

    torch.manual_seed(a.seed)  # as the driver does before building the model
    return Transformer(model_args(a))


def adamw(params, fused: bool = False):
    """torch.optim.AdamW as a user writes it (on CPU its default is the per-tensor for-loop
    implementation), or with fused=True (one kernel over all tensors)."""
    import torch

    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                             **({"fused": True} if fused else {}))


def loop(a, model, setup: dict, rank: int, forward) -> None:
    """The plain loop every non-DeepSpeed baseline runs; rank 0 paced, other ranks free-running."""
    import torch

    batches = fixed_batches(a, rank)
    optimizer = adamw(model.parameters(), a.fused)
    setup["build_s"] = round(time.time() - setup.pop("_t_build"), 3)
    pacer = Pacer(a.name, setup) if rank == 0 else None
    if pacer:
        pacer.begin()
    i = 0
    while True:
        loss = forward(model, batches[i % len(batches)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # read back, as a loop that logs its loss does: the step is finished here
        i += 1
        if pacer:
            pacer.tick()


def run_zt(a, setup: dict) -> None:
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.run_plan import plan_run, single_process_env
    from zerotrain.launcher.trainer import Trainer

    single_process_env()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cfg = {"profile": a.profile, "data": a.mix, "seq_len": a.seq, "micro_batch": a.micro, "grad_accum": 1,
           "lr": LR, "warmup_steps": 2, "max_steps": 100_000, "seed": a.seed, "out": str(Path(a.work) / "runs"),
           "run_id": a.name, "resume": "never", "log_data_every_steps": 0}
    if a.compile:
        cfg["compile"] = True
    if a.sequence_parallel > 1:
        cfg["sequence_parallel"] = a.sequence_parallel
    if a.shape == "debug":
        cfg["model"] = "debug"
    else:
        cfg.update(depth=int(a.shape.removeprefix("d")), aspect_ratio=64, head_dim=64)
    t0 = time.time()
    plan = plan_run(config_from(cfg), world, rank)
    setup["plan_s"] = round(time.time() - t0, 3)
    t0 = time.time()
    trainer = Trainer(plan)
    setup["trainer_s"] = round(time.time() - t0, 3)
    setup["build_s"] = round(time.time() - setup.pop("_t_build"), 3)
    if rank == 0:
        pacer = Pacer(a.name, setup)
        trainer.metrics.sinks.append(PaceSink(pacer))
        pacer.begin()
    trainer.train()  # runs until the controller kills it
    raise SystemExit(f"{a.name}: the run ended before the controller stopped it")


def run_plain(a, setup: dict) -> None:
    model = our_model(a)
    model.attention = a.attention
    if a.one_document:  # the same rows, attention over the whole row: the cost of document masking, measured
        import torch

        loop(a, model, setup, 0, lambda m, b: m(b["input_ids"], torch.arange(a.seq).expand(a.micro, a.seq),
                                                 labels=b["labels"]))
    else:
        loop(a, model, setup, 0, lambda m, b: m(**b))


def run_ddp(a, setup: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(our_model(a))
    loop(a, model, setup, dist.get_rank(), lambda m, b: m(**b))


def hf_model(a):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32, attn_implementation="sdpa")


def run_hf(a, setup: dict) -> None:
    loop(a, hf_model(a), setup, 0, lambda m, b: m(**b).loss)


def run_hf_trainer(a, setup: dict) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from harness import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    rows = [{k: v[i] for k, v in b.items()} for b in fixed_batches(a, 0) for i in range(a.micro)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 7

        def __getitem__(self, i):
            return rows[i % len(rows)]

    # The cpu profile's DeepSpeed section at ZeRO-2; "auto" lets the Trainer fill in what it owns.
    ds = json.loads(Path(a.profile).read_text())
    ds.pop("zerotrain")
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", train_batch_size="auto",
              gradient_clipping="auto")
    ds["optimizer"]["params"].update(lr="auto", betas="auto", eps="auto", weight_decay="auto")
    state = {}

    class Pace(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            setup["build_s"] = round(time.time() - setup.pop("_t_build"), 3)
            state["pacer"] = Pacer(a.name, setup)
            state["pacer"].begin()

        def on_step_end(self, args, st, control, **kw):
            state["pacer"].tick()

    args = TrainingArguments(output_dir=str(Path(a.work) / a.name), per_device_train_batch_size=a.micro,
                             gradient_accumulation_steps=1, learning_rate=LR, adam_beta1=BETAS[0],
                             adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP,
                             max_steps=100_000, deepspeed=ds, use_cpu=True, report_to=[], logging_steps=10 ** 9,
                             save_strategy="no", dataloader_num_workers=0, lr_scheduler_type="constant",
                             disable_tqdm=True, seed=a.seed)
    trainer = Trainer(model=hf_model(a), args=args, train_dataset=Rows(), callbacks=[Pace()])
    trainer.train()
    raise SystemExit(f"{a.name}: the run ended before the controller stopped it")


IMPORTS = {"zt": ("torch", "deepspeed", "zerotrain.launcher.trainer"), "plain": ("torch", "zerotrain.modeling.model"),
           "ddp": ("torch", "zerotrain.modeling.model"), "hf": ("torch", "transformers"),
           "hf-trainer": ("torch", "deepspeed", "transformers")}
PROGRAMS = {"zt": run_zt, "plain": run_plain, "ddp": run_ddp, "hf": run_hf, "hf-trainer": run_hf_trainer}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("program", choices=sorted(PROGRAMS))
    p.add_argument("--shape", required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--work", required=True)
    p.add_argument("--mix")
    p.add_argument("--profile")
    p.add_argument("--batches")
    p.add_argument("--hf-dir")
    p.add_argument("--fused", action="store_true", help="plain loops: AdamW(fused=True)")
    p.add_argument("--attention", default="auto", help="plain: the model's attention kernel")
    p.add_argument("--one-document", action="store_true", help="plain: every row one document (no mask)")
    p.add_argument("--compile", action="store_true", help="zt: --compile (torch.compile through DeepSpeed)")
    p.add_argument("--sequence-parallel", type=int, default=1, help="zt: --sequence-parallel N (rows shared by N ranks)")
    a = p.parse_args([x for x in argv if not x.startswith("--local_rank")])  # the deepspeed launcher adds it
    a.name = os.environ["ZT_BENCH_NAME"]
    t0 = time.time()
    import importlib

    for module in IMPORTS[a.program]:  # timed: what this program imports before it builds anything
        importlib.import_module(module)
    import torch

    setup = {"imports_s": round(time.time() - t0, 3), "threads": torch.get_num_threads(),
             "process_start_to_imports_s": round(time.time() - T_PROCESS, 3), "_t_build": time.time()}
    PROGRAMS[a.program](a, setup)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import warnings

    warnings.filterwarnings("ignore")
    main(sys.argv[1:])
