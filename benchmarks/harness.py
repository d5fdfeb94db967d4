"""What every side-by-side benchmark shares: statistics, the machine's description and load, and
the controller that runs compared programs as separate processes and alternates them.

Why separate processes, driven over a socket: each compared program (zerotrain's real driver, a
plain PyTorch loop, the Hugging Face Trainer with DeepSpeed, torchrun DDP) keeps its own DeepSpeed
globals and thread pool, is built once (its set-up timed on its own), and then runs only when told
to: the controller asks each in turn for a few optimizer steps ("a chunk"), so slow drifts of this
shared machine's load hit every program alike. The programs themselves are benchmarks/step_worker.py.

Protocol (JSON lines over a loopback TCP connection the worker opens to ZT_BENCH_CTRL=host:port):
worker -> {"hello": name, "setup": {...}}; controller -> {"cmd": "run", "steps": n, "count": bool}
-> worker {"step_s": [...], ...}; controller -> {"cmd": "quit"} -> worker {"bye": true}, after
which the controller kills the worker's process group (a launched 2-rank job included: the other
ranks are waiting in a collective and have nothing left to do).
"""
from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from zerotrain.launcher.components.launching.ports import free_port  # noqa: F401  (the benchmarks take it from here)

REPO = Path(__file__).resolve().parent.parent
TINY = os.environ.get("BENCH_TINY") == "1"  # the smoke test's sizes: seconds, not minutes


class MissingDependency(Exception):
    """A baseline's optional package is not installed; the message says what to install."""


def need(module: str, install: str):
    """Import an optional baseline's package or raise MissingDependency naming what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"needs `{module}`: pip install -e .[bench]  (or: pip install {install})") from None


def demo_mix() -> Path:
    """The demo's offline mix (launcher/commands/demo.py), built once under runs/demo-data/."""
    from zerotrain.launcher.commands.demo import build_demo_data

    return build_demo_data(REPO / "runs" / "demo-data")


_WORK: dict = {}  # one scratch directory per `run.py` invocation, removed at its end


def workdir() -> Path:
    import tempfile

    if "dir" not in _WORK:
        _WORK["dir"] = Path(tempfile.mkdtemp(prefix="zerotrain-bench-"))
    return _WORK["dir"]


def shards_dir(tokenizer: str = "bytes") -> Path:
    """The demo mix prepared into shards (once per invocation)."""
    from zerotrain.dataio.pipeline.prepare import prepare
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    out = workdir() / f"shards-{Path(tokenizer).name}"
    if not out.exists():
        prepare(str(demo_mix()), load_tokenizer(tokenizer), out, shard_tokens=2_000_000, log=lambda *a: None)
    return out


def bpe_dir() -> Path:
    """A byte-level BPE (vocabulary 8192) trained on the demo mix (once per invocation)."""
    out = workdir() / "bpe"
    if not out.exists():
        from zerotrain.dataio.pipeline.loader import load_data, open_data
        from zerotrain.dataio.sources.tokenizer import ByteTokenizer, train_bpe

        data = load_data(open_data(str(demo_mix()), ByteTokenizer()))
        texts = (s.text(d) for s in data.stores for d in range(len(s)))
        if TINY:  # the smoke test: a small corpus trains in a second
            import itertools

            texts = itertools.islice(texts, 300)
        train_bpe(texts, 8192, out)
    return out


# -- numbers ---------------------------------------------------------------------------------------

def median(xs) -> float:
    return statistics.median(xs)


def quantile(xs, q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread(xs) -> str:
    """The middle half of the samples (p25-p75), the figure printed next to every median."""
    return f"p25-p75 {quantile(xs, 0.25) * 1e3:,.0f}-{quantile(xs, 0.75) * 1e3:,.0f} ms"


def step_row(benchmark: str, setting: str, xs: list[float], tokens: int, extra: str = "") -> dict:
    """A table row for one program's step times (seconds): median ms per step with its spread, tokens/s at
    `tokens` per step, then `extra`."""
    m = median(xs)
    return {"benchmark": benchmark, "setting": setting, "target": "",
            "result": f"{m * 1e3:,.0f} ms/step ({spread(xs)}, n={len(xs)}), {tokens / m:,.0f} tokens/s{extra}"}


def load_average() -> float:
    return os.getloadavg()[0]


def machine() -> dict:
    """lscpu's model name, the cores, memory and the load, for the header of every table."""
    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), model)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "load": load_average(), "python": platform.python_version()}


def matmul_peak(threads: int, n: int = 2048, seconds: float = 2.0, dtype: str = "float32") -> float:
    """The machine's matmul FLOP/s in `dtype` with `threads` threads: the best of repeated n x n GEMMs
    (the best, not the median: a peak is what the hardware can do when nobody else runs)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if TINY:
            n, seconds = 512, 0.2
        a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
        torch.mm(a, b)  # warm-up: the first call picks kernels
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


# -- the controller ----------------------------------------------------------------------------------

def clean_shm(port: int | None) -> None:
    """DeepSpeed's CPU all-reduce leaves its shared-memory buffers (~66 MB a rank) in /dev/shm, named
    by the master port: remove those of a run of ours once it is over."""
    if port:
        for leaked in allreduce_buffer_files(port):
            leaked.unlink(missing_ok=True)


class WorkerError(Exception):
    """A compared program failed to start or died; the message is one line plus its log's tail."""


