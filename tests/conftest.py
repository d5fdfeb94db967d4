"""Shared fixtures: small on-disk data and a way to run the real driver under each launcher."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from zerotrain.launcher.components.launching.jobs import free_port  # noqa: F401  (the tests take it from here)

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "launcher" / "train.py"
BIN = Path(sys.executable).parent

WORDS = ("the model reads every token of the packed row and learns which byte comes next while "
         "deepspeed shards the optimizer state across ranks so that memory per rank stays small").split()


def synthetic_docs(n: int, seed: int, min_words: int = 5, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + "."
            for _ in range(n)]


def write_mix(root: Path, weights=(0.7, 0.3), n_docs: int = 400) -> Path:
    """A two-source mix: `prose` (jsonl) and `notes` (txt, blank-line separated)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "prose.jsonl", "w") as f:
        for doc in synthetic_docs(n_docs, seed=1):
            f.write(json.dumps({"text": doc}) + "\n")
    (root / "notes.txt").write_text("\n\n".join(synthetic_docs(n_docs, seed=2)) + "\n")
    mix = root / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "prose", "path": "prose.jsonl", "weight": weights[0]},
        {"name": "notes", "path": "notes.txt", "weight": weights[1]}]}))
    return mix


@pytest.fixture(scope="session")
def mix_path(tmp_path_factory) -> Path:
    return write_mix(tmp_path_factory.mktemp("data"))


