"""What a person reads about runs: `zerotrain report RUN_DIR` and `zerotrain runs [OUT]`.

    report_main(argv)   RUN_DIR/report/: PNG plots (matplotlib, Agg) and report.md; --compare overlays runs
    runs_main(argv)     one line per run directory under OUT: status, steps, losses, tokens, last checkpoint,
                        and the health verdicts that still stand (components/observe/health.py)

Only files are read (nothing is imported from torch or DeepSpeed, so both are quick on a login
node while the run trains): metrics.jsonl through `read_metrics`, config.json, manifest.json,
checkpoints/*/zerotrain.json and best.json, and the run directory's lock (launcher/components/checkpoints/run_lock.py).
A run's status: running while a live process holds the lock; otherwise how the last launch ended
(manifest segments' end_reason, else the last "stop" event): finished, stopped (why), failed (why);
a last launch that never recorded an end was killed or crashed.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from zerotrain.cli_args import Parser
from zerotrain.launcher.components.checkpoints import checkpoint
from zerotrain.launcher.ends import END_KINDS, status_of
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.components.observe.health import label, standing
from zerotrain.launcher.components.manifest import read_manifest
from zerotrain.launcher.components.observe.metrics import read_metrics
from zerotrain.launcher.components.checkpoints.run_lock import live_holder
from zerotrain.launcher.commands.report_plots import duration_text, number_text, tokens_text, write_plots

RUN_FILES = ("metrics.jsonl", "config.json", "manifest.json")  # any one of them makes a run directory


@dataclass
class Run:
    path: Path
    history: list[dict]  # the effective per-step records (read_metrics)
    events: list[dict]  # resume / rollback / stop records, in order
    config: dict | None  # config.json
    manifest: dict | None

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str, x: str = "step") -> tuple[list, list]:
        """(x values, values) of the records that carry a number under `key` ("a/b": record["a"]["b"])."""
        xs, ys = [], []
        for record in self.history:
            value = record
            for part in key.split("/"):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and record.get(x) is not None:
                xs.append(record[x])
                ys.append(value)
        return xs, ys


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in RUN_FILES)


def load_run(path: str | Path) -> Run:
    """A run directory's files; UsageError (one line) if `path` is not one."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"{path}: no such run directory")
    if not is_run_dir(p):
        raise UsageError(f"{path}: not a zerotrain run directory (none of {', '.join(RUN_FILES)} in it)")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        config = None  # a run killed before writing it still has metrics to show
    return Run(p, read_metrics(p), read_metrics(p, events=True), config if isinstance(config, dict) else None,
               read_manifest(p))


# -- status and summary ---------------------------------------------------------------------------

def run_status(run: Run) -> str:
    holder = live_holder(run.path)
    if holder is not None:
        return f"running (pid {holder.get('pid')} on {holder.get('host')})"
    segments = (run.manifest or {}).get("segments") or []
    if segments and "ended" not in segments[-1]:
        return "failed (killed or crashed: no end recorded)"
    reason = segments[-1].get("end_reason") if segments else None
    if reason is None:
        stops = [e for e in run.events if e.get("event") == "stop"]
        reason = stops[-1].get("reason") if stops else None
    if reason is None:
        return "unknown (no launch recorded)"
    return status_of(reason)  # the words of launcher/ends.py's END_KINDS


def _end_message(run: Run) -> str | None:
    """The last launch's end as manifest.json recorded it ("a rank lost (rank 1 killed by SIGKILL; exit 247)")."""
    segments = (run.manifest or {}).get("segments") or []
    return segments[-1].get("end_message") if segments else None


