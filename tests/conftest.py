"""Shared fixtures: small on-disk data and a way to run the real driver under each launcher."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

from zerotrain.launcher.components import startup_gc

# Each pytest process imports every test module's dependencies while it collects (transformers, datasets,
# DeepSpeed, torch): without the cyclic collector, as a rank starts (7.5 -> 5.4 CPU-s a process); back on once
# the tests are collected (pytest_collection_finish; the xdist controller, which collects nothing, at configure).
startup_gc.pause()

from zerotrain import durable  # noqa: E402
from zerotrain.launcher.components.ds_compat import allreduce_buffer_files  # noqa: E402
from zerotrain.launcher.components.launching.ports import DEFAULT_PORT  # noqa: E402
from zerotrain.launcher.components.launching.ports import free_port  # noqa: E402,F401  (the tests take it from here)
from helpers.build_ops import BACKGROUND_OPS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "launcher" / "train.py"
NO_DEBUG_INFO_CXX = REPO / "tests" / "helpers" / "g++-no-debug-info"
BUILD_OPS = REPO / "tests" / "helpers" / "build_ops.py"  # the ops the suite loads, built by one process
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
        # inductor compiles in this process and each rank's, not in a pool of compile workers per process (one
        # per core: each imports torch): on 2 cores shared by the workers' ranks a pool only adds start-ups
        # (test_gpu_speed.py with an empty cache: 92 -> 86 CPU-s). The kernels are the same.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        # DeepSpeed's ops JIT-built without debug info (tests/helpers/g++-no-debug-info: the same code): a fresh
        # clone builds five ops, ~630 CPU-s with it, ~445 without. Set here, before the first build, so
        # every build and every rank of the session sees the same compiler command (ninja rebuilds on a change);
        # a host's own CXX is kept.
        os.environ.setdefault("CXX", str(NO_DEBUG_INFO_CXX))
    sys.addaudithook(_audit)
    if getattr(config.option, "numprocesses", None) and not WORKER:
        hold_default_port()
        startup_gc.resume()  # the controller: its workers collect


# -- `make test` runs pytest-xdist workers (-n 2 --dist loadfile: a file's tests, and its module fixtures, on
# one worker). Two launches at once must not share what one launch owns: the rendezvous port (held below), the
# op builds (one build, under a lock), /dev/shm (DeepSpeed's buffers are named by the port) and tmp_path (per worker)
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...; None in a serial run and in the controller
_held_port: list = []


def hold_default_port() -> None:
    """A `zerotrain launch -n N` without a port rendezvous on 29500 when it is free: two workers' launches would
    both take it at once, and one would die with EADDRINUSE. The controller listens on 29500 for the session (if
    something else holds it, it is busy all the same), so that every such launch takes a free port of its own and
    says which: the two-jobs path (launching.ports.rendezvous_port), which test_two_jobs.py tests."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a TIME_WAIT a launch that just ended left
    try:
        s.bind(("", DEFAULT_PORT))
        s.listen()
        _held_port.append(s)
    except OSError:
        s.close()


# -- the `launches` marker: `make test-fast` (-m "not launches") runs every test that starts no process ------------
LAUNCHERS = {"deepspeed", "torchrun", "accelerate", "zerotrain", "jupyter"}
WRAPPERS = {"nice", "env", "timeout", "setsid", "sh", "bash", "stdbuf"}  # commands that start the command after them
SPAWN_EVENTS = ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system")
unmarked_launches: list[str] = []  # what the running test (unmarked) started; checked after its setup and its call
_watching = False


def starts_a_launch(argv) -> bool:
    """A command line that starts Python or one of our launchers: its command, or a wrapper's (`nice -n 10
    python ...`, `bash -c "deepspeed ..."`). Other commands (git, sleep, gcc) are cheap and are not launches."""
    words = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
    names = [Path(token).name for w in words for token in os.fsdecode(w).split()]
    launch = [name.startswith("python") or name in LAUNCHERS for name in names]
    return bool(names) and (launch[0] or (names[0] in WRAPPERS and any(launch)))


