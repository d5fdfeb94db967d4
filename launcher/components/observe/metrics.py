"""Where a run's numbers go: sinks behind one small interface (torchtitan's `components/observe/metrics.py`).

`metrics.jsonl` in the run directory is the one sink every run has: one JSON object per step,
appended, never rewritten. A resume, or a rollback after a loss spike, appends an event record
(`{"event": "resume" | "rollback", "step": k, ...}`; "restart" at 0: a launch with no checkpoint to
resume from, after one that saved none) and then re-logs steps after k: `read_metrics`
gives the effective history (a later record for a step replaces the earlier one; an event at
step k drops what was logged after k before it). Only rank 0 writes.

`--log tensorboard,wandb` adds sinks (each optional, combinable; `parse_sinks` checks the names):
- tensorboard: event files in RUN_DIR/tensorboard/, one scalar per numeric key of the record, its
  name the metrics.jsonl key (a nested dict gives `key/sub`, e.g. `data_shares/prose`), x = step.
- wandb: a W&B run whose id is the zerotrain run id (resume="allow": a resumed run continues it),
  files under RUN_DIR/wandb/, the same scalars; WANDB_PROJECT, WANDB_NAME, WANDB_RUN_ID, WANDB_DIR,
  WANDB_RESUME set by the user win over these defaults, the --wandb-* flags over both
  (`wandb_init_args`). Online only when credentials exist; otherwise offline (`wandb sync`
  uploads later), so wandb never asks for a key, terminal or not.
A `health` event (components/observe/health.py: the run is slower than its profile expects, or a rank is a
straggler) goes to both as text: TensorBoard's `health` text tag, W&B's `health` history key and
run summary; the window's time shares are ordinary scalars of that step's record (`time_shares/data`).
Both import their package only when asked for. A sink that cannot start warns and is left out:
metrics.jsonl keeps everything, and a watcher's trouble never stops a multi-week run.

Also here: `StepLogger`, which makes each step's record (loss, throughput, MFU, time and memory from
`step_measurements`, validation, data shares) and keeps the progress bar; the Trainer hands it values,
it never reaches into the Trainer and runs no collective.
"""
from __future__ import annotations

import json
import netrc
import os
import resource
import sys
from pathlib import Path
from urllib.parse import urlsplit

from zerotrain.launcher.components.guards import hms
from zerotrain.launcher.config import parse_sinks

GIB = 2 ** 30


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric values of a step record, nested dicts flattened as `key/sub` (the step itself,
    strings such as tokens_sha, and None are left out)."""
    out = {}
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


class JsonlSink:
    """metrics.jsonl, appended to. A last line a kill or a full disk left unfinished is ended first, so that the
    next record starts a line of its own (read_metrics skips the torn one, not the record after it). A write the
    disk refuses (full, read-only) is said once on stderr and dropped: losing a metrics line must not end a run
    that can still save, or turn a run's recorded end into a traceback."""

    def __init__(self, path: Path):
        self.path, self.failing = path, False
        torn = path.is_file() and path.stat().st_size > 0 and not _ends_with_newline(path)
        self.file = open(path, "a")
        if torn:
            self._put("\n")

    def write(self, record: dict) -> None:
        self._put(json.dumps(record) + "\n")

    def _put(self, text: str) -> None:
        try:
            self.file.write(text)
            self.file.flush()
            self.failing = False
        except OSError as e:
            if not self.failing:
                print(f"zerotrain: warning: {self.path}: a record could not be written ({e.strerror or e});"
                      " records are dropped until it can be", file=sys.stderr, flush=True)
            self.failing = True

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # what is still buffered cannot be written: said already, or the disk filled just now
            pass


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# events after which what was logged past their step belongs to an abandoned timeline (the module docstring)
TIMELINE_EVENTS = ("resume", "rollback", "restart")


