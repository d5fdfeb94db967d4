"""Evaluation and the K best: every --eval-every-steps all ranks evaluate (evaluate.Evaluator; under ZeRO-3
nobody may skip a forward), and a finite val_loss among the --keep-best K lowest marks the step as one of
the best (saved, listed in best.json and kept from rotation by the checkpointing participant). Which
losses are among the K best is the Checkpointer's (`would_keep`), from rank 0's best.json read on every
rank (the decision to save is collective), again after a rollback."""
from __future__ import annotations

import time

from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import Participant, Run, StepState


class Evaluation(Participant):
    name = "evaluation"
    writes = ("val", "new_best", "best_value")

    def __init__(self, evaluator: Evaluator | None, every: int, engine, *, clock: PhaseClock, checkpointer,
                 chooses_best: bool = True):
        """chooses_best: the validation loss decides the K best (not when --best-by names a task's metric)."""
        self.evaluator, self.every, self.engine, self.chooses_best = evaluator, every, engine, chooses_best
        self.clock, self.checkpointer = clock, checkpointer
        checkpointer.sync_best()

    @classmethod
    def from_run(cls, run: Run) -> "Evaluation":
        return cls(run.evaluator, run.cfg.eval.eval_every_steps, run.engine, clock=run.clock, checkpointer=run.checkpointer,
                   chooses_best=run.plan.best_higher is None)

    def observe(self, step: StepState) -> None:
        if self.evaluator is None or step.step % self.every:
            return
        t0 = time.time()
        with self.clock.phase("eval"):
            val = self.evaluator.evaluate(self.engine, device=self.engine.device)
        val.pop("val_tokens", None)
        val["eval_s"] = round(time.time() - t0, 3)
        step.val = val
        if self.chooses_best:
            step.new_best, step.best_value = self.checkpointer.would_keep(val["val_loss"]), val["val_loss"]

    def rewind(self) -> None:
        self.checkpointer.sync_best()
