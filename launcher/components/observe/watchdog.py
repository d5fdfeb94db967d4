"""The hang watchdog: a daemon thread on every rank that turns "stuck forever" into exit code 11 with stacks.

A rank blocked in a collective its peers never join, in a save, in an evaluation or in a driver call
sits at 0% until someone looks; DeepSpeed's launcher restarts nothing and gloo's own timeout only
raises, without saying where anyone was. The trainer moves a PhaseClock (components/observe/phases.py); this
thread only reads it (`now_state()`: step, phase, seconds in that phase), so the step loop pays
nothing: no collective, no I/O, no lock on the main thread.

    RUN_DIR/hangs/heartbeat/rank-<r>.json   every `beat_s` (at most 5 s): step, phase, seconds in the
                                           phase, wall time, host, pid and the launch's id
    RUN_DIR/hangs/<UTC time>-step<S>/      when a rank fires: rank-<r>.txt (every thread's Python stack,
                                           faulthandler) and rank-<r>.where.json (in a collective or
                                           not, and where) from each rank that could dump, and
                                           summary.json (who fired, where, which ranks are behind)

When the current phase has lasted longer than the timeout (`timeout_for`), the thread fires: it
claims the hang for the launch (hangs/heartbeat/claim-<launch>.json, created with a hard link: the
first rank wins and names the directory after its clock and step; the ranks cannot derive one name
alone, their steps differ by one around a collective and their clocks by more), dumps its stacks,
waits a few heartbeats for the ranks that are still alive to add theirs, records the end "hung" in
manifest.json (this rank, whichever it is: rank 0 may be the frozen one), leaves exit code 11 in
ZEROTRAIN_EXIT_FILE for `zerotrain launch`, prints one line, writes summary.json last and
`os._exit(11)`s. The other ranks' threads see the claim at their next tick and join: they dump into
the same directory, wait for the summary (a launcher ends every rank once one exits) and exit 11 too,
so one hang gives one directory with every live rank's stacks. A frozen
rank (SIGSTOP, a dead node) cannot dump: its heartbeat goes stale, and the summary names it.

The thread fires while the main thread is blocked inside a C++ collective (gloo and NCCL release the
GIL while they wait), which is what tests/test_watchdog.py does. The timeout (`--hang-timeout`, or
the profile's `zerotrain.hang_timeout`): 0 switches the watchdog off; unset, the larger of 600 s and
5x the slowest stay in any phase so far, so a legitimately long save or evaluation raises it; start-up
(building the engine, resuming) gets at least 30 minutes whatever the setting. Docs: docs/hangs.md.
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from zerotrain import durable, torch_private
from zerotrain.launcher.components import manifest
from zerotrain.launcher.components.observe.phases import PHASES
from zerotrain.launcher.ends import EXIT_HUNG
from zerotrain.launcher.errors import StopRun
from zerotrain.launcher.rank_ends import report_exit

HANGS = "hangs"
DEFAULT_FLOOR_S = 600.0  # the default timeout is never shorter than this
SLOWEST_MULTIPLE = 5.0  # ... nor than this many times the slowest stay in a phase seen so far
START_TIMEOUT_S = 1800.0  # the "start" phase (engine build, resume, universal conversion) gets at least this
BEAT_MAX_S = 5.0  # heartbeat period: min(5 s, timeout / 4)
STALE_BEATS = 3  # a heartbeat older than this many periods is stale: that rank's process is not running
TICK_S = 1.0  # how often the thread looks at the clock


def timeout_for(phase: str, given: float | None, longest: dict[str, float], first_step: bool = False) -> float:
    """Seconds this rank may stay in `phase` before it counts as hung. `given`: --hang-timeout (or the
    profile's), None for the default; `longest`: PhaseClock.longest (the slowest single stay per phase);
    `first_step`: no step of this launch has finished yet (its compute compiles: flex on a GPU, --compile,
    Muon's Newton-Schulz), which gets the start-up's grace too."""
    if first_step or (phase == "start" and not started(longest)):
        return max(given or 0.0, START_TIMEOUT_S)
    if given:
        return float(given)
    slowest = max((s for p, s in longest.items() if p != "start"), default=0.0)
    return max(DEFAULT_FLOOR_S, SLOWEST_MULTIPLE * slowest)


def started(longest: dict[str, float]) -> bool:
    """Has the loop begun (a measured phase has ended)? Before, "start" is the start-up (engine, resume);
    after, it is the time between the measured phases (PhaseClock's outermost phase)."""
    return any(p != "start" for p in longest)


def phase_words(phase: str, longest: dict[str, float]) -> str:
    if phase == "start" and started(longest):
        return "between the measured phases"
    return PHASES.get(phase, phase)


def describe(given: float | None) -> str:
    """The start-up line."""
    if given == 0:
        return "watchdog: off (--hang-timeout 0)"
    rule = (f"{given:g} s" if given else
            f"the larger of {DEFAULT_FLOOR_S:.0f} s and {SLOWEST_MULTIPLE:g}x the slowest phase so far")
    return (f"watchdog: a rank with no progress for {rule} (start-up and the first step:"
            f" {max(given or 0, START_TIMEOUT_S):.0f} s)"
            f" dumps its stacks to RUN_DIR/{HANGS}/ and exits {EXIT_HUNG} (hung); --hang-timeout to change")


def beat_period(given: float | None) -> float:
    return min(BEAT_MAX_S, max(0.5, (given or DEFAULT_FLOOR_S) / 4))


def read_heartbeats(heartbeat_dir: Path, launch: str) -> dict[int, dict]:
    """{rank: its last heartbeat} of this launch (older launches' files, and torn reads, are left out)."""
    beats = {}
    for path in Path(heartbeat_dir).glob("rank-*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(beat, dict) and beat.get("launch") == launch and isinstance(beat.get("rank"), int):
            beats[beat["rank"]] = beat
    return beats


def behind(step: int, beats: dict[int, dict], me: int, now: float, stale_s: float) -> list[dict]:
    """The other ranks that are behind this one (at `step`): a lower step, or a heartbeat older than
    `stale_s` (the process is not running: stopped, swapped out, or its node is gone)."""
    out = []
    for rank, beat in sorted(beats.items()):
        if rank == me:
            continue
        age = now - float(beat.get("time", 0.0))
        why = [w for w, hit in (("lower step", beat.get("step", 0) < step), ("stale heartbeat", age > stale_s)) if hit]
        if why:
            out.append({"rank": rank, "step": beat.get("step"), "phase": beat.get("phase"),
                        "heartbeat_age_s": round(age, 1), "why": ", ".join(why), "host": beat.get("host"),
                        "pid": beat.get("pid")})
    return out


def outside(where: dict[int, dict]) -> list[int]:
    """The ranks whose main thread is not in a collective while another rank's is: the likely culprits."""
    if not any(w.get("in_collective") for w in where.values()):
        return []
    return sorted(r for r, w in where.items() if not w.get("in_collective"))


def launch_id(dist) -> str:
    """One name for this launch on every rank (rank 0's start time and pid): a collective, at start-up only."""
    mine = [f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"]
    dist.broadcast_object_list(mine, src=0)
    return mine[0]


def _write_beat(path: Path, beat: dict) -> None:
    # Not zerotrain.durable: a heartbeat is read only while its run is alive, is rewritten every few
    # seconds, and one lost to a crash is worth nothing; an fsync every few seconds from every rank of a
    # big job on a network file system is. The rename keeps readers from seeing half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(beat) + "\n")
    os.replace(tmp, path)


def in_collective(filename: str, lineno: int, name: str) -> bool:
    """Is this frame a wait for other ranks? torch.distributed's calls and DeepSpeed's comm wrappers; ZeRO-3
    launches its parameter all-gathers asynchronously and waits in its handles' wait() (DeepSpeed 0.19
    runtime/zero/partition_parameters.py AllGatherHandle / AllGatherCoalescedHandle)."""
    return ("/torch/distributed/" in filename or "/deepspeed/comm/" in filename
            or ("/deepspeed/runtime/zero/" in filename and name == "wait"))


def main_thread_where() -> dict:
    """Where this process's main thread is: inside a torch.distributed collective or not, its innermost
    frame, and the innermost frame of our own code. Of ranks stuck at one step in one phase, the one NOT
    waiting in a collective is usually the one the others wait for (a CUDA/NCCL job waits in a device sync
    instead, so there every rank may say False)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None and len(frames) < 200:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back

    def where(f):
        return f"{Path(f[0]).name}:{f[1]} in {f[2]}"

    ours = next((f for f in frames if f[0].startswith(str(manifest.SOURCE_ROOT)) and "site-packages" not in f[0]),
                None)
    return {"in_collective": any(in_collective(*f) for f in frames),
            "innermost": where(frames[0]) if frames else None, "ours": where(ours) if ours else None}


_RUNNING: set["Watchdog"] = set()


def dump_flight_recorder(path: Path) -> bool:
    """torch's flight recorder of this process's collectives (NCCL's, with TORCH_NCCL_TRACE_BUFFER_SIZE set, as
    the GPU profiles do: the last collectives each process group issued, which one is still pending, and on
    which stream), as JSON in `path`: on NCCL a stuck collective shows only at the next host sync, so the phase
    the watchdog names can mislead and the recorder says where each rank really is. Through torch's own dump
    (zerotrain/torch_private.py flight_recorder_json, what torch's watchdog writes on a timeout); False, with
    nothing written, where this torch has none or it fails."""
    try:
        trace = torch_private.flight_recorder_json()  # imports torch's C extension: only when a hang is reported
    except Exception:  # noqa: BLE001 - a hang report never fails for want of the recorder
        return False
    path.write_bytes(trace)
    return True


def stop_all() -> None:
    """Stop every watchdog of this process (a Trainer that failed to build leaves none behind: a notebook lives on)."""
    for dog in list(_RUNNING):
        dog.stop()


class Watchdog:
    """One rank's watchdog thread. `given`: the timeout asked for (None: the default rule; 0 is not
    started). `exit_fn`: os._exit in a launched rank; a notebook passes something gentler."""

    def __init__(self, clock, run_dir: Path, rank: int, world: int, launch: str, given: float | None, *,
                 exit_fn=os._exit, now=time.time, tick_s: float = TICK_S):
        self.clock, self.rank, self.world, self.launch, self.given = clock, rank, world, launch, given
        self.run_dir = Path(run_dir)
        self.hangs = self.run_dir / HANGS
        self.beat_dir = self.hangs / "heartbeat"
        self.beat_path = self.beat_dir / f"rank-{rank}.json"
        self.claim_path = self.beat_dir / f"claim-{launch}.json"
        self.beat_s = beat_period(given)
        self.stale_s = STALE_BEATS * self.beat_s
        self.exit_fn, self.now, self.tick_s = exit_fn, now, tick_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self.fired = threading.Event()  # set once this thread has begun to fire or join: the process is ending
        self._thread: threading.Thread | None = None
        self._last_beat = float("-inf")

    # -- life -------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self.beat_dir.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._run, name="zerotrain-watchdog", daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        return self

    def stop(self) -> None:
        """End the thread. If it is firing, wait for it: it ends the process (a main thread woken by a
        broken collective must not exit first, with a traceback and another code)."""
        _RUNNING.discard(self)
        if self._thread is None:
            return
        if self.fired.is_set():
            self._thread.join()
        self._stop.set()
        self._thread.join(timeout=10)
        self._thread = None
        self.beat_path.unlink(missing_ok=True)  # a finished rank leaves no heartbeat to go stale

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001  (a watchdog that dies silently is worse than none)
                if not self.fired.is_set():
                    continue  # a heartbeat that could not be written: keep watching
                print(f"zerotrain: error: rank {self.rank} hung; its report could not be written: {e}",
                      file=sys.stderr, flush=True)
                self._exit()
            if self.fired.is_set():
                return

    # -- one tick ---------------------------------------------------------------------------------
    def state(self) -> dict:
        step, phase, in_phase = self.clock.now_state()
        return {"rank": self.rank, "step": step, "phase": phase, "in_phase_s": round(in_phase, 3),
                "time": self.now(), "host": self.host, "pid": self.pid, "launch": self.launch}

    def beat(self, state: dict | None = None) -> None:
        state = state or self.state()
        try:
            _write_beat(self.beat_path, state)
        except OSError:
            pass  # a full or vanished disk: the hang check itself needs no file
        self._last_beat = state["time"]

    def check(self) -> None:
        """What the thread does each tick: a heartbeat when due; join a hang another rank claimed;
        fire when this rank's phase has outlasted its timeout."""
        state = self.state()
        if state["time"] - self._last_beat >= self.beat_s:
            self.beat(state)
        timeout = self.timeout(state)
        if self.claim_path.exists() or state["in_phase_s"] > timeout:  # another rank's hang, or ours
            self.fire(state, timeout)

    def timeout(self, state: dict) -> float:
        return timeout_for(state["phase"], self.given, self.clock.longest.copy(),  # copy(): one C call, atomic
                           first_step=self.clock.steps_done == 0)

    # -- firing -----------------------------------------------------------------------------------
    def _claim(self, state: dict) -> dict:
        """The launch's hang: ours if no rank claimed it yet (a hard link: atomic, content in place)."""
        mine = {"dir": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(state["time"])) + f"-step{state['step']}",
                "rank": self.rank, "step": state["step"], "phase": state["phase"], "time": state["time"]}
        tmp = self.claim_path.with_name(f".{self.claim_path.name}.{self.pid}")
        tmp.write_text(json.dumps(mine))
        try:
            os.link(tmp, self.claim_path)
            return mine
        except FileExistsError:
            return json.loads(self.claim_path.read_text())
        finally:
            tmp.unlink(missing_ok=True)

    def fire(self, state: dict, timeout: float) -> None:
        self.fired.set()
        self.beat(state)
        claim = self._claim(state)
        hang_dir = self.hangs / claim["dir"]
        hang_dir.mkdir(parents=True, exist_ok=True)
        stacks = hang_dir / f"rank-{self.rank}.txt"
        with open(stacks, "w") as f:
            f.write(f"rank {self.rank} (host {self.host}, pid {self.pid}): step {state['step']}, phase"
                    f" {state['phase']} for {state['in_phase_s']:.1f} s (timeout {timeout:.0f} s)"
                    + (f"; joined the hang rank {claim['rank']} reported\n" if claim["rank"] != self.rank else "\n"))
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        _write_beat(hang_dir / f"rank-{self.rank}.where.json", {"rank": self.rank, **main_thread_where()})
        dump_flight_recorder(hang_dir / f"rank-{self.rank}.flight_recorder.json")
        summary_path = hang_dir / "summary.json"
        if claim["rank"] != self.rank:
            # Another rank fired: it writes the manifest, the line and, last, the summary. Leave only after
            # that: a launcher ends every rank as soon as one exits, the rank that fired included.
            deadline = time.monotonic() + 2 * self.beat_s + 10
            while not summary_path.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            self._exit()
            return
        beats = self._wait_for_stacks(hang_dir)
        late = behind(state["step"], beats, self.rank, self.now(), self.stale_s)
        where = {}
        for path in hang_dir.glob("rank-*.where.json"):
            try:
                record = json.loads(path.read_text())
                where[record["rank"]] = record
            except (OSError, ValueError, KeyError):
                continue
        message = self._message(state, late, hang_dir, where)
        summary = {"fired_by": self.rank, "step": state["step"], "phase": state["phase"],
                   "phase_means": phase_words(state["phase"], self.clock.longest.copy()),
                   "in_phase_s": round(state["in_phase_s"], 1),
                   "timeout_s": timeout, "time": manifest.now_iso(), "launch": self.launch, "world_size": self.world,
                   "behind": late,
                   "ranks": {str(r): {**beats[r], "heartbeat_age_s": round(self.now() - beats[r]["time"], 1)}
                             for r in sorted(beats)},
                   "no_heartbeat": [r for r in range(self.world) if r not in beats],
                   "stacks": sorted(p.name for p in hang_dir.glob("rank-*.txt")),
                   "where": {str(r): where[r] for r in sorted(where)},
                   "outside_collectives": outside(where), "message": message}
        # The end in the manifest (any rank's watchdog may write it: rank 0 may be the one frozen, and
        # it is stuck either way), the exit code and the line, then the summary: the other ranks exit
        # once it exists, and their exit ends this process too.
        self._record_end(message)
        report_exit(EXIT_HUNG)
        print(f"zerotrain: error: {message}", file=sys.stderr, flush=True)
        durable.write_json(summary_path, summary)
        self._exit()

    def _wait_for_stacks(self, hang_dir: Path) -> dict[int, dict]:
        """Give the ranks whose heartbeats are fresh a few heartbeats to join and dump; their heartbeats."""
        deadline = time.monotonic() + 2 * self.beat_s + 2
        while True:
            beats = read_heartbeats(self.beat_dir, self.launch)
            now = self.now()
            alive = [r for r, b in beats.items() if r != self.rank and now - b["time"] <= self.stale_s]
            if all((hang_dir / f"rank-{r}.where.json").exists() for r in alive) or time.monotonic() > deadline:
                return beats
            time.sleep(0.2)

    def _message(self, state: dict, late: list[dict], hang_dir: Path, where: dict | None = None) -> str:
        who = "; ".join(f"rank {b['rank']} (step {b['step']}, {b['phase']}, heartbeat {b['heartbeat_age_s']:.0f} s"
                        f" ago)" for b in late) or "none"
        odd = outside(where or {})
        odd = "; outside any collective: " + ", ".join(f"rank {r} ({where[r]['ours'] or where[r]['innermost']})"
                                                      for r in odd) if odd else ""
        return (f"rank {self.rank} hung in {state['phase']} at step {state['step']} for {state['in_phase_s']:.0f} s;"
                f" behind: {who}{odd}; stacks in {hang_dir}")

    def _record_end(self, message: str) -> None:
        try:
            manifest.record_end(self.run_dir, StopRun("hung", message), self.clock.now_state()[0], rank0_only=False)
        except OSError:
            pass  # the exit code still says it

    def _exit(self) -> None:
        report_exit(EXIT_HUNG)
        self.exit_fn(EXIT_HUNG)
