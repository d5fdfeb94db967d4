"""Evaluation and best: every --eval-every-steps all ranks evaluate (evaluate.Evaluator; under ZeRO-3
nobody may skip a forward), and a new lowest finite val_loss marks the step as the best (saved and named
in best.json by the checkpointing participant). The best so far is rank 0's best.json, read on every
rank (the decision to save is collective), again after a rollback."""
from __future__ import annotations

import math
import time
from pathlib import Path

from zerotrain.launcher.components.checkpoints.checkpoint import read_best
from zerotrain.launcher.components.evaluate import Evaluator
from zerotrain.launcher.components.hooks import TestHooks
from zerotrain.launcher.components.observe.phases import PhaseClock
from zerotrain.launcher.components.participants.base import Participant, Run, StepState


class Evaluation(Participant):
    name = "evaluation"

    def __init__(self, evaluator: Evaluator | None, every: int, engine, *, clock: PhaseClock, hooks: TestHooks,
                 rank: int, run_dir: Path, ckpt_dir: Path, dist):
        self.evaluator, self.every, self.engine = evaluator, every, engine
        self.clock, self.hooks, self.rank, self.run_dir = clock, hooks, rank, run_dir
        self.ckpt_dir, self.dist = ckpt_dir, dist
        self.best: dict | None = self.read_best()

    @classmethod
    def from_run(cls, run: Run) -> "Evaluation":
        return cls(run.evaluator, run.cfg.eval_every_steps, run.engine, clock=run.clock, hooks=run.hooks,
                   rank=run.rank, run_dir=run.plan.run_dir, ckpt_dir=run.plan.ckpt_dir, dist=run.dist)

    def observe(self, step: StepState) -> None:
        if self.evaluator is None or step.step % self.every:
            return
        t0 = time.time()
        with self.clock.phase("eval"):
            self.hooks.hang_here(self.rank, "eval", step.step, self.run_dir)
            val = self.evaluator.evaluate(self.engine, device=self.engine.device)
        val.pop("val_tokens", None)
        val["eval_s"] = round(time.time() - t0, 3)
        step.val = val
        step.new_best = self.note_best(step.step, val["val_loss"])

    def note_best(self, step: int, val_loss: float) -> bool:
        """A new lowest validation loss?"""
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best["val_loss"]):
            self.best = {"step": step, "val_loss": val_loss}
            return True
        return False

    def rewind(self) -> None:
        self.best = self.read_best()

    def read_best(self) -> dict | None:
        """best.json as rank 0 sees it, on every rank."""
        best = [read_best(self.ckpt_dir) if self.rank == 0 else None]
        self.dist.broadcast_object_list(best, src=0)
        return best[0]