def pytest_configure(config):
    """`make test` hides the GPUs of a CUDA host from every test and every rank it launches: the `cpu` profiles
    are refused where DeepSpeed would pick CUDA, and these tests are about the CPU path. `make test-gpu`
    (`-m gpu`, tests/test_gpu_cuda.py) keeps them."""
    if (config.option.markexpr or "").strip() != "gpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_sessionstart(session):
    """Every CPU launch loads DeepSpeed's JIT-built shared-memory op (deepspeed_shm_comm). Built here, once, in one
    process, before any test launches ranks: two ranks of the first launch would otherwise build it concurrently
    under whatever timeout that test has, and a build killed there (a timeout, a test's kill -9) leaves torch's
    extension lock, on which every later launch of the session waits until its own timeout. A lock already
    stale (older than any build takes: a killed build of an earlier session) is removed first, and said."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return  # the GPU tier: no CPU launches
    from zerotrain.launcher.components import offload
    for lock in offload.stale_build_locks():
        print(f"conftest: removing {lock}, a build lock left by a killed build", file=sys.stderr)
        lock.unlink(missing_ok=True)
    if not offload.is_built("deepspeed_shm_comm"):
        built = subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; "
                                "assert build_shm_op() is not None"], capture_output=True, text=True, timeout=1800)
        if built.returncode != 0:
            pytest.exit("conftest: DeepSpeed's deepspeed_shm_comm op did not build, so no CPU launch can run:\n"
                        + built.stdout[-2000:] + built.stderr[-2000:], returncode=3)


BACKGROUND_OPS = {"cpu_adam": "CPUAdamBuilder", "cpu_lion": "CPULionBuilder", "async_io": "AsyncIOBuilder"}
PREBUILD_MIN_TESTS = 100  # a session this large runs long enough to gain from building the ops beside it
_prebuild: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    if (os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not session.config.option.collectonly
            and len(session.items) >= PREBUILD_MIN_TESTS):
        from zerotrain.launcher.components import offload
        _prebuild.append(prebuild_in_background(offload))


def pytest_sessionfinish(session, exitstatus):
    """A background build still running is waited for: whatever ends this session's processes after it (a CI
    step, a sandbox) would otherwise kill it mid-build and leave torch's lock, on which the next session's first
    load of that op waits without end (the conftest removes only locks older than any build takes)."""
    for proc in _prebuild:
        if proc.poll() is None:
            print("\nconftest: waiting for the background op build to finish", file=sys.stderr)
            try:
                proc.wait(timeout=1800)
            except subprocess.TimeoutExpired:
                pass


def prebuild_in_background(offload) -> subprocess.Popen:
    """The other JIT-built ops the suite loads (CPU Adam for the offload runs, CPU Lion for the optimizer tests,
    async I/O for NVMe: ~45 s, ~110 s and ~3 min on 2 cores) are built by one niced process started now, while
    the in-process tests run: a sequential suite leaves about one of two cores idle (user + sys time 1.1 x the
    wall time, fresh-clone run of 2026-11-26). A test that needs an op before it is done waits on torch's build
    lock, as it would on its own build. The process has a session of its own, so a killed pytest never kills
    it mid-build (which would leave the lock every later load waits on); the session's end waits for it
    (pytest_sessionfinish). Only for a session of PREBUILD_MIN_TESTS tests or more: a short one
    would mostly wait for builds it does not use."""
    # every op, built or not: one found in the cache may still be rebuilt on load (torch hashes the sources'
    # paths, and another virtual environment's DeepSpeed has other paths); a built one loads in seconds
    code = "from deepspeed.ops import op_builder as b\n" + "".join(
        f"if b.{builder}().is_compatible(False): b.{builder}().load(verbose=False)\n"
        for builder in BACKGROUND_OPS.values())
    log = Path(tempfile.gettempdir()) / f"zerotrain-prebuild-{os.getuid()}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", code], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    missing = [op for op in BACKGROUND_OPS if not offload.is_built(op)]
    if missing:
        print(f"conftest: building {', '.join(missing)} in the background (log: {log})", file=sys.stderr)
    return proc


TRAIN_MODULE = "zerotrain.launcher.train"


def launch(launcher: str, args: list[str], nproc: int = 2, timeout: int = 600, env_extra=None, module: bool = False,
           cwd=REPO):
    """Run the driver under `deepspeed`, `torchrun` or plain `python`: as the script launcher/train.py,
    or with module=True as the module zerotrain.launcher.train (the form a wheel install uses)."""
    entry = (["--module", TRAIN_MODULE] if launcher == "deepspeed" else ["-m", TRAIN_MODULE]) if module else [str(TRAIN_PY)]
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), *entry]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), *entry]
    elif launcher == "python":
        cmd = [sys.executable, *entry]
    else:
        raise ValueError(launcher)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def read_metrics(run_dir: Path) -> list[dict]:
    """The effective per-step history (a resume appends; see launcher/components/observe/metrics.py)."""
    from zerotrain.launcher.components.observe.metrics import read_metrics as effective

    return effective(run_dir)


def write_few_documents_mix(root: Path) -> Path:
    """Three sources a new user brings: one huge .txt document (no blank lines), a jsonl of three
    documents and a parquet table. Neither of the first two can be split across 2 ranks whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    lines = synthetic_docs(6000, seed=3, min_words=3, max_words=12)
    (root / "one.txt").write_text("\n".join(lines) + "\n")  # ~300 KB, one document by paragraphs
    with open(root / "few.jsonl", "w") as f:
        for doc in synthetic_docs(3, seed=4, min_words=2000, max_words=3000):
            f.write(json.dumps({"text": doc}) + "\n")
    pq.write_table(pa.table({"text": synthetic_docs(300, seed=5)}), root / "table.parquet")
    mix = root / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "one", "path": "one.txt", "weight": 0.5},
        {"name": "few", "path": "few.jsonl", "weight": 0.3},
        {"name": "table", "path": "table.parquet", "weight": 0.2}]}))
    return mix


@pytest.fixture(scope="session")
def few_docs_mix(tmp_path_factory) -> Path:
    return write_few_documents_mix(tmp_path_factory.mktemp("fewdocs"))


def cpu_profile(tmp_path: Path, stage: int | None = None, workers: int | None = None) -> str:
    """The cpu profile with another ZeRO stage and/or data-loader worker count, as a JSON path."""
    p = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    if stage is not None:
        p["zero_optimization"]["stage"] = stage
    if workers is not None:
        p["zerotrain"]["dataloader"] = {"workers": workers}
    path = tmp_path / f"cpu-zero{stage}-w{workers}.json"
    path.write_text(json.dumps(p))
    return str(path)


@pytest.fixture
def launched():
    """Launches a test started in a process group of its own, as (Popen, master port): at the end nothing
    of them is left (the group continued, so stopped ranks die too, and killed) and the shared-memory
    buffers their killed ranks could not remove are removed: DeepSpeed's, named by the master port, so
    only ours, never those of a launch running beside the test."""
    procs: list[tuple[subprocess.Popen, int]] = []
    yield procs
    for proc, port in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        for leaked in allreduce_buffer_files(port):
            leaked.unlink(missing_ok=True)
