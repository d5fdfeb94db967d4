"""Stop policies the training loop consults at every step boundary: signals, loss spikes,
budgets and early stopping (non-finite values are the Trainer's own check, on the step's agreed loss).

Everything here is plain Python with no process group: the Trainer does the collectives
(all-reduced loss, the OR of every rank's signal flag, rank 0's clock broadcast) and hands these
objects values that every rank already agrees on, so every rank reaches the same decision at the
same step. What must survive a resume has `state_dict()` / `load_state_dict()` (JSON-safe: it
travels in DeepSpeed's `client_state`). The step's participants (components/participants/) turn a
decision to stop into a `StopRun(kind, message)`; the kind's exit code is in the table of
`zerotrain.launcher.errors`.
"""
from __future__ import annotations

import math
import os
import signal
import statistics
import threading
import time
from collections import deque

from zerotrain.launcher.ends import EXIT_SIGNAL_HARD
from zerotrain.launcher.errors import UsageError


# -- signals --------------------------------------------------------------------------------
class SignalStop:
    """SIGTERM / SIGINT ask the run to stop at the next step boundary, after saving.

    The first signal sets `requested` (the signal's name, e.g. "SIGTERM"); the loop reads it at
    each step boundary (the Trainer ORs it across ranks). A later signal exits at once with
    `os._exit(EXIT_SIGNAL_HARD)` (130) after one line on stderr: nothing is saved, the last
    complete checkpoint stays the resume point. With `hard_exit=False` (a notebook, where
    `os._exit` would kill the kernel) the later signal raises KeyboardInterrupt instead.

    Signals arriving within `grace_s` of the first count as the same request: one preemption
    often reaches a rank twice within milliseconds (Ctrl-C goes to the whole foreground process
    group and DeepSpeed's launcher then also sends SIGTERM to its children; Slurm signals every
    process of the step, launcher included, which forwards it again). Without the grace window
    that duplicate would be taken as "exit at once" and no checkpoint would be written.

    Python runs signal handlers in the main thread between bytecodes, so a rank blocked inside a
    C call (a collective waiting for a dead peer) reacts only when that call returns; DeepSpeed's
    launcher kills its children 30 s after forwarding a signal, and `kill -9` always works.

    `install()` in a thread other than the main one does nothing (Python allows handlers only
    there) and leaves `installed` False. `restore()` puts the previous handlers back, so a
    notebook can call `run()` again. Also a context manager.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float = 1.0, hard_exit: bool = True, announce: bool = True,
                 on_hard_exit=None):
        self.grace_s = grace_s
        self.hard_exit = hard_exit
        self.on_hard_exit = on_hard_exit  # called before a second signal's os._exit: the end recorded
        self.announce = announce  # one line on rank 0 when the first signal arrives
        self.requested: str | None = None
        self.installed = False
        self._first_at: float | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "SignalStop":
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.installed = True
        return self

    def restore(self) -> None:
        if not self.installed:
            return
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the best we can do
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False

    def __enter__(self) -> "SignalStop":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        # os.write, not print: a handler can interrupt a print of the main thread, and a second
        # write into the same buffered stream would raise "reentrant call".
        if self.requested is None:
            self.requested, self._first_at = name, now
            if self.announce and os.environ.get("RANK", "0") == "0":
                os.write(2, f"zerotrain: {name}: finishing this step, saving a checkpoint, then stopping"
                            f" (another signal exits at once without saving)\n".encode())
            return
        if now - self._first_at <= self.grace_s:
            return  # the same preemption delivered twice (see the class docstring)
        if not self.hard_exit:
            raise KeyboardInterrupt(f"second signal ({name}) after {self.requested}")
        os.write(2, f"zerotrain: rank {os.environ.get('RANK', '0')}: second signal ({name}) after {self.requested}:"
                    f" exiting now (exit {EXIT_SIGNAL_HARD}), nothing saved\n".encode())
        if self.on_hard_exit is not None:
            try:
                self.on_hard_exit(f"second signal ({name}) after {self.requested}: exited at once, nothing saved")
            except Exception:  # noqa: BLE001  (leaving now matters more than the record)
                pass
        os._exit(EXIT_SIGNAL_HARD)


# -- loss spikes ----------------------------------------------------------------------------
class SpikeDetector:
    """A loss spike: the loss above `factor` x the median of the last `window` accepted losses,
    for `consecutive` steps in a row.

    Accepted losses are finite and not above the threshold: spike steps never enter the window,
    so a long spike cannot raise its own baseline and hide itself. No step is judged before
    `min_history` losses are in the window (default window // 2): the first steps of a run fall
    fast and noisily, and a median over a handful of them is no baseline. While the loss falls
    it stays below its own recent median, so falling curves never alarm. A rise smaller than
    `min_increase` (in loss units, nats) is never a spike, so a run whose loss is near zero
    (memorising a small fine-tune set) does not alarm on noise that is large relative to it.
    A non-finite loss counts as above the threshold (the non-finite guard normally stops the
    run first).

    `update(loss)` returns True once per spike: at the step where the streak reaches
    `consecutive`; a streak that goes on is not reported again until a loss is accepted.
    Defaults: window 50, factor 2.0, consecutive 3 (a doubling of the loss that holds for three
    optimizer steps; single noisy batches and brief bumps that recover are not spikes).
    Feed it the all-reduced loss so that every rank decides the same.
    """

    def __init__(self, window: int = 50, factor: float = 2.0, consecutive: int = 3,
                 min_history: int | None = None, min_increase: float = 0.1):
        _positive_int("--spike-window", window)
        _positive_int("--spike-consecutive", consecutive)
        _positive_number("--spike-factor", factor)
        if factor <= 1:
            raise UsageError(f"--spike-factor: must be above 1 (a multiple of the recent median loss), got {factor}")
        self.window, self.factor, self.consecutive = window, float(factor), consecutive
        self.min_history = max(1, window // 2) if min_history is None else min_history
        if not 1 <= self.min_history <= window:
            raise UsageError(f"spike detector: min_history must be between 1 and the window {window},"
                             f" got {self.min_history}")
        self.min_increase = float(min_increase)
        self.history: deque[float] = deque(maxlen=window)
        self.streak = 0          # consecutive steps above the threshold, the current one included
        self.spikes = 0          # spikes reported so far in this run
        self.last_median: float | None = None
        self.last_loss: float | None = None

    def threshold(self) -> float | None:
        """The loss above which a step counts as a spike step, or None while history is short."""
        if len(self.history) < self.min_history:
            return None
        median = statistics.median(self.history)
        return max(self.factor * median, median + self.min_increase)

    def update(self, loss: float) -> bool:
        """Judge one step's loss; True when this step completes a spike (`consecutive` in a row)."""
        loss = float(loss)
        self.last_loss = loss
        self.last_median = statistics.median(self.history) if self.history else None
        limit = self.threshold()
        if limit is None:  # warm-up: collect a baseline, judge nothing
            if math.isfinite(loss):
                self.history.append(loss)
            return False
        if math.isfinite(loss) and loss <= limit:
            self.history.append(loss)
            self.streak = 0
            return False
        self.streak += 1
        if self.streak == self.consecutive:
            self.spikes += 1
            return True
        return False

    def explain(self) -> str:
        """The last decision in words, for the log line of a spike."""
        return (f"loss {self.last_loss:.4g} above {self.factor:g} x the median {self.last_median:.4g} of the last"
                f" {len(self.history)} steps for {self.streak} consecutive step(s)")

    def state_dict(self) -> dict:
        return {"history": list(self.history), "streak": self.streak, "spikes": self.spikes,
                "window": self.window, "factor": self.factor, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        # window / factor / consecutive come from this launch's flags (they may change on resume);
        # the saved ones are informative only. A smaller window keeps the newest losses.
        self.history = deque((float(x) for x in state["history"]), maxlen=self.window)
        self.streak = int(state["streak"])
        self.spikes = int(state.get("spikes", 0))


# -- budgets --------------------------------------------------------------------------------
class Budget:
    """Stop before a step that would go over `--max-hours`, `--total-tokens` or `--budget-usd`.

    `elapsed_s` is the run's training time across resumes: the elapsed seconds saved in the
    checkpoint plus this launch's. Cost = `gpu_hour_usd` x GPUs (one per rank) x hours; GPU
    seconds are accumulated per launch, so a resume on another world size prices each part at
    its own world: save `gpu_seconds(elapsed_s)` in the checkpoint next to the elapsed seconds and
    call `resume(elapsed_s, gpu_seconds)` after loading it.
    The loop asks `exceeded_after_next(...)` before every step (`step_time_s`: a recent step's
    duration, 0 before the first); the step runs only if it fits whole, so the run stops at the
    last step that fits, then saves. `reserve_s` keeps time back for that final save (pass the
    duration of the last save) so the save fits too.

    Not counted: start-up before the loop (building the model, loading a checkpoint) and work
    lost between the last checkpoint and a crash, since only checkpointed time is carried over.
    """

    def __init__(self, max_hours: float | None = None, total_tokens: int | None = None,
                 budget_usd: float | None = None, gpu_hour_usd: float | None = None, world: int = 1):
        if max_hours is not None:
            _positive_number("--max-hours", max_hours)
        if total_tokens is not None:
            _positive_int("--total-tokens", total_tokens)
        if budget_usd is not None:
            _positive_number("--budget-usd", budget_usd)
        if gpu_hour_usd is not None:
            _positive_number("--gpu-hour-usd", gpu_hour_usd)
        if budget_usd is not None and gpu_hour_usd is None:
            raise UsageError("--budget-usd needs --gpu-hour-usd (the price of one GPU for one hour)")
        _positive_int("world size", world)
        self.max_hours, self.total_tokens, self.budget_usd = max_hours, total_tokens, budget_usd
        self.gpu_hour_usd, self.world = gpu_hour_usd, world
        self._resumed_at_s, self._gpu_s_before = 0.0, 0.0  # where this launch took over (resume())

    def resume(self, elapsed_s: float, gpu_seconds: float | None = None) -> None:
        """Continue from a checkpoint that had trained `elapsed_s` seconds using `gpu_seconds`
        GPU-seconds (None, from a checkpoint that did not record it: its world was this one)."""
        self._resumed_at_s = float(elapsed_s)
        self._gpu_s_before = float(elapsed_s * self.world if gpu_seconds is None else gpu_seconds)

    def gpu_seconds(self, elapsed_s: float) -> float:
        """GPU-seconds used after `elapsed_s` seconds of training, all launches together."""
        return self._gpu_s_before + self.world * (elapsed_s - self._resumed_at_s)

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.max_hours, self.total_tokens, self.budget_usd))

    def check_tokens_per_step(self, tokens_per_step: int) -> None:
        """Refuse a --total-tokens that cannot hold a single optimizer step (call before training)."""
        if self.total_tokens is not None and self.total_tokens < tokens_per_step:
            raise UsageError(f"--total-tokens {self.total_tokens:,}: less than one optimizer step"
                             f" ({tokens_per_step:,} tokens)")

    def spend_usd(self, elapsed_s: float) -> float | None:
        """Dollars spent after `elapsed_s` seconds of the whole world; None without a price."""
        if self.gpu_hour_usd is None:
            return None
        return self.gpu_hour_usd * self.gpu_seconds(elapsed_s) / 3600.0

    def _time_limit_s(self) -> float | None:
        """The elapsed seconds at which the tighter of --max-hours and --budget-usd runs out."""
        limits = []
        if self.max_hours is not None:
            limits.append(self.max_hours * 3600.0)
        if self.budget_usd is not None:  # what is left of the money, spent at this launch's world
            gpu_s_left = self.budget_usd / self.gpu_hour_usd * 3600.0 - self._gpu_s_before
            limits.append(self._resumed_at_s + gpu_s_left / self.world)
        return min(limits) if limits else None

    def exceeded_after_next(self, elapsed_s: float, step_time_s: float, tokens_seen: int, tokens_per_step: int,
                            reserve_s: float = 0.0) -> str | None:
        """The reason not to start the next step (it would go over a budget), or None to go on."""
        if self.total_tokens is not None and tokens_seen + tokens_per_step > self.total_tokens:
            return (f"--total-tokens {self.total_tokens:,} reached: {tokens_seen:,} tokens trained,"
                    f" one more step would make {tokens_seen + tokens_per_step:,}")
        end_s = elapsed_s + step_time_s + reserve_s
        after = f"{hms(elapsed_s)} trained, the next step (~{step_time_s:.1f} s" + (
            f" + {reserve_s:.1f} s to save" if reserve_s else "") + ")"
        if self.max_hours is not None and end_s > self.max_hours * 3600.0:
            return f"--max-hours {self.max_hours:g} ({hms(self.max_hours * 3600.0)}) reached: {after} would end at {hms(end_s)}"
        if self.budget_usd is not None and self.spend_usd(end_s) > self.budget_usd:
            return (f"--budget-usd {self.budget_usd:g} reached: {usd(self.spend_usd(elapsed_s))} spent"
                    f" ({self.gpu_seconds(elapsed_s) / 3600:.4g} GPU-hours at ${self.gpu_hour_usd:g}/h, every launch"
                    f" at its world size; now {self.world} GPU(s)), {after} would bring it to"
                    f" {usd(self.spend_usd(end_s))}")
        return None

    def steps_left(self, elapsed_s: float, step_time_s: float, tokens_seen: int, tokens_per_step: int,
                   reserve_s: float = 0.0) -> int | None:
        """How many more steps the budgets allow at `step_time_s` each (None: no budget set)."""
        counts = []
        if self.total_tokens is not None:
            counts.append((self.total_tokens - tokens_seen) // tokens_per_step)
        limit_s = self._time_limit_s()
        if limit_s is not None and step_time_s > 0:
            counts.append(math.floor((limit_s - elapsed_s - reserve_s) / step_time_s))
        return max(0, min(counts)) if counts else None

    def eta_s(self, elapsed_s: float, step_time_s: float, tokens_seen: int, tokens_per_step: int,
              max_steps_left: int, reserve_s: float = 0.0) -> float:
        """Seconds until the run ends: --max-steps or the first budget, whichever is sooner."""
        steps = max_steps_left
        allowed = self.steps_left(elapsed_s, step_time_s, tokens_seen, tokens_per_step, reserve_s)
        if allowed is not None:
            steps = min(steps, allowed)
        return steps * step_time_s

    def describe(self) -> str:
        """One line for the start of the run, e.g. 'budget: 31 h; $1,000 at $4/GPU-hour x 8 GPU(s) ($1,000.00 left = 31.25 h)'."""
        parts = []
        if self.max_hours is not None:
            parts.append(f"{self.max_hours:g} h")
        if self.total_tokens is not None:
            parts.append(f"{self.total_tokens:,} tokens")
        if self.budget_usd is not None:
            left = self.budget_usd - self.spend_usd(self._resumed_at_s)
            parts.append(f"${self.budget_usd:,g} at ${self.gpu_hour_usd:g}/GPU-hour x {self.world} GPU(s)"
                         f" ({usd(left)} left = {left / (self.gpu_hour_usd * self.world):.4g} h)")
        return "budget: " + ("; ".join(parts) if parts else "none")


def usd(value: float) -> str:
    """Dollars as a budget line says them: cents, or 4 significant digits below a dollar (a test's budget)."""
    return f"${value:,.2f}" if abs(value) >= 1 else f"${value:.4g}"


# -- early stopping -------------------------------------------------------------------------
class EarlyStopping:
    """Stop after `patience` evaluations in a row without a new best validation loss.

    An evaluation improves when its loss is below the best so far by more than `min_delta`;
    a non-finite loss never improves. Feed it the all-reduced validation loss.
    """

    def __init__(self, patience: int, min_delta: float = 0.0):
        _positive_int("--early-stop-patience", patience)
        if not (isinstance(min_delta, (int, float)) and math.isfinite(min_delta) and min_delta >= 0):
            raise UsageError(f"early stopping min_delta: must be a number >= 0, got {min_delta!r}")
        self.patience, self.min_delta = patience, float(min_delta)
        self.best: float | None = None
        self.bad_evals = 0  # evaluations since the best one

    def update(self, val_loss: float) -> bool:
        """Record one evaluation; True if it is a new best."""
        val_loss = float(val_loss)
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best - self.min_delta):
            self.best, self.bad_evals = val_loss, 0
            return True
        self.bad_evals += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad_evals >= self.patience

    def message(self) -> str:
        return (f"early stop: no validation loss below {self.best:.4g} for {self.bad_evals} evaluations"
                f" (--early-stop-patience {self.patience})")

    def state_dict(self) -> dict:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.bad_evals = int(state["bad_evals"])


# -- helpers --------------------------------------------------------------------------------
def _positive_number(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag}: must be a positive number, got {value!r}")


def _positive_int(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{flag}: must be a positive integer, got {value!r}")


def hms(seconds: float) -> str:
    """'1h02m03s' / '4m05s' / '7.5s': durations in messages."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