def _audit(event: str, args: tuple) -> None:
    """Python's audit hook (no process is started without one of SPAWN_EVENTS): records a launch started
    while an unmarked test runs. Never raises: a test's own error handling stays as it is."""
    if _watching and event in SPAWN_EVENTS:
        argv = args[0] if event == "os.system" else args[1]
        if argv is not None and starts_a_launch(argv):
            unmarked_launches.append(" ".join(map(os.fsdecode, [argv] if isinstance(argv, (str, bytes)) else argv)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _check_no_launch(item, "its set-up (a fixture)"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _check_no_launch(item, "it"))


def _check_no_launch(item, who: str):
    """A test without the `launches` marker that starts a launch (itself or through a fixture) fails, naming
    the command, so that `make test-fast` stays the tier that starts no process."""
    global _watching
    if item.get_closest_marker("launches") is not None:
        return (yield)
    unmarked_launches.clear()
    _watching = True
    try:
        result = yield
    finally:
        _watching = False
    if unmarked_launches:
        started, _ = unmarked_launches[0], unmarked_launches.clear()
        pytest.fail(f"{item.nodeid}: {who} started a process ({started[:200]}) but the test is not marked"
                    " @pytest.mark.launches (make test-fast runs the unmarked ones)", pytrace=False)
    return result


def build_shm_op() -> None:
    """Every CPU launch loads DeepSpeed's JIT-built shared-memory op (deepspeed_shm_comm). Loaded here, once, in one
    process, before any test launches ranks: two ranks of the first launch would otherwise build it concurrently
    under whatever timeout that test has, and a build killed there (a timeout, a test's kill -9) leaves torch's
    extension lock, on which every later launch of the session waits until its own timeout. Loaded even where a
    build is cached: torch rebuilds one made by another virtual environment's DeepSpeed (its include paths are
    part of the build's hash: a fresh clone's first launches would each wait on that build); a current one loads in
    seconds. A lock already stale (older than any build takes: a killed build of an earlier session) is removed
    first, and said. Called once the tests are collected, only where one of them launches (`make test-fast` builds
    nothing)."""
    from zerotrain.launcher.offload import ops as offload
    for lock in offload.stale_build_locks():
        print(f"conftest: removing {lock}, a build lock left by a killed build", file=sys.stderr)
        lock.unlink(missing_ok=True)
    built = subprocess.run([sys.executable, str(BUILD_OPS), "shm"], capture_output=True, text=True, timeout=1800)
    if built.returncode != 0:
        pytest.exit("conftest: DeepSpeed's deepspeed_shm_comm op did not build, so no CPU launch can run:\n"
                    + built.stdout[-2000:] + built.stderr[-2000:], returncode=3)


PREBUILD_MIN_TESTS = 100  # a session this large runs long enough to gain from building the ops beside it
_prebuild: list[subprocess.Popen] = []


# The files that take longest, longest first (per-file seconds of a full run, 2026-11-28): under
# `--dist loadfile` a worker takes the next file when it runs dry, so a long file taken last leaves the other
# workers idle until it ends; longest-first keeps them busy to the end. One exception: the files that load the ops
# prebuild_in_background builds (test_eval_tasks, test_optimizers, test_offload_runs: CPU Adam, CPU Lion, async I/O)
# come after about ten minutes of other files, by which time that build is done. First in the list,
# test_offload_runs held its worker waiting on the build (672 s of a fresh clone's run, 2026-11-27, against 258 s
# with the ops built); ninth, it still waited once three workers shared the CPU with the build (442 s against 319 s,
# 2026-11-28). An ordering hint only (a file not listed runs after these, in collection order; a stale entry costs
# time, never a result).
LONGEST_FIRST = ("test_sequence_parallel", "test_long_runs", "test_restarts", "test_preflight",
                 "test_launch_surfaces", "test_workstation_recipes", "test_resume_exact", "test_universal",
                 "test_eval_tasks", "test_benchmarks", "test_bf16", "test_optimizers", "test_offload_runs",
                 "test_readme_walkthrough", "test_watchdog", "test_few_documents",
                 "test_hub_names", "test_attention", "test_gpu_speed", "test_sequence_parallel_surfaces",
                 "test_world_size_change", "test_packaging", "test_train_integration", "test_zero3_export",
                 "test_data_bad_input", "test_finetune", "test_health", "test_planner", "test_run_tokens",
                 "test_two_jobs", "test_notebook", "test_evaluate", "test_observability", "test_checkpointer",
                 "test_data_sft", "test_chunked_loss", "test_init_from_tokenizer", "test_data_local_hub",
                 "test_recipes")


def pytest_collection_modifyitems(config, items):
    """The files in LONGEST_FIRST's order, each file's tests in their own (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_collection_finish(session):
    """The ops CPU launches load, built before the first test where any test of the session launches (the GPU
    tier, `make test-gpu`, has no CPU launch)."""
    startup_gc.resume()  # collected: the collector back on for the tests (see the top of this file)
    if (os.environ.get("CUDA_VISIBLE_DEVICES") != "" or session.config.option.collectonly
            or not any(item.get_closest_marker("launches") for item in session.items)):
        return
    # under xdist each worker collects the session: the first loads (or builds) while the others wait, then find
    # this session's mark; only one prebuilds
    run = getattr(session.config, "workerinput", {}).get("testrunuid") or str(os.getpid())
    mark = Path(tempfile.gettempdir()) / f"zerotrain-test-ops-{os.getuid()}.loaded"
    with FileLock(Path(tempfile.gettempdir()) / f"zerotrain-test-ops-{os.getuid()}.lock"):
        if not mark.is_file() or mark.read_text() != f"{run} {sys.executable}":
            build_shm_op()
            mark.write_text(f"{run} {sys.executable}")
    if len(session.items) >= PREBUILD_MIN_TESTS and WORKER in (None, "gw0"):
        from zerotrain.launcher.offload import ops as offload
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
    async I/O for NVMe: ~50 s, ~50 s and ~3.5 min of CPU) are built by one process started now, beside the tests (a run
    with its ops built leaves about a fifth of 2 cores idle: rank start-ups, waits for a kill or a slowed step).
    Not niced: at nice 10 beside busy workers it gets a tenth of the CPU, and the first file that needs an op
    waits on it. A test that needs an op before it is done waits on torch's build lock, as it would on its own
    build (LONGEST_FIRST puts those files later). The process has a session of its own, so a killed pytest never
    kills it mid-build (which would leave the lock every later load waits on); the session's end waits for it
    (pytest_sessionfinish). Only for a session of PREBUILD_MIN_TESTS tests or more: a short one
    would mostly wait for builds it does not use."""
    # every op, built or not: one found in the cache may still be rebuilt on load (torch hashes the sources'
    # paths, and another virtual environment's DeepSpeed has other paths); a built one loads in seconds
    log = Path(tempfile.gettempdir()) / f"zerotrain-prebuild-{os.getuid()}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(BUILD_OPS), "background"], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    missing = [op for op in BACKGROUND_OPS if not offload.is_built(op)]
    if missing:
        print(f"conftest: building {', '.join(missing)} in the background (log: {log})", file=sys.stderr)
    return proc


TRAIN_MODULE = "zerotrain.launcher.train"


def launch(launcher: str, args: list[str], nproc: int = 2, timeout: int = 600, env_extra=None, module: bool = False,
           cwd=REPO, port: int | None = None):
    """Run the driver under `deepspeed`, `torchrun` or plain `python`: as the script launcher/train.py,
    or with module=True as the module zerotrain.launcher.train (the form a wheel install uses). `port`: the
    rendezvous port (default: a free one), for a test that removes what the launch leaves under that port."""
    entry = (["--module", TRAIN_MODULE] if launcher == "deepspeed" else ["-m", TRAIN_MODULE]) if module else [str(TRAIN_PY)]
    port = port or free_port()
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), *entry]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port), *entry]
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