class Worker:
    """One compared program: a process (group) started from `cmd`, connected back to us."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, timeout: float = 600, connect: bool = True):
        """Spawn the program; with connect (default) also wait until it is ready (`connect()`)."""
        self.name, self.log_path, self.timeout = name, log, timeout
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.listener.settimeout(0.5)
        env = {**env, "ZT_BENCH_CTRL": f"127.0.0.1:{self.listener.getsockname()[1]}", "ZT_BENCH_NAME": name}
        if "--master_port" in cmd:  # a launcher's rendezvous port; a plain process gets one of its own
            self.port = int(cmd[cmd.index("--master_port") + 1])
        else:
            self.port = free_port()
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), **env}
        self.t_spawn = time.time()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.conn = None
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for the program's hello: it is built and waits for its first command."""
        deadline = time.time() + self.timeout
        try:
            while True:
                try:
                    conn, _ = self.listener.accept()
                    break
                except socket.timeout:
                    if self.proc.poll() is not None:
                        raise WorkerError(f"{self.name}: exited with {self.proc.returncode} before it was ready"
                                          f"{self.tail()}") from None
                    if time.time() > deadline:
                        self.kill()
                        raise WorkerError(f"{self.name}: not ready after {self.timeout:.0f}s{self.tail()}") from None
        finally:
            self.listener.close()
        conn.settimeout(None)
        self.conn, self.rfile = conn, conn.makefile("r")
        hello = self._recv()
        self.ready_s = time.time() - self.t_spawn  # spawn (the launcher's own start included) to ready
        self.setup = hello.get("setup", {})

    def tail(self, n: int = 1500) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace")[-n:] if self.log_path.is_file() else ""
        return "\n--- last lines of its log ---\n" + text if text else ""

    def _send(self, msg: dict) -> None:
        self.conn.sendall((json.dumps(msg) + "\n").encode())

    def _recv(self) -> dict:
        line = self.rfile.readline()
        if not line:
            self.proc.wait(timeout=30) if self.proc.poll() is None else None
            raise WorkerError(f"{self.name}: died (exit {self.proc.poll()}){self.tail()}")
        return json.loads(line)

    def run(self, steps: int, count: bool = False) -> dict:
        self.signal(signal.SIGCONT)
        self._send({"cmd": "run", "steps": steps, "count": count})
        return self._recv()

    def signal(self, sig: int) -> None:
        """To the program's every process (launcher, agent, ranks)."""
        for pid in descendants(self.proc.pid) + [self.proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def freeze(self) -> None:
        """Stop every process of the program until its next `run`. Only rank 0 waits for the
        controller between chunks: the other ranks of a 2-rank program would run on into their next
        forward and backward until a collective blocks them, inside the next program's timed chunk.
        Measured: ZeRO-2's second rank doing so made the ZeRO-3 program timed after it bimodal
        (p25-p75 2.3-3.5 s per step; 2.15 s when run alone)."""
        self.signal(signal.SIGSTOP)

    def kill(self) -> None:
        # Every descendant, not only the process group: torchrun's elastic agent starts its ranks in
        # sessions of their own, and a rank left behind would wait in a collective forever.
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        clean_shm(self.port)

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        try:
            if self.conn is not None:
                self._send({"cmd": "quit"})
                self._recv()
        except (OSError, WorkerError, ValueError):
            pass
        self.kill()


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process (from /proc), deepest first."""
    out = []
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return out
    for child in children:
        out.extend(descendants(child))
        out.append(child)
    return out


def python_cmd(*args) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "step_worker.py"), *args]


def launcher_cmd(launcher: str, ranks: int, *args) -> list[str]:
    """The same worker under the real launchers a user types: `deepspeed` or `torchrun`."""
    bindir = Path(sys.executable).parent
    script = str(REPO / "benchmarks" / "step_worker.py")
    if launcher == "deepspeed":
        return [str(bindir / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), script, *args]
    if launcher == "torchrun":
        return [str(bindir / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
                script, *args]
    if launcher == "python":
        return python_cmd(*args)
    raise ValueError(launcher)


def alternate(workers: list[Worker], warmup_steps: int, chunks: int, steps: int, say=None) -> dict[str, list[dict]]:
    """Warm-up (discarded), then `chunks` rounds in which every worker runs `steps` optimizer
    steps in turn (the order rotating each round), the others frozen (`Worker.freeze`). Returns
    {name: [chunk results]}."""
    for w in workers:
        w.run(warmup_steps)
        w.freeze()
    out = {w.name: [] for w in workers}
    for c in range(chunks):
        order = workers[c % len(workers):] + workers[:c % len(workers)]
        for w in order:
            r = w.run(steps)
            w.freeze()
            r["load"] = load_average()
            out[w.name].append(r)
        if say:
            say(f"  round {c + 1}/{chunks} done (load {load_average():.1f})")
    return out


def step_times(chunks: list[dict]) -> list[float]:
    return [s for c in chunks for s in c["step_s"]]
