"""Start-up benchmarks.

`startup`: the demo's launch (2 ranks under the `deepspeed` launcher, ZeRO-3, the demo's flags and
data) from the moment `deepspeed` is started to rank 0's first logged optimizer step, twice in a
row (the second is the warm figure: page cache and DeepSpeed's compiled op cache warm), broken
down by benchmarks/startup_probe.py, which runs the unmodified driver with timestamps around its
phases. Plus what the imports cost by package (`python -X importtime`).

`init_from`: building the model for `--init-from` (launcher/components/engine.py `build_model` on a Hugging Face
directory, one process, the ZeRO-2 layout: built on the CPU in fp32): as it is, the initial weights not drawn
(`weights_loaded_after`; the load draws the rows the checkpoint lacks), against drawing them first and loading over
them (what it did until 2026-11-29), on the same directory; BENCH_INIT_PRESET (default `large`, 0.68B; `debug`
with BENCH_TINY) written once in bf16.

`shard_verify`: ~BENCH_VERIFY_GB (default 1) GB of prepared shards (uint16 tokens in the
`zerotrain prepare` format, written directly) verified by `zerotrain.dataio.format.shards.verify`: full (every
sha256 and the token range) with the page cache cold and warm, and quick (sizes, headers, offsets
and the manifest every time; hashes once per node, cached by file identity): the first start on a
node, later starts, and two ranks of a node starting together (one hashes, the other waits for it).
The page cache is emptied for these files only (posix_fadvise DONTNEED), not for the machine.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, TINY, clean_shm, demo_mix, free_port

INIT_PRESET = os.environ.get("BENCH_INIT_PRESET", "debug" if TINY else "large")
VERIFY_GB = float(os.environ.get("BENCH_VERIFY_GB", "0.01" if TINY else "1"))


def launch_demo(work: Path, n: int) -> dict:
    from zerotrain.launcher.commands.demo import DEMO_FLAGS

    out = work / f"probe-{n}.json"
    port = free_port()
    bindir = Path(sys.executable).parent
    flags = [*DEMO_FLAGS, "--max-steps", "1" if TINY else "2", "--warmup-steps", "0" if TINY else "1",
             "--save-every-steps", "0", "--data", str(demo_mix()), "--out", str(work / "runs"),
             "--run-id", f"startup-{n}"]
    cmd = [str(bindir / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
           str(REPO / "benchmarks" / "startup_probe.py"), *flags]
    env = {**os.environ, "ZT_STARTUP_OUT": str(out), "ZT_STARTUP_CONTROLLER": str(os.getpid()),
           "PYTHONWARNINGS": "ignore"}
    env.pop("OMP_NUM_THREADS", None)  # as `make demo` runs: the driver shares the cores between the ranks
    from startup_probe import started_at

    t_launch = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # /proc start times count from the boot time, which /proc/stat gives in whole seconds: measure
    # that offset on the process just started (its real start is t_launch, to a few ms).
    skew = started_at(proc.pid) - t_launch
    output = proc.communicate()[0]
    clean_shm(port)
    if proc.returncode or not out.is_file():
        raise RuntimeError(f"demo launch exited {proc.returncode}: {output[-1500:]}")
    marks = json.loads(out.read_text())
    marks["rank_exec"] -= skew
    for a in marks["ancestors"]:
        a["t"] -= skew
    marks["t_launch"] = t_launch
    marks["exit_s"] = time.time() - t_launch
    return marks


def breakdown(m: dict) -> tuple[float, str]:
    """Launch to first step, and its parts in order."""
    d = m["durations"]
    anc = sorted(m["ancestors"], key=lambda a: a["t"])  # the deepspeed runner, then launch.py
    t = m["t_launch"]
    parts = []
    for a in anc:
        what = "deepspeed runner" if "deepspeed" in a["cmd"] and "launch" not in a["cmd"] else "launch.py"
        parts.append((f"{what} start", a["t"] - t))
        t = a["t"]
    parts.append(("rank exec", m["rank_exec"] - t))
    parts.append(("imports: interpreter + torch", m["probe_main"] - m["rank_exec"] + m["import_torch_s"]))
    parts.append(("deepspeed", m["import_deepspeed_s"]))
    parts.append(("zerotrain modules", m["import_zerotrain_s"]))
    plan = d.get("plan", 0.0)
    data = d.get("data_load_verify", 0.0)
    parts.append(("plan (profile, tokenizer, mix)", plan - data))
    parts.append(("data load + verification", data))
    init_dist = d.get("init_distributed", 0.0)
    op = d.get("op_load", 0.0)
    parts.append(("process group", init_dist - min(op, init_dist)))
    parts.append(("DeepSpeed op load/build", op))
    engine = d.get("build_engine", 0.0)
    ds_init = d.get("deepspeed_initialize", 0.0)
    parts.append(("model build (zero.Init)", engine - ds_init))
    parts.append(("engine init (deepspeed.initialize)", ds_init))
    parts.append(("data loader", d.get("build_data", 0.0)))
    trainer_rest = d.get("trainer_init", 0.0) - init_dist - engine - d.get("build_data", 0.0)
    parts.append(("rest of Trainer() (lock, run dir, checkpointer, collectives)", trainer_rest))
    first = m["first_step"] - m["train_start"] if "train_start" in m else m.get("first_step_s") or 0.0
    parts.append(("first step", first))
    total = m["first_step"] - m["t_launch"]
    accounted = sum(v for _, v in parts)
    parts.append(("unaccounted (between phases)", total - accounted))
    return total, ", ".join(f"{k} {v:.1f}s" for k, v in parts)


def import_times() -> str:
    """Cumulative import time of the top-level packages a rank imports (`python -X importtime`)."""
    code = ("import torch, deepspeed, zerotrain.launcher.train, zerotrain.launcher.trainer,"
            " zerotrain.dataio.pipeline.loader")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    top = {}
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m and len(m.group(3)) == 1:  # depth 0: imported by the statement itself, children included
            top[m.group(4).split(".")[0]] = top.get(m.group(4).split(".")[0], 0) + int(m.group(2))
    total = sum(top.values())
    best = sorted(top.items(), key=lambda kv: -kv[1])[:6]
    return f"{total / 1e6:.1f}s in all: " + ", ".join(f"{k} {v / 1e6:.2f}s" for k, v in best)


def bench_startup() -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-startup-"))
    rows = []
    try:
        for n, label in ((1, "first launch"), (2, "second launch (warm)"))[:1 if TINY else 2]:
            m = launch_demo(work, n)
            total, parts = breakdown(m)
            rows.append({"benchmark": f"start-up: demo, {label}", "setting": "deepspeed launcher, 2 ranks, ZeRO-3,"
                         " debug model, the demo's flags; `deepspeed` started -> rank 0's first step logged",
                         "result": f"{total:.1f}s: {parts}",
                         "target": "< 20 s warm" if n == 2 else ""})
        rows.append({"benchmark": "start-up: imports by package", "setting": "python -X importtime, one process,"
                     " what a rank imports", "result": import_times(), "target": ""})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def bench_init_from() -> list[dict]:
    import torch

    from zerotrain.launcher.components.engine import EngineSpec, build_model
    from zerotrain.modeling import hf
    from zerotrain.modeling.model import Transformer
    from zerotrain.modeling.sizes import preset

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-init-from-"))
    try:
        with torch.device("meta"):  # shapes only: the file's values are drawn one tensor at a time
            shapes = {n: t.shape for n, t in Transformer(preset(INIT_PRESET)).state_dict().items()}
        torch.manual_seed(0)
        hf.save(work, {n: torch.randn(shape, dtype=torch.bfloat16) * 0.02 for n, shape in shapes.items()},
                preset(INIT_PRESET), dtype=torch.bfloat16)
        args = hf.args_from_config(hf.read_config(work), str(work))

        def timed(old: bool):
            spec = EngineSpec(ds_config={"zero_optimization": {"stage": 2}}, model_args=args, seed=1,
                              init_from=None if old else work)
            t, c = time.perf_counter(), time.process_time()
            model = build_model(spec)
            if old:
                hf.load_weights(model, work)
            return time.perf_counter() - t, time.process_time() - c, model

        times, models = {}, {}
        for old in (True, False, True, False):  # alternated: the second of each is the page cache's warm figure
            models[old] = None  # at most one other model alive while one is built
            wall, cpu, models[old] = timed(old)
            times.setdefault(old, []).append((wall, cpu))
        before = dict(models[True].named_parameters())
        same = all(torch.equal(before[n], p) for n, p in models[False].named_parameters())
        size = f"{INIT_PRESET} ({sum(p.numel() for p in before.values()) / 1e9:.2f}B)"
        rows = []
        for old, label in ((True, "initial weights drawn, then loaded over (until 2026-11-29)"),
                           (False, "initial weights not drawn (weights_loaded_after), loaded")):
            (w1, c1), (w2, c2) = times[old]
            rows.append({"benchmark": f"init-from: {label}", "setting": f"{size}, build_model + load, fp32 on the"
                         f" CPU, {torch.get_num_threads()} thread(s)", "result": f"{w2:.2f} s wall, {c2:.2f} CPU-s"
                         f" (first: {w1:.2f} s, {c1:.2f} CPU-s); {'same' if same else 'OTHER'} loaded weights",
                         "target": ""})
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- shard verification -------------------------------------------------------------------------------

def write_shards(root: Path, total_bytes: int, shard_bytes: int = 256 << 20, seed: int = 0) -> dict:
    """Random byte-tokenizer documents (log-normal lengths around 3k tokens) as uint16 shards plus a
    manifest in the `zerotrain prepare` format (dataio/format/shards.py), checked by read_manifest."""
    import numpy as np

    from zerotrain.dataio.format import shards
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    entries, n_tokens, n_docs, k = [], 0, 0, 0
    shard_bytes = min(shard_bytes, max(1 << 20, total_bytes // 4))
    while n_tokens * 2 < total_bytes:
        want = min(shard_bytes // 2, total_bytes // 2 - n_tokens)
        lengths = np.clip(rng.lognormal(7.6, 0.8, want // 1000 + 1), 20, 50_000).astype(np.int64)
        lengths = lengths[np.cumsum(lengths) <= want]
        if len(lengths) == 0:  # what is left is shorter than a document: done
            break
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = rng.integers(0, 256, int(offsets[-1]), dtype=np.uint16)
        base = f"web-{k:05d}"
        np.save(root / f"{base}.tokens.npy", tokens, allow_pickle=False)
        np.save(root / f"{base}.offsets.npy", offsets, allow_pickle=False)
        entries.append({"file": f"{base}.tokens.npy", "offsets_file": f"{base}.offsets.npy", "source": "web",
                        "sha256": shards.file_sha256(root / f"{base}.tokens.npy"),
                        "offsets_sha256": shards.file_sha256(root / f"{base}.offsets.npy"),
                        "tokens": int(len(tokens)), "documents": int(len(lengths)), "dtype": "uint16",
                        "tokenizer_sha256": tok.sha256})
        n_tokens += len(tokens)
        n_docs += len(lengths)
        k += 1
    manifest = {"format": shards.FORMAT, "version": shards.VERSION, "created_by": "benchmarks/startup.py",
                "tokenizer": {"name": tok.name, "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                              "eos_id": tok.eos_id, "bos_id": tok.bos_id},
                "dtype": "uint16", "mix": {"path": "-", "warn_epochs": 4.0,
                                           "sources": [{"name": "web", "weight": 1.0, "path": "web.jsonl"}]},
                "sources": [{"name": "web", "documents": n_docs, "tokens": n_tokens, "bad_records": 0, "files": 1}],
                "shards": entries}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return shards.read_manifest(root)


def evict(root: Path) -> None:
    """Drop these files' pages from the page cache (this process's files only: nobody else's)."""
    for f in root.iterdir():
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


