"""Checkpoint benchmark: save and load times of zerotrain's real save path
(launcher/components/checkpoints/checkpointer.py's Checkpointer around DeepSpeed's save_checkpoint; `checkpointer.load`)
for a ~25M and a ~100M model under ZeRO-2 and ZeRO-3, fp32 with AdamW states, 1 rank, against this
disk's sequential write bandwidth measured in the same run; and how long a save blocks the
training loop without and with `--mirror` (the mirror copy runs on a background thread, like the
hashing that completes a checkpoint).

Each (model, stage) runs in its own process (`python benchmarks/checkpoints.py worker ...`), one
after the other. Save figures count until DeepSpeed's files are written (the page cache, not the
platters: DeepSpeed does not fsync); "then marker" is the background hashing until the checkpoint
is complete; loads read a checkpoint just written (page cache warm).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, TINY, clean_shm, free_port  # noqa: E402

# label -> (how the model is picked, saves, loads, mirrored saves)
MODELS = {"~25M (d8: 8 x 512)": ("d8", 2, 2, 2), "~100M (small: 16 x 768)": ("small", 2, 2, 1)}
if TINY:
    MODELS = {"debug": ("debug", 2, 1, 1)}


def disk_bandwidth(path: Path, total: int = 1 << 30, block: int = 8 << 20) -> tuple[float, float]:
    """(bytes/s into the page cache, bytes/s to the disk with fsync) writing one file sequentially."""
    if TINY:
        total = 16 << 20
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // block):
            f.write(buf)
        t_written = time.perf_counter() - t0
        os.fsync(f.fileno())
    t_synced = time.perf_counter() - t0
    path.unlink()
    return total / t_written, total / t_synced


def worker(stage: int, model: str, out: Path, saves: int, loads: int, mirrored: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    import torch

    from zerotrain.launcher.components.checkpoints import checkpoint, checkpointer
    from zerotrain.launcher.components.engine import EngineSpec, build_engine
    from zerotrain.launcher.profiles import load_profile
    from zerotrain.modeling import sizes
    from zerotrain.modeling.model import count_params, preset

    _, profile = load_profile("cpu")
    ds = {k: v for k, v in profile.items() if k != "zerotrain"}
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1,
              zero_optimization={**ds["zero_optimization"], "stage": stage})
    args = sizes.depth_args(8, 64, 64, vocab_size=258) if model == "d8" else preset(model)
    engine = build_engine(EngineSpec(ds, args, seed=0)).engine  # joins the process group
    ids = torch.randint(0, 258, (1, 32))
    engine.backward(engine(input_ids=ids, labels=ids))
    engine.step()  # AdamW's states exist from here: the checkpoint holds them
    report = {"params": count_params(args)["total"]}
    for label, n, mirror in (("plain", saves, None), ("mirror", mirrored, out / "mirror")):
        ckpt = checkpointer.Checkpointer(out / f"run-{label}" / "checkpoints", "run", 0, 1, keep_last=1, mirror=mirror,
                                         say=lambda m: None)
        blocked, marker, mirrored_s = [], [], []
        for i in range(1, n + 1):
            ckpt.save(engine, i, {"zerotrain": {"step": i}}, {"step": i, "world_size": 1})
            blocked.append(ckpt.last_blocked_s)
            t0 = time.perf_counter()
            ckpt.wait(mirror=False)
            marker.append(time.perf_counter() - t0)
            ckpt.wait()
            mirrored_s.append(time.perf_counter() - t0)
        tag = out / f"run-{label}" / "checkpoints" / checkpoint.tag_for(n)
        size = sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())
        load_s = []
        for _ in range(loads if label == "plain" else 0):
            t0 = time.perf_counter()
            checkpointer.load(engine, tag)
            load_s.append(time.perf_counter() - t0)
        ckpt.close()
        report[label] = {"blocked": blocked, "marker": marker, "mirrored": mirrored_s, "bytes": size, "load": load_s}
    print("RESULT " + json.dumps(report), flush=True)


def bench_checkpoint() -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-ckpt-"))
    rows = []
    med = statistics.median
    try:
        cache_bw, disk_bw = disk_bandwidth(work / "bandwidth.bin")
        results = {}
        for label, (model, saves, loads, mirrored) in MODELS.items():
            for stage in (2, 3):
                out = work / f"{model}-z{stage}"
                out.mkdir()
                port = free_port()
                r = subprocess.run([sys.executable, __file__, "worker", str(stage), model, str(out), str(saves),
                                    str(loads), str(mirrored)], capture_output=True, text=True, cwd=REPO,
                                   env={**os.environ, "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore"})
                shutil.rmtree(out, ignore_errors=True)
                clean_shm(port)
                line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if r.returncode or line is None:
                    raise RuntimeError(f"checkpoint worker {model} ZeRO-{stage}: exit {r.returncode}:"
                                       f" {(r.stderr or r.stdout)[-1500:]}")
                results[(label, stage)] = json.loads(line[len("RESULT "):])
        cache_bw2, disk_bw2 = disk_bandwidth(work / "bandwidth.bin")
        rows.append({"benchmark": "checkpoint: disk sequential write", "setting": f"{'16 MB' if TINY else '1 GiB'}"
                     " file, 8 MiB writes, before and after the saves", "result": f"{cache_bw / 1e6:,.0f} /"
                     f" {cache_bw2 / 1e6:,.0f} MB/s into the page cache, {disk_bw / 1e6:,.0f} / {disk_bw2 / 1e6:,.0f}"
                     " MB/s with fsync", "target": ""})
        for (label, stage), rep in results.items():
            p, m = rep["plain"], rep["mirror"]
            gb = p["bytes"] / 1e9
            save = med(p["blocked"])
            rows.append({"benchmark": f"checkpoint: {label}, ZeRO-{stage}",
                         "setting": f"{rep['params'] / 1e6:.1f}M params, fp32 + AdamW, 1 rank; {gb:.2f} GB a"
                                    f" checkpoint; {len(p['blocked'])} saves, {len(p['load'])} loads",
                         "result": f"save {save:.2f}s ({p['bytes'] / save / 1e6:,.0f} MB/s, {save * disk_bw / p['bytes']:.2f}x"
                                   f" the fsync'd write time), then marker {med(p['marker']):.2f}s; load"
                                   f" {med(p['load']):.2f}s ({p['bytes'] / med(p['load']) / 1e6:,.0f} MB/s); loop"
                                   f" blocked per save {save:.2f}s without --mirror, {med(m['blocked']):.2f}s with"
                                   f" (mirror copy done {med(m['mirrored']):.2f}s later)", "target": ""})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(REPO))
    import warnings

    warnings.filterwarnings("ignore")
    a = sys.argv[2:]
    worker(int(a[0]), a[1], Path(a[2]), int(a[3]), int(a[4]), int(a[5]))