class TensorBoardSink:
    """Scalars in RUN_DIR/tensorboard/. After a resume or rollback at step k the writer is reopened
    with purge_step=k+1: TensorBoard then hides what the abandoned timeline logged after k, so it
    shows the same effective history as `read_metrics`."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.writer, self.purge_step = log_dir, None, None

    def write(self, record: dict) -> None:
        if "event" in record:
            if record["event"] in TIMELINE_EVENTS:
                self.close()
                self.purge_step = record["step"] + 1
            elif record["event"] == "health" and self.writer is not None:  # after the step's record, always
                self.writer.add_text("health", record.get("message", ""), record["step"])
            return
        if self.writer is None:  # opened at the first step, so a purge step from a resume is known
            from torch.utils.tensorboard import SummaryWriter

            # flush_secs: a person watching a live run sees new steps within 10 s (default 120 s)
            self.writer = SummaryWriter(str(self.log_dir), purge_step=self.purge_step, flush_secs=10)
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def wandb_credentials() -> bool:
    """Whether W&B has an API key without asking: WANDB_API_KEY, an identity token file, or a
    ~/.netrc (or $NETRC) entry for WANDB_BASE_URL's host (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(files: str = "RUN_DIR") -> tuple[str, str | None]:
    """(mode for wandb.init, a note to print or None). WANDB_MODE is honoured, except that a mode
    that would go online without credentials becomes offline: wandb would prompt for a key.
    `files`: the directory wandb writes under (its wandb/ folder), for the note."""
    mode = os.environ.get("WANDB_MODE") or "online"
    if mode in ("offline", "dryrun", "disabled") or wandb_credentials():
        return mode, None
    return "offline", ("no W&B API key (WANDB_API_KEY or `wandb login`): logging offline; upload later with"
                       f" `wandb sync {files}/wandb/offline-run-*`")


def wandb_init_args(run_dir: Path, cfg, environ=None) -> dict:
    """project, name, id, dir, resume, entity and group for wandb.init: a flag wins, then the
    environment W&B users set (WANDB_PROJECT, WANDB_NAME, WANDB_RUN_ID, WANDB_DIR, WANDB_RESUME,
    WANDB_ENTITY, WANDB_RUN_GROUP), then our default (project zerotrain; name and id the run id, so
    a resumed run continues its W&B run; files under RUN_DIR; resume "allow"). wandb.init's
    arguments override its environment, so our defaults are only passed where the user set nothing."""
    environ = os.environ if environ is None else environ

    def pick(flag, var, default):
        return getattr(cfg.observe, flag) if flag and getattr(cfg.observe, flag) else environ.get(var) or default

    return dict(project=pick("wandb_project", "WANDB_PROJECT", "zerotrain"),
                entity=pick("wandb_entity", "WANDB_ENTITY", None), group=pick("wandb_group", "WANDB_RUN_GROUP", None),
                name=pick("wandb_name", "WANDB_NAME", run_dir.name), id=pick(None, "WANDB_RUN_ID", run_dir.name),
                dir=pick(None, "WANDB_DIR", str(run_dir)), resume=pick(None, "WANDB_RESUME", "allow"))


