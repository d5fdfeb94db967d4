"""The one table of how a run ends: kind -> exit code, checkpoint saved or not, what it means.

END_KINDS below is read by everything that names an end: the trainer raises `StopRun(kind, message)`
(launcher/errors.py) and exits with the kind's code; finetune's result and RunFailed; `zerotrain runs`/`report`'s
status words; manifest.json (each launch's end kind, code and message); pre-flight's exit code; `zerotrain launch
--max-restarts` and the sbatch template's requeue (which ends are restartable); and docs/exit-codes.md's table
(tests/test_end_kinds.py parses it and compares). Adding a kind is one entry here plus its docs/exit-codes.md row.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EndKind:
    kind: str
    exit_code: int  # what `zerotrain train` / `launch` / `preflight` exits with: a scheduler tells every end apart
    saves: bool  # a checkpoint is saved at this end (resume from it with the same command)
    failed: bool  # an error: one line on stderr, finetune raises RunFailed, `zerotrain runs` says "failed"
    status: str  # the words `zerotrain runs` / `report` show
    meaning: str  # one line, as in docs/exit-codes.md
    # `zerotrain launch --max-restarts` starts the job again with --resume auto after this end, and the sbatch
    # template requeues it: the ends a fresh start can get past (a hang, a lost rank, a communication error).
    # Never an end that asked to stop (a signal, a budget) or that would end the same way again (bad input,
    # divergence).
    restartable: bool = False
    command: str = "train"  # the command that ends this way (train: the driver, under any launcher)


END_KINDS = {e.kind: e for e in (
    EndKind("finished", 0, True, False, "finished", "`--max-steps` reached"),
    EndKind("data-exhausted", 0, True, False, "finished (data exhausted)",
            "a source with `on_exhausted: stop` ran out"),
    EndKind("dry-run", 0, False, False, "dry run", "`--dry-run`: resolved and printed, nothing built or written"),
    EndKind("crash", 1, False, True, "failed (crashed)",
            "an unexpected error (a traceback) or a communication error; a rank lost (killed, by the kernel's OOM"
            " killer too; a segfault) ends the same way, with the launcher's own code: 1 when another rank's error"
            " ended the job first, 256 - N for a rank killed by signal N (247 for SIGKILL: DeepSpeed's launch.py"
            " exits with -9); any code not in this table is a crash", restartable=True),
    EndKind("usage", 2, False, True, "failed (bad input)", "bad input: one line naming the input, nothing written"),
    EndKind("diverged", 3, False, True, "failed (diverged)",
            "non-finite loss or gradient norm, a loss spike with `--on-spike stop`, or rollbacks used up"),
    EndKind("early-stop", 4, True, False, "stopped (early-stop)",
            "`--early-stop-patience`: validation loss stopped improving"),
    EndKind("budget", 5, True, False, "stopped (budget)", "`--max-hours`, `--total-tokens` or `--budget-usd` reached"),
    EndKind("signal", 6, True, False, "stopped (signal)",
            "SIGTERM/SIGINT: stopped at a step boundary; resume with the same command"),
    EndKind("save-failed", 7, False, True, "failed (checkpoint write failed)",
            "a checkpoint could not be written (disk full, I/O error); the previous one is intact"),
    EndKind("golden", 8, True, False, "stopped (golden)",
            "`--golden-strict`: tokens/s or peak memory more than 10% off the pre-flight rehearsal"),
    EndKind("preflight-failed", 9, False, True, "failed (pre-flight check)",
            "`zerotrain preflight`: a check failed (it says what to fix)", command="preflight"),
    EndKind("export-check-failed", 10, False, True, "failed (export check)",
            "`zerotrain export`: the export's loss differs from the checkpoint's beyond tolerance", command="export"),
    EndKind("hung", 11, False, True, "failed (hung)",
            "a rank made no progress for `--hang-timeout` seconds: stacks in RUN_DIR/hangs/", restartable=True),
    EndKind("oom", 12, False, True, "failed (out of memory)",
            "a rank ran out of device (CUDA) or host memory: one line names the planned and measured peak and what to"
            " change (micro-batch, activation checkpointing, offload); never restarted, it would end the same way"),
    EndKind("hard-signal", 130, False, True, "failed (second signal)",
            "a second signal: exited at once, nothing saved"),
)}


def end_kind(kind: str) -> EndKind:
    """The table's entry for `kind`; a kind not in it is a programming error (ValueError naming the known ones)."""
    try:
        return END_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown end kind {kind!r} (known: {', '.join(END_KINDS)})") from None


def kind_of_exit(code: int) -> str:
    """The end kind an exit code stands for (the first kind with that code: 0 is "finished"); an exit code
    no kind has (a launcher's own, a kill) is a "crash"."""
    return next((e.kind for e in END_KINDS.values() if e.exit_code == code), "crash")


def final_exit_codes() -> list[int]:
    """The exit codes after which a job is never started again (every code of a kind that is not
    restartable); any other code, a kind's or not, is restartable (the sbatch template's requeue)."""
    return sorted({e.exit_code for e in END_KINDS.values() if not e.restartable})


def status_of(kind: str | None) -> str:
    """What `zerotrain runs` shows for a launch that ended as `kind` (a kind this version does not know,
    from a newer one: "stopped (kind)")."""
    return END_KINDS[kind].status if kind in END_KINDS else f"stopped ({kind})"


def exit_status_help(command: str = "train") -> str:
    """`zerotrain train --help`'s exit status paragraph, from the table: each code the command's ends exit
    with (the first kind of a code names it), where a checkpoint is saved, which ends are restarted."""
    codes: dict[int, EndKind] = {}
    for e in END_KINDS.values():
        if e.command == command:
            codes.setdefault(e.exit_code, e)
    words = ", ".join(f"{code} {e.status.partition('(')[2].rstrip(')') or e.status}" for code, e in codes.items())
    saved = ", ".join(str(code) for code, e in codes.items() if e.saves)
    restarted = ", ".join(str(code) for code, e in codes.items() if e.restartable)
    return (f"Exit status: {words}. A checkpoint is saved at {saved}; `zerotrain launch --max-restarts` restarts"
            f" after {restarted}.")


def exit_code_table() -> list[str]:
    """docs/exit-codes.md's table, one row per kind, as the table says it."""
    return ["| code | end kind | meaning |", "|---|---|---|"] + [
        f"| {e.exit_code} | `{e.kind}` | {e.meaning}{' (checkpoint saved)' if e.saves else ''}"
        f"{'; restarted by `--max-restarts`' if e.restartable else ''} |"
        for e in END_KINDS.values()]


# The codes by name, for code that exits without a StopRun (bad input, a second signal, a launcher).
EXIT_USAGE = END_KINDS["usage"].exit_code
EXIT_SIGNAL = END_KINDS["signal"].exit_code
EXIT_SAVE_FAILED = END_KINDS["save-failed"].exit_code
EXIT_GOLDEN = END_KINDS["golden"].exit_code
EXIT_PREFLIGHT_FAILED = END_KINDS["preflight-failed"].exit_code
EXIT_EXPORT_CHECK = END_KINDS["export-check-failed"].exit_code
EXIT_HUNG = END_KINDS["hung"].exit_code
EXIT_OOM = END_KINDS["oom"].exit_code
EXIT_SIGNAL_HARD = END_KINDS["hard-signal"].exit_code
