"""--eval-tasks: lm-evaluation-harness tasks scored with the live model every --eval-tasks-every steps and at the
last step of a run that ends normally (`due`; components/tasks/: every rank scores its share; lm-eval's metrics,
the same on every rank).

The scores ride on the step's record (metrics.jsonl `eval: {TASK: {METRIC: value}}`, the sinks' scalars
`eval/TASK/METRIC`) with `eval_tasks_s`, the time in its own phase ("eval_tasks": the health window's time
shares); rank 0 writes every example's log-likelihoods to RUN_DIR/eval_tasks/step_NNNNNNNN.json. With
--best-by TASK/METRIC the score, not the validation loss, decides the K best (best.json, --keep-best).
"""
from __future__ import annotations

import time
from pathlib import Path

from zerotrain import durable
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import Participant, Run, StepState


class EvalTasks(Participant):
    name = "eval_tasks"
    reads = ("last", "agreed", "ending")  # step.final: after EarlyStop, which says whether this step ends the run
    writes = ("scores", "new_best", "best_value")

    def __init__(self, tasks, lm, every: int, limit: int | None, *, clock: PhaseClock, is_main: bool, run_dir: Path,
                 checkpointer, best_by: str | None):
        self.tasks, self.lm, self.every, self.limit = tasks, lm, every, limit
        self.clock, self.is_main, self.run_dir = clock, is_main, run_dir
        self.checkpointer, self.best_by = checkpointer, best_by

    @classmethod
    def from_run(cls, run: Run) -> "EvalTasks | None":
        plan = run.plan
        if plan.eval_tasks is None:
            return None
        from zerotrain.launcher.components.tasks.lm import LiveLM  # lm_eval: the optional extra (checked at start-up)

        # the model's length, as lm-eval's HF model reads it from the export (max_position_embeddings)
        lm = LiveLM(run.engine, plan.tokenizer, max_length=plan.model_args.max_seq_len,
                    micro_batch=plan.ds_config["train_micro_batch_size_per_gpu"], dp_rank=plan.data_rank,
                    dp_world=plan.data_world, sequence_parallel=plan.sequence_parallel, device=run.engine.device,
                    quiet=not run.is_main)
        return cls(plan.eval_tasks, lm, plan.eval_tasks_every, plan.settings.eval_limit, clock=run.clock,
                   is_main=run.is_main, run_dir=plan.run_dir, checkpointer=run.checkpointer,
                   best_by=plan.settings.best_by)

    def due(self, step: StepState) -> bool:
        """Every --eval-tasks-every steps, and at the last step of a run that ends normally (--max-steps, an early
        stop, the data ran out: `step.final`). Not at a signal's or a budget's stop: a scoring takes as long as
        the tasks make it, and those stops must come within the grace or the budget's reserve (the last save's
        time); the last scored step stands (docs/evaluation.md)."""
        return step.final or bool(self.every and step.step % self.every == 0)

    def observe(self, step: StepState) -> None:
        if not self.due(step):
            return
        t0 = time.time()
        with self.clock.phase("eval_tasks"):
            metrics, samples = self.score()
        step.scores = {"eval": metrics, "eval_tasks_s": round(time.time() - t0, 3)}
        if self.is_main:
            (self.run_dir / "eval_tasks").mkdir(exist_ok=True)
            durable.write_json(self.run_dir / "eval_tasks" / f"step_{step.step:08d}.json",
                               {"step": step.step, "limit": self.limit, "metrics": metrics, "samples": samples})
        if self.best_by:
            task, _, metric = self.best_by.rpartition("/")
            value = metrics[task][metric]
            step.new_best, step.best_value = self.checkpointer.would_keep(value), value

    def score(self):
        from zerotrain.launcher.components.tasks.lm import score

        return score(self.tasks, self.lm, self.limit)