def summarize(run: Run) -> dict:
    """The numbers report.md and `zerotrain runs` show (None where the run has no record of it)."""
    h = run.history
    last = h[-1] if h else {}
    evals = [(r["step"], r["val_loss"]) for r in h if isinstance(r.get("val_loss"), (int, float))]
    scored = [r for r in h if isinstance(r.get("eval"), dict) and r["eval"]]  # --eval-tasks
    kept = checkpoint.read_best_list(run.path / "checkpoints")
    best = kept[0] if kept else None
    if best is None and evals:
        step, loss = min(evals, key=lambda e: e[1])
        best = {"step": step, "val_loss": loss, "tag": None}
    tps = run.series("tokens_per_s")[1]
    mfu = run.series("mfu")[1]
    waits = [r["data_wait_s"] / r["step_s"] for r in h if r.get("step_s") and r.get("data_wait_s") is not None]
    stops = [e for e in run.events if e.get("event") == "stop"]
    ckpts = checkpoint.complete_checkpoints(run.path / "checkpoints")
    losses = run.series("loss")[1]
    verdicts = [e for e in run.events if e.get("event") == "health"]
    still = standing(run.events)
    shares: dict[str, float] = {}  # seconds per phase over the health windows, weighted by their length
    for r in h:
        for phase, share in (r.get("time_shares") or {}).items():
            shares[phase] = shares.get(phase, 0.0) + share * (r.get("window_s") or 0.0)
    total = sum(shares.values())
    return {
        "run": run.name, "path": str(run.path), "status": run_status(run), "end_message": _end_message(run),
        "step": last.get("step", 0), "max_steps": ((run.config or {}).get("run") or {}).get("max_steps"),
        "tokens": last.get("tokens_seen"), "last_loss": last.get("loss"),
        "last_loss_mean10": statistics.fmean(losses[-10:]) if losses else None,
        "best_val_loss": best and best.get("val_loss"), "best_step": best and best["step"],
        "best_tag": best and best.get("tag"), "best_checkpoints": kept,
        "best_metric": best and best.get("metric"), "best_score": best and best.get("score"),  # --best-by
        "last_val_loss": evals[-1][1] if evals else None, "last_val_step": evals[-1][0] if evals else None,
        "tokens_per_s_median": statistics.median(tps) if tps else None,
        "tokens_per_s_p10": _quantile(tps, 0.1), "tokens_per_s_p90": _quantile(tps, 0.9),
        "mfu_median": statistics.median(mfu) if mfu else None,
        "elapsed_s": last.get("elapsed_s"),
        "last_task_scores": scored[-1]["eval"] if scored else None,
        "last_task_step": scored[-1]["step"] if scored else None,
        "task_scorings": len(scored), "eval_tasks_s": sum(r.get("eval_tasks_s") or 0 for r in h),
        "evals": len(evals), "eval_s": sum(r.get("eval_s") or 0 for r in h),
        "saves": sum(e.get("saves") or 0 for e in stops), "save_s": sum(e.get("save_blocked_s") or 0 for e in stops),
        "peak_rss_gib": max(run.series("peak_rss_gib")[1], default=None),
        "peak_mem_gib": max(run.series("peak_mem_gib")[1], default=None),
        "data_wait_median": statistics.median(waits) if waits else None,
        "last_checkpoint": ckpts[-1].name if ckpts else None,
        "restarts": len((run.manifest or {}).get("restarts") or []),  # zerotrain launch --max-restarts
        "health": "; ".join(e.get("summary", "?") for e in still) or ("ok" if verdicts else None),
        "health_messages": [e.get("message") for e in still],
        "time_shares": {p: s / total for p, s in sorted(shares.items(), key=lambda kv: -kv[1])} if total else None,
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = q * (len(s) - 1)
    lo = math.floor(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


# -- report.md ------------------------------------------------------------------------------------

def write_report(runs: list[Run], out: Path) -> Path:
    """out/report.md and out/*.png for runs[0], the other runs overlaid; returns report.md's path."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, out) if any(r.history for r in runs) else []
    run = runs[0]
    s = summarize(run)
    cfg = run.config or {}
    lines = [f"# Run {run.name}", ""]
    if cfg:
        model = cfg.get("model") or {}
        preset = cfg.get("run", {}).get("model")
        lines.append(f"model {model.get('n_layers', '?')} layers x {model.get('dim', '?')}"
                     + (f" ({preset})" if preset else "") + f", profile {cfg.get('profile')}, world size"
                     f" {cfg.get('world_size')},"
                     f" seq len {cfg.get('run', {}).get('seq_len')}, config hash {cfg.get('identity_hash')}")
        lines.append("")
    lines += [f"**Status: {s['status']}**", ""]
    if not run.history:
        lines += ["No steps logged yet.", ""]
    else:
        lines += _summary_table(s)
    lines += _segments(run) + _health(run) + _events(run)
    if len(runs) > 1:
        lines += ["## Compared runs", "", "| run | status | steps | tokens | final loss | best val loss (step) |"
                  " median tokens/s |", "|---|---|---|---|---|---|---|"]
        for r in runs:
            t = summarize(r)
            lines.append(f"| {r.name} | {t['status']} | {t['step']} | {tokens_text(t['tokens'])} | {number_text(t['last_loss'])}"
                         f" | {number_text(t['best_val_loss'])} ({t['best_step'] if t['best_step'] is not None else '-'})"
                         f" | {number_text(t['tokens_per_s_median'])} |")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{name[:-4]}]({name})" for name in plots] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _best_cell(s: dict) -> str:
    """`zerotrain runs`' best column: the lowest validation loss (its step), and the steps of the others kept."""
    others = [str(b["step"]) for b in s["best_checkpoints"][1:]]
    steps = f"({s['best_step']}" + (f"; also {', '.join(others)})" if others else ")")
    if s["best_val_loss"] is None:
        return f"{s['best_metric']} {number_text(s['best_score'])} {steps}" if s.get("best_metric") else "-"
    return f"{number_text(s['best_val_loss'])} {steps}"


def _summary_table(s: dict) -> list[str]:
    rows = [("steps", f"{s['step']}" + (f" of {s['max_steps']}" if s["max_steps"] else "")),
            ("tokens seen", tokens_text(s["tokens"])),
            ("final train loss", f"{number_text(s['last_loss'])} (mean of the last {min(10, s['step'])} steps"
                                 f" {number_text(s['last_loss_mean10'])})")]
    if s["best_val_loss"] is not None:
        where = f"step {s['best_step']}" + (f", checkpoint {s['best_tag']}" if s["best_tag"] else "")
        rows.append(("best validation loss", f"{number_text(s['best_val_loss'])} ({where})"))
        if len(s["best_checkpoints"]) > 1:
            rows.append(("best checkpoints kept", ", ".join(f"{b['tag']} ({number_text(b.get('val_loss'))})"
                                                            for b in s["best_checkpoints"])))
        rows.append(("last validation loss", f"{number_text(s['last_val_loss'])} (step {s['last_val_step']})"))
    if s.get("best_metric"):  # --best-by: a task's score chose the checkpoints kept
        rows.append((f"best {s['best_metric']}", f"{number_text(s['best_score'])} (step {s['best_step']}, checkpoint"
                                                f" {s['best_tag']}; kept: "
                                                + ", ".join(f"{b['tag']} ({number_text(b['score'])})" for b in s["best_checkpoints"])
                                                + ")"))
    if s["last_task_scores"]:  # --eval-tasks: the last scoring's numbers (the curves: eval_TASK.png)
        rows.append((f"task scores (step {s['last_task_step']})", "; ".join(
            f"{task} " + ", ".join(f"{m} {number_text(v)}" for m, v in sorted(metrics.items()))
            for task, metrics in sorted(s["last_task_scores"].items()))))
    if s["tokens_per_s_median"] is not None:
        rows.append(("throughput", f"median {number_text(s['tokens_per_s_median'])} tokens/s; 10th-90th percentile"
                                   f" {number_text(s['tokens_per_s_p10'])}-{number_text(s['tokens_per_s_p90'])}"))
    if s["mfu_median"] is not None:
        rows.append(("MFU", f"median {s['mfu_median']:.1%} of the profile's peak"))
    elapsed = s["elapsed_s"]
    if elapsed:
        rows.append(("training wall time", duration_text(elapsed) + " (over all launches)"))
        rows.append(("evaluations", f"{s['evals']}, {duration_text(s['eval_s'])} ({s['eval_s'] / elapsed:.1%})"))
        if s["task_scorings"]:
            rows.append(("task scorings", f"{s['task_scorings']}, {duration_text(s['eval_tasks_s'])}"
                                          f" ({s['eval_tasks_s'] / elapsed:.1%})"))
        rows.append(("checkpoint saves", f"{s['saves']}, {duration_text(s['save_s'])} blocking the loop"
                                         f" ({s['save_s'] / elapsed:.1%}; launches that ended without a stop"
                                         " record are not counted)"))
    if s["data_wait_median"] is not None:
        rows.append(("waiting for data", f"median {s['data_wait_median']:.1%} of step time"))
    if s["time_shares"]:
        rows.append(("where the wall time went (health windows)", ", ".join(
            f"{label(p).split(' (')[0]} {v:.1%}" for p, v in s["time_shares"].items() if v >= 0.0005)))
    if s["health"]:
        rows.append(("health", s["health"]))
    if s["peak_mem_gib"] is not None:
        rows.append(("peak accelerator memory (rank 0)", f"{s['peak_mem_gib']:.2f} GiB"))
    if s["peak_rss_gib"] is not None:
        rows.append(("peak host memory, RSS (rank 0)", f"{s['peak_rss_gib']:.2f} GiB"))
    if s["restarts"]:
        rows.append(("restarts (`zerotrain launch --max-restarts`)", f"{s['restarts']}: see Launches"))
    rows.append(("last checkpoint", s["last_checkpoint"] or "none"))
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]


def _segments(run: Run) -> list[str]:
    segments = (run.manifest or {}).get("segments") or []
    if not segments:
        return []
    lines = ["## Launches (manifest.json)", "", "| # | started | ended | world | hosts | from checkpoint | end |",
             "|---|---|---|---|---|---|---|"]
    for i, seg in enumerate(segments, 1):
        end = "no end recorded (killed or crashed)"
        if "ended" in seg:
            kind, code = seg.get("end_reason"), seg.get("end_exit_code")
            if code is None and kind in END_KINDS:  # a manifest written before the code was recorded
                code = END_KINDS[kind].exit_code
            end = f"{kind} at step {seg.get('end_step')}" + (f", exit {code}" if code is not None else "")
            end += f": {seg['end_message']}" if seg.get("end_message") and kind not in ("finished",) else ""
        frm = Path(seg["from_checkpoint"]).name if seg.get("from_checkpoint") else "-"
        lines.append(f"| {i} | {seg.get('started')} | {seg.get('ended', '-')} | {seg.get('world_size')} |"
                     f" {', '.join(seg.get('hosts') or [])} | {frm} | {end} |")
    restarts = (run.manifest or {}).get("restarts") or []
    if restarts:
        lines += ["", "Restarts (`zerotrain launch --max-restarts`):", ""] + [
            f"- {r.get('time')}: restart {r.get('attempt')} of {r.get('max_restarts')} after {r.get('cause')}"
            f" (rank {r.get('rank') if r.get('rank') is not None else 'unknown'})" for r in restarts]
    return lines + [""]


def _health(run: Run) -> list[str]:
    verdicts = [e for e in run.events if e.get("event") == "health"]
    if not verdicts:
        return []
    lines = ["## Health (metrics.jsonl)", "",
             "Verdicts of the health check (components/observe/health.py; docs/watching.md, Health): a run slower than its"
             " profile's mfu_threshold for several windows, and ranks slower than the others.", ""]
    lines += [f"- step {e.get('step')}: **{e.get('verdict', '?')}**: {e.get('message')}" for e in verdicts]
    return lines + [""]


def _events(run: Run) -> list[str]:
    events = [e for e in run.events if e.get("event") != "health"]  # those have their own section
    if not events:
        return []
    lines = ["## Resumes, rollbacks and stops (metrics.jsonl)", ""]
    for e in events:
        kind, step = e.get("event"), e.get("step")
        if kind == "resume":
            lines.append(f"- step {step}: resumed from {e.get('checkpoint')}")
        elif kind == "rollback":
            lines.append(f"- step {step}: rolled back ({e.get('why')}); data of steps"
                         f" {'-'.join(str(x) for x in e.get('skipped_steps') or [])} skipped")
        elif kind == "stop":
            lines.append(f"- step {step}: stopped, {e.get('reason')}: {e.get('message')}")
        else:
            lines.append(f"- step {step}: {kind}")
    return lines + [""]


# -- the commands -----------------------------------------------------------------------------------

def report_main(argv: list[str]) -> None:
    p = Parser(prog="zerotrain report", description="Plots and a summary of a run, in RUN_DIR/report/.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR", help="overlay these runs on the plots")
    p.add_argument("--out", help="write here instead of RUN_DIR/report/")
    ns = p.parse_args(argv)
    runs = [load_run(d) for d in (ns.run_dir, *ns.compare)]
    out = Path(ns.out) if ns.out else runs[0].path / "report"
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    path = write_report(runs, out)
    plots = sorted(p.name for p in out.glob("*.png"))
    print(f"wrote {path}" + (f" and {len(plots)} plots: {', '.join(plots)}" if plots else " (no steps logged yet)"))


def runs_main(argv: list[str]) -> None:
    p = Parser(prog="zerotrain runs", description="The run directories under OUT and how each stands.")
    p.add_argument("out", nargs="?", default="runs", metavar="OUT", help="directory holding run directories (runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of a table")
    ns = p.parse_args(argv)
    root = Path(ns.out)
    if not root.is_dir():
        raise UsageError(f"{ns.out}: no such directory")
    dirs = [d for d in root.iterdir() if is_run_dir(d)]
    dirs.sort(key=lambda d: max((d / f).stat().st_mtime for f in RUN_FILES if (d / f).is_file()))  # newest last
    summaries = [summarize(load_run(d)) for d in dirs]
    if ns.json:
        for s in summaries:
            print(json.dumps(s))
        return
    if not summaries:
        print(f"no run directories in {root}")
        return
    header = ("run", "status", "steps", "last loss", "best val (step)", "tokens", "last checkpoint", "health")
    rows = [(s["run"], s["status"] + (f" after {s['restarts']} restart(s)" if s["restarts"] else ""),
             f"{s['step']}" + (f"/{s['max_steps']}" if s["max_steps"] else ""), number_text(s["last_loss"]),
             _best_cell(s),
             tokens_text(s["tokens"]), s["last_checkpoint"] or "-", s["health"] or "-") for s in summaries]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    for s in summaries:  # why each failed run ended, as its last launch recorded it
        if s["status"].startswith("failed") and s["end_message"]:
            print(f"{s['run']}: {s['end_message']}")
