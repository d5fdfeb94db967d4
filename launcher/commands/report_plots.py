"""The plots of `zerotrain report` (launcher/commands/report.py): one drawer per PNG, each drawing every run on one
matplotlib Axes (Agg: files only), and the number formatting the report shares. `Run`: report.py's (its history,
events and config; not imported here, which report.py imports).
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from zerotrain.launcher.components.observe.health import label
from zerotrain.launcher.components.observe.metrics import TIMELINE_EVENTS

# -- plots ----------------------------------------------------------------------------------------
# Each drawer draws every run on one matplotlib Axes and returns False when no run has its data.

def _label(run_label: str, what: str, many: bool) -> str:
    return f"{run_label}: {what}" if many else what


def _smooth(values: list[float]) -> list[float]:
    """An exponential moving average (window ~2% of the run): the trend through a noisy loss."""
    alpha = 2 / (max(2, len(values) // 50) + 1)
    out, avg = [], values[0]
    for v in values:
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg)
    return out


def _loss(ax, runs, labels, x: str) -> bool:
    many = len(runs) > 1
    drawn = False
    for i, run in enumerate(runs):
        xs, loss = run.series("loss", x)
        if xs:
            noisy = len(xs) > 50
            ax.plot(xs, loss, color=f"C{i}", lw=0.8, alpha=0.3 if noisy else 1.0,
                    label=None if noisy else _label(labels[i], "train", many))
            if noisy:
                ax.plot(xs, _smooth(loss), color=f"C{i}", lw=1.8, label=_label(labels[i], "train (smoothed)", many))
            drawn = True
        vx, val = run.series("val_loss", x)
        if vx:
            ax.plot(vx, val, "o--", color=f"C{i}", ms=4, lw=1.2, mec="black", mew=0.5,
                    label=_label(labels[i], "validation", many))
            drawn = True
        if x == "step":  # where the history was resumed or rolled back
            for e in run.events:
                if e.get("event") in TIMELINE_EVENTS:
                    ax.axvline(e["step"], color=f"C{i}", ls=":", lw=1)
                    ax.annotate(e["event"], (e["step"], 1), xycoords=("data", "axes fraction"), rotation=90,
                                va="top", ha="right", fontsize=7, color=f"C{i}")
    ax.set_ylabel("loss")
    return drawn


def _loss_steps(ax, runs, labels):
    ax.set_title("loss vs steps")
    ax.set_xlabel("step")
    return _loss(ax, runs, labels, "step")


def _loss_tokens(ax, runs, labels):
    from matplotlib.ticker import EngFormatter

    ax.set_title("loss vs tokens")
    ax.set_xlabel("tokens seen")
    ax.xaxis.set_major_formatter(EngFormatter())
    return _loss(ax, runs, labels, "tokens_seen")


def _simple(key: str, title: str, ylabel: str, median_line: bool = False):
    def draw(ax, runs, labels):
        many = len(runs) > 1
        drawn = False
        for i, run in enumerate(runs):
            xs, ys = run.series(key)
            if not xs:
                continue
            ax.plot(xs, ys, color=f"C{i}", lw=1, label=labels[i] if many else None)
            if median_line:
                m = statistics.median(ys)
                ax.axhline(m, color=f"C{i}", ls="--", lw=1, label=_label(labels[i], f"median {number_text(m)}", many))
            drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        return drawn
    return draw


def _throughput(ax, runs, labels):
    from matplotlib.ticker import EngFormatter

    drawn = _simple("tokens_per_s", "throughput", "tokens / s (all ranks)", median_line=True)(ax, runs, labels)
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylim(bottom=0)
    return drawn


def _grad_norm(ax, runs, labels):
    drawn = _simple("grad_norm", "gradient norm", "global grad norm")(ax, runs, labels)
    _log_when_wide(ax, [v for run in runs for v in run.series("grad_norm")[1] if v > 0])  # early steps dwarf the rest
    return drawn


def _log_when_wide(ax, positive: list[float]) -> None:
    """A log y axis where the values span more than 50x (a linear one would flatten the small ones)."""
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")


def _shares(ax, runs, labels):
    from matplotlib.ticker import PercentFormatter

    many = len(runs) > 1
    drawn = False
    styles = ["-", "--", "-.", ":"]
    for i, run in enumerate(runs):
        specs = (run.config or {}).get("sources") or []
        logged = {s for r in run.history for s in (r.get("data_shares") or {})}
        sources = [s["name"] for s in specs if s.get("name") in logged] + sorted(logged - {s.get("name") for s in specs})
        total = sum(s.get("weight") or 0 for s in specs) or 1
        weights = {s.get("name"): (s.get("weight") or 0) / total for s in specs}
        for j, source in enumerate(sources):
            xs, ys = run.series(f"data_shares/{source}")
            color = f"C{j}"
            ax.plot(xs, ys, color=color, ls=styles[i % len(styles)], marker="." if len(xs) < 30 else None,
                    label=_label(labels[i], source, many))
            if source in weights and i == 0:
                ax.axhline(weights[source], color=color, lw=0.8, alpha=0.5, ls=(0, (1, 3)))
            drawn = True
    ax.set_title("token share per source (dotted: target weight)")
    ax.set_xlabel("step")
    ax.set_ylabel("share of tokens seen")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    return drawn


def _memory(ax, runs, labels):
    many = len(runs) > 1
    drawn = False
    for i, run in enumerate(runs):
        for key, what, ls in (("peak_mem_gib", "accelerator peak allocated", "-"), ("peak_rss_gib", "host peak RSS", "--")):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=f"C{i}", ls=ls, lw=1.2, label=_label(labels[i], what, many))
                drawn = True
    ax.set_title("peak memory (rank 0)")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    return drawn


def _data_wait(ax, runs, labels):
    from matplotlib.ticker import PercentFormatter

    many = len(runs) > 1
    drawn = False
    for i, run in enumerate(runs):
        pts = [(r["step"], r["data_wait_s"] / r["step_s"]) for r in run.history
               if r.get("step_s") and r.get("data_wait_s") is not None]
        if pts:
            ax.plot(*zip(*pts), color=f"C{i}", lw=1, label=labels[i] if many else None)
            drawn = True
    ax.set_title("time waiting for data")
    ax.set_xlabel("step")
    ax.set_ylabel("share of step time")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(bottom=0)
    return drawn


def _time_shares(ax, runs, labels):
    from matplotlib.ticker import PercentFormatter

    many = len(runs) > 1
    drawn = False
    styles = ["-", "--", "-.", ":"]
    for i, run in enumerate(runs):
        phases = sorted({p for r in run.history for p in (r.get("time_shares") or {})})
        for j, phase in enumerate(phases):
            xs, ys = run.series(f"time_shares/{phase}")
            ax.plot(xs, ys, color=f"C{j}", ls=styles[i % len(styles)], marker="." if len(xs) < 30 else None,
                    label=_label(labels[i], label(phase).split(" (")[0], many))
            drawn = True
    ax.set_title("where the wall time goes (health windows)")
    ax.set_xlabel("step")
    ax.set_ylabel("share of the window's wall time")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, 1)
    return drawn


def _task(task: str):
    """--eval-tasks: one panel per task, each of its metrics (the records' `eval: {TASK: {METRIC: value}}`)
    over the steps it was scored at; a log scale when the metrics differ by orders (perplexities and bits)."""
    def draw(ax, runs, labels):
        many = len(runs) > 1
        styles = ["-", "--", "-.", ":"]
        values = []
        for i, run in enumerate(runs):
            metrics = sorted({m for r in run.history for m in ((r.get("eval") or {}).get(task) or {})})
            for j, metric in enumerate(metrics):
                xs, ys = run.series(f"eval/{task}/{metric}")
                if xs:
                    ax.plot(xs, ys, color=f"C{j}", ls=styles[i % len(styles)], marker="o", ms=4,
                            label=_label(labels[i], metric, many))
                    values += ys
        if all(v > 0 for v in values):  # a zero (an accuracy) has no place on a log axis
            _log_when_wide(ax, values)
        ax.set_title(f"task {task} (lm-evaluation-harness, --eval-tasks)")
        ax.set_xlabel("step")
        ax.set_ylabel("score")
        return bool(values)
    return draw


def task_plots(runs: list) -> list[tuple[str, object]]:
    """(file name, drawer) per task any run scored: eval_TASK.png."""
    tasks = sorted({t for run in runs for r in run.history for t in (r.get("eval") or {})})
    return [(f"eval_{re.sub(r'[^A-Za-z0-9_.-]', '_', t)}.png", _task(t)) for t in tasks]


PLOTS = [  # file name, drawer
    ("loss_vs_steps.png", _loss_steps),
    ("loss_vs_tokens.png", _loss_tokens),
    ("throughput.png", _throughput),
    ("lr.png", _simple("lr", "learning rate", "lr")),
    ("grad_norm.png", _grad_norm),
    ("data_shares.png", _shares),
    ("memory.png", _memory),
    ("data_wait.png", _data_wait),
    ("time_shares.png", _time_shares),
]


def write_plots(runs: list, out: Path) -> list[str]:
    """One PNG per plot that has data, plus overview.png with all of them; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a login node
    import matplotlib.pyplot as plt

    labels = _labels(runs)
    written = []
    for stale in out.glob("eval_*.png"):  # a task this report no longer has must not linger
        stale.unlink()
    plots = PLOTS + task_plots(runs)
    for name, draw in plots:
        (out / name).unlink(missing_ok=True)  # a plot this run no longer has must not linger
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        if draw(ax, runs, labels):
            _finish(ax)
            fig.tight_layout()
            fig.savefig(out / name)
            written.append(name)
        plt.close(fig)
    (out / "overview.png").unlink(missing_ok=True)
    if written:
        cols = 2
        rows = math.ceil(len(written) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(14, 4 * rows), dpi=90, squeeze=False)
        drawers = dict(plots)
        for ax, name in zip(axes.flat, written):
            drawers[name](ax, runs, labels)
            _finish(ax)
        for ax in list(axes.flat)[len(written):]:
            ax.set_visible(False)
        fig.suptitle("run " + " vs ".join(labels))
        fig.tight_layout()
        fig.savefig(out / "overview.png")
        plt.close(fig)
        written.insert(0, "overview.png")
    return written


def _finish(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    if ax.get_xlabel() == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5 on short runs
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _labels(runs: list) -> list[str]:
    names = [r.name for r in runs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in runs]


# -- number formatting ----------------------------------------------------------------------------

def number_text(v) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1e4:
        return tokens_text(v)
    return f"{v:.4g}"


def tokens_text(n) -> str:
    if n is None:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:g}"


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