class Launched(list):
    """What the `launched` fixture yields: (Popen, master port) pairs, each Popen the leader of a session of its
    own (start_new_session=True), so that its whole job can be killed by the session's process group."""

    def append(self, item: tuple[subprocess.Popen, int]) -> None:
        proc = item[0]
        if proc.poll() is None and os.getpgid(proc.pid) != proc.pid:
            proc.kill()
            raise ValueError(f"launched: {proc.args!r} was not started with start_new_session=True: its ranks"
                             " could not be killed with it")
        super().append(item)


def group_members(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group `pgid`, from /proc (Linux)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # ended while read
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(stat.parent.name))
    return members


def end_launched(procs: list[tuple[subprocess.Popen, int]], timeout: float = 30.0) -> None:
    """Kill each launch's whole process group (continued first, so that stopped ranks die too), reap the
    launch, wait until no process of the group is left, and remove the shared-memory buffers its killed ranks
    could not remove: DeepSpeed's, named by the master port, so only ours, never those of a launch beside it.
    A process still alive after `timeout` is an error of the test run, named."""
    left = []
    for proc, port in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass  # the group is empty: every process of the job has ended
        proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while (members := group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILL is delivered, not yet acted on
        left += members
        for leaked in allreduce_buffer_files(port):
            leaked.unlink(missing_ok=True)
    if left:
        raise RuntimeError(f"launched: processes {left} outlived SIGKILL to their process group")


@pytest.fixture
def launched():
    """Launches a test started in a session of its own (start_new_session=True), as (Popen, master port): at
    the end nothing of them is left (end_launched), whatever the launcher's own watch did."""
    procs = Launched()
    yield procs
    end_launched(procs)


# -- one uninterrupted run, shared --------------------------------------------------------------------------------
# The run that test_long_runs.py (SIGTERM, kill -9), test_restarts.py (a killed, then a frozen rank) and
# test_watchdog.py (a rank blocked in a save, then in an evaluation) interrupt, with their own extra flags (saves,
# rotation, a mirror, --hang-timeout, test hooks), none of which changes the training: each must log this run's
# token digests and losses (and validation losses) bit for bit.
REFERENCE_STEPS = 16
REFERENCE_FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2",
                   "--log-data-every-steps", "0", "--eval-tokens", "3000", "--max-steps", str(REFERENCE_STEPS)]


@pytest.fixture(scope="session")
def reference_history(tmp_path_factory) -> list[dict]:
    """The per-step history of one uninterrupted 2-rank run of REFERENCE_FLAGS, evaluated every 2 steps (an evaluation
    changes nothing in the training: a run without one has the same losses), on write_mix's data. Under xdist the
    first worker to ask runs it and the other reads it (a file lock in the directory the workers share)."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if WORKER else root) / "reference-run"
    history = root / "history.json"
    with FileLock(f"{root}.lock"):
        if not history.is_file():
            mix = write_mix(root / "data")
            proc = launch("deepspeed", ["--data", str(mix), "--out", str(root), "--run-id", "r", *REFERENCE_FLAGS,
                                        "--eval-every-steps", "2"])
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            durable.write_json(history, read_metrics(root / "r"))
    return json.loads(history.read_text())