class WandbSink:
    """One W&B run per zerotrain run (id = run id, resume="allow"), files under RUN_DIR/wandb/.

    W&B cannot rewrite steps it already holds: after a resume or rollback to step k, steps up to the
    highest one it has keep their first values there (metrics.jsonl and TensorBoard show the new
    ones); later steps continue normally."""

    def __init__(self, run_dir: Path, cfg, say):
        import wandb

        self.say = say
        kwargs = wandb_init_args(run_dir, cfg)
        mode, note = wandb_mode(kwargs["dir"] if "WANDB_DIR" in os.environ else "RUN_DIR")
        if note:
            say(f"zerotrain: note: {note}")
        config_path = run_dir / "config.json"
        kwargs["config"] = json.loads(config_path.read_text()) if config_path.is_file() else cfg.to_dict()
        try:
            self.run = wandb.init(mode=mode, **kwargs)
        except Exception as e:  # online: network down, key refused. W&B's errors have no common base
            if mode == "offline":
                raise
            say(f"zerotrain: warning: --log wandb: could not start an online W&B run ({_one_line(e)});"
                " logging offline")
            self.run = wandb.init(mode="offline", **kwargs)
        # The highest step W&B already has: an online resume tells; offline, our own file does.
        self.last_step = max(self.run.step - 1, _highest_logged_step(run_dir / "metrics.jsonl"))
        self.warned_overlap = False

    def write(self, record: dict) -> None:
        if "event" in record:
            if record["event"] == "stop":
                self.run.summary["stop_reason"] = record.get("reason")
            elif record["event"] == "health":
                self.run.summary["health"] = record.get("message")
                if record["step"] >= self.last_step:  # W&B drops what is logged at an earlier step
                    self.run.log({"health": record.get("message")}, step=record["step"])
            elif record["step"] < self.last_step and not self.warned_overlap:
                self.warned_overlap = True
                self.say(f"zerotrain: note: W&B keeps its values for steps {record['step'] + 1}-{self.last_step}"
                         " (it cannot rewrite them); metrics.jsonl and TensorBoard have this timeline's")
            return
        if record["step"] <= self.last_step:
            return
        self.run.log(scalars(record), step=record["step"])
        self.last_step = record["step"]

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """`log(record)` for step records, `event(kind, step, **info)` for resumes, rollbacks and stops.

    `MetricsLogger(run_dir, is_main, cfg)`: rank 0 (is_main) writes metrics.jsonl and the sinks
    named by `cfg.observe.log`; other ranks write nothing. Without cfg: metrics.jsonl only."""

    def __init__(self, run_dir: Path, is_main: bool, cfg=None, say=None):
        run_dir = Path(run_dir)
        say = say or (lambda message: print(message, flush=True))
        self.sinks = []
        self.path = run_dir / "metrics.jsonl"
        if not is_main:
            return
        self.sinks.append(JsonlSink(self.path))
        for name in parse_sinks(cfg.observe.log)[1:] if cfg is not None else []:
            try:
                self.sinks.append(TensorBoardSink(run_dir / "tensorboard") if name == "tensorboard"
                                  else WandbSink(run_dir, cfg, say))
            except Exception as e:  # see the module docstring: a watcher never stops the run
                say(f"zerotrain: warning: --log {name}: could not start ({_one_line(e)}); metrics.jsonl only")

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def event(self, kind: str, step: int, **info) -> None:
        self.log({"event": kind, "step": step, **info})

    def fresh_start(self) -> None:
        """A launch with no checkpoint to resume from, in a run directory an earlier launch logged steps to (it
        ended before its first save): those steps are superseded, as a resume's later ones are (`read_metrics`)."""
        if self.sinks and _highest_logged_step(self.path) > 0:
            self.event("restart", 0, why="no checkpoint to resume from: the steps logged before start again")

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(run_dir: Path, events: bool = False) -> list[dict]:
    """The effective per-step history of a run (see the module docstring), oldest step first."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    steps: dict[int, dict] = {}
    seen_events = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill -9 mid-write
            continue
        if "event" in record:
            seen_events.append(record)
            if record["event"] in TIMELINE_EVENTS:
                steps = {s: r for s, r in steps.items() if s <= record["step"]}
            continue
        steps[record["step"]] = record
    history = [steps[s] for s in sorted(steps)]
    return seen_events if events else history


def _highest_logged_step(path: Path) -> int:
    """The highest step ever written to metrics.jsonl, abandoned timelines included (0 if none)."""
    highest = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "event" not in record and isinstance(record.get("step"), int):
                highest = max(highest, record["step"])
    return highest


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


# -- per-step measurements (the Trainer adds these to each step's record) -------------------------

def step_measurements(step_s: float, data_wait_s: float, accelerator=None) -> dict:
    """Time and memory of one step on this rank (rank 0's go into metrics.jsonl):

    step_s        wall time of the step: fetching the batches, forward, backward, optimizer
                  (not the evaluation or the save that may follow it)
    data_wait_s   the part of step_s spent waiting for the data loader
    peak_rss_gib  peak resident memory of this process since it started (getrusage; host RAM,
                  the figure that matters on a CPU node)
    peak_mem_gib  on an accelerator only: its max_memory_allocated since the process started
                  (torch.cuda.max_memory_allocated on a GPU)
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB on Linux
    out = {"step_s": round(step_s, 4), "data_wait_s": round(data_wait_s, 4), "peak_rss_gib": round(rss / GIB, 3)}
    if accelerator is not None and accelerator.device_name() != "cpu":
        out["peak_mem_gib"] = round(accelerator.max_memory_allocated() / GIB, 3)
    return out


class StepLogger:
    """One step's record to every sink (`MetricsLogger`) and the progress bar (rank 0 draws it).

    What needs the other ranks (the data shares' all-reduce, the golden verdict) is the Trainer's; this
    writes what it is given. `flops_per_token` and `peak_flops` (the profile's, per device) give MFU."""

    def __init__(self, metrics: MetricsLogger, budget, *, is_main: bool, world: int, tokens_per_step: int,
                 max_steps: int, first_step: int, flops_per_token: float, peak_flops: float | None = None,
                 accelerator=None):
        self.metrics, self.budget, self.world = metrics, budget, world
        self.tokens_per_step, self.max_steps = tokens_per_step, max_steps
        self.flops, self.peak, self.accel = flops_per_token, peak_flops, accelerator
        self.bar = None
        if is_main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stdout)

    def log(self, step: int, loss: float, lr: float, tokens_sha: str, step_s: float, *, data_wait_s: float,
            grad_norm: float | None, tokens_seen: int, elapsed_s: float, val: dict | None = None,
            data_shares: list[tuple[str, float, float]] | None = None, window: dict | None = None) -> dict:
        """Write step `step`'s record and advance the bar; returns the record. data_shares: (source,
        share of the tokens so far, its weight in the mix) per source, when due. window: the health
        window that closed at this step (components/observe/health.py Window.figures(): time_shares, window_mfu)."""
        record = {"step": step, "loss": loss, "lr": lr, "tokens_sha": tokens_sha,
                  "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "tokens_seen": tokens_seen, "tokens_per_s": round(self.tokens_per_step / step_s, 1),
                  "elapsed_s": round(elapsed_s, 3)}
        record.update(step_measurements(step_s, data_wait_s, self.accel))
        if val is not None:
            record.update(val)
            if self.bar is not None and "val_loss" in val:
                self.bar.write(f"step {step}: val_loss {val['val_loss']:.4f} " + ", ".join(
                    f"{k} {v:.4f}" for k, v in val["val_loss_per_source"].items()))
        if self.peak:
            record["mfu"] = round(self.flops * self.tokens_per_step / step_s / (self.peak * self.world), 5)
        if window is not None:
            record.update(window)
        if data_shares is not None:
            record["data_shares"] = {name: round(share, 5) for name, share, _ in data_shares}
            if self.bar is not None:
                self.bar.write(f"step {step}: token shares " + ", ".join(
                    f"{name} {share:.2%} (weight {weight:.2%})" for name, share, weight in data_shares))
        self.metrics.log(record)
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            spend = self.budget.spend_usd(elapsed_s)
            if spend is not None:
                post["usd"] = f"{spend:.2f}"
            if self.budget.active:  # tqdm's own ETA counts --max-steps only
                post["eta"] = hms(self.budget.eta_s(elapsed_s, step_s, tokens_seen, self.tokens_per_step,
                                                     self.max_steps - step))
            self.bar.set_postfix(post)
            self.bar.update(1)
        return record

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