RANK_VERIFY = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from zerotrain.dataio.format.shards import read_manifest, verify
root = Path(sys.argv[2])
sys.stdin.readline()  # start together
t0 = time.time()
r = verify(root, read_manifest(root), mode=sys.argv[3], cache_dir=Path(sys.argv[4]))
print(f"{time.time() - t0:.3f} {sum(x['hashed'] for x in r)}", flush=True)
"""


def two_ranks_verify(root: Path, mode: str, cache: Path) -> tuple[float, list[int]]:
    """Two processes of one node verifying together; wall time until both are done, shards each hashed."""
    procs = [subprocess.Popen([sys.executable, "-c", RANK_VERIFY, str(REPO), str(root), mode, str(cache)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(2.0 if not TINY else 0.5)  # let both import before the start
    t0 = time.time()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a verifying process failed")
    return time.time() - t0, [int(o[1]) for o in outs]


def bench_shard_verify() -> list[dict]:
    from zerotrain.dataio.format.shards import verify

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-verify-"))
    rows = []
    try:
        root = work / "shards"
        m = write_shards(root, int(VERIFY_GB * 1e9))
        size = sum(f.stat().st_size for f in root.iterdir())
        setting = f"{size / 1e9:.2f} GB in {len(m['shards'])} shards, {sum(s['tokens'] for s in m['shards']) / 1e6:.0f}M tokens"

        def timed(mode, cache, cold):
            if cold:
                evict(root)
            t0 = time.time()
            r = verify(root, m, mode=mode, cache_dir=cache)
            return time.time() - t0, sum(x["hashed"] for x in r)

        results = {}
        results["full, page cache cold"] = timed("full", work / "cache-full", True)
        results["full, page cache warm"] = timed("full", work / "cache-full", False)
        results["quick, first start on this node (cold)"] = timed("quick", work / "cache-quick", True)
        results["quick, later start (cold)"] = timed("quick", work / "cache-quick", True)
        results["quick, later start (warm)"] = timed("quick", work / "cache-quick", False)
        for label, (dt, hashed) in results.items():
            rows.append({"benchmark": f"shard verify: {label}", "setting": setting,
                         "result": f"{dt:.3f}s" + (f" ({size / dt / 1e6:,.0f} MB/s)" if hashed else "")
                                   + f", {hashed} of {len(m['shards'])} shards hashed", "target": ""})
        evict(root)
        dt, hashed = two_ranks_verify(root, "full", work / "cache-2full")
        rows.append({"benchmark": "shard verify: 2 ranks of a node, full", "setting": setting + ", page cache cold",
                     "result": f"{dt:.2f}s until both are done; shards hashed per rank {hashed}", "target": ""})
        evict(root)
        dt, hashed = two_ranks_verify(root, "quick", work / "cache-2quick")
        rows.append({"benchmark": "shard verify: 2 ranks of a node, quick, first start",
                     "setting": setting + ", page cache cold, empty cache",
                     "result": f"{dt:.2f}s until both are done; shards hashed per rank {hashed}",
                     "target": "hashed once per node"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
