"""Learning-rate schedules, as the multiplier of the peak lr a torch LambdaLR applies, and what they do on resume.

    cosine (default)  linear warmup, then cosine decay to min_lr at max_steps
    wsd               linear warmup, the peak held (stable), then a linear decay to min_lr over the last
                      `decay_fraction` of max_steps (warmup-stable-decay: MiniCPM, OLMo-core's WSD; Hägele et al.
                      2024 find a 20% linear cooldown matches cosine, hence the default 0.2)

Written here rather than taken from DeepSpeed's WarmupCosineLR because that one trains its first two
optimizer steps at lr 0 (it reports 0 before it has started, then starts warmup from `warmup_min_ratio` at
iteration 0); here step 1 already uses lr / warmup_steps.

Resume. DeepSpeed saves the LambdaLR with the engine, and torch's LambdaLR.state_dict keeps the __dict__ of a
callable-object lambda: a resumed run gets back the plan it was saved with (its length included), not one
built from today's flags. `Schedule.resume(step, max_steps)` (the Trainer calls it after loading) decides, and
says, what happens when --max-steps changed:
- wsd resumed before its decay began: the decay is re-planned for the new --max-steps, from the resume
  point on (that is what the stable phase is for: a run can be extended, or shortened, honestly);
- wsd resumed during its decay, and cosine: the saved plan stays (changing it would move the lr up or down
  abruptly mid-decay); steps past its end train at min_lr, steps before it never reach min_lr, and this is
  said at start, not found in the metrics afterwards.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class Schedule:
    """Multiplier of the peak lr for the optimizer step with 0-based index `s` (step s + 1 of the run).

    The attributes are the state DeepSpeed's checkpoint keeps (LambdaLR saves this object's __dict__ and
    updates it on load); `min_ratio`, `warmup` and `total` are named as in the cosine-only class checkpoints
    written before 0.2 hold, so those load into a cosine Schedule unchanged. `decay_start` D: steps 1..D train
    at or below the peak, steps D+1..total decay, and step `total` (the last) trains at min_lr.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, max_steps: int, kind: str = "cosine",
                 decay_fraction: float | None = None):
        if kind not in ("cosine", "wsd"):
            raise ValueError(f"unknown schedule {kind!r}")
        self.kind, self.min_ratio, self.warmup, self.total = kind, min_lr / lr, warmup_steps, max_steps
        self.decay_fraction = decay_fraction if kind == "wsd" else None
        self.decay_start = self._decay_start(max_steps) if kind == "wsd" else None

    def _decay_start(self, total: int, earliest: int = 0) -> int:
        """The last step before the wsd decay: the decay takes the last decay_fraction of `total` steps (at
        least one), after warmup and not before `earliest`."""
        return max(self.warmup, earliest, total - max(1, round(total * self.decay_fraction)))

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "wsd":
            if s < self.decay_start:
                return 1.0
            progress = min(1.0, (s + 1 - self.decay_start) / max(1, self.total - self.decay_start))
            return 1 - (1 - self.min_ratio) * progress
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def describe(self, lr: float) -> str:
        """One start-up line: what the lr will do, step by step (1-based steps)."""
        warm = f"warmup {self.warmup} step(s) to lr {lr:g}, " if self.warmup else f"lr {lr:g} from step 1, "
        floor = f"{lr * self.min_ratio:g}"
        if self.kind == "wsd":
            steps = (f"steps {self.decay_start + 1}-{self.total}" if self.total > self.decay_start + 1
                     else f"step {self.total}")
            return f"schedule wsd: {warm}held to step {self.decay_start}, then linear decay over {steps} to {floor}"
        return f"schedule cosine: {warm}cosine decay to {floor} at step {self.total}"

    def resume(self, step: int, max_steps: int, lr: float) -> list[str]:
        """After a checkpoint's plan was loaded into this object, at `step` (optimizer steps done): re-plan or
        keep it for the run's --max-steps; the lines say which."""
        if max_steps == self.total:
            return []
        was = f"planned for {self.total} steps"
        if self.kind == "wsd" and step < self.decay_start:
            old_start, self.total = self.decay_start, max_steps
            self.decay_start = self._decay_start(max_steps, earliest=step)
            return [f"schedule wsd {was} (decay after step {old_start}), resumed at step {step} in its stable"
                    f" phase: decay re-planned for --max-steps {max_steps}", self.describe(lr)]
        where = "in its decay" if self.kind == "wsd" else "(a cosine cannot be stretched without moving the lr)"
        if max_steps > self.total:
            then = self._past_plan(lr, max_steps)
        else:
            then = f"the run stops at step {max_steps}, at lr {lr * self(max_steps - 1):g}, before the decay ends"
        return [f"schedule {self.kind} {was}, resumed at step {step} {where}: it keeps its length, so {then}"
                + ("; --schedule wsd can be extended during its stable phase" if self.kind == "cosine" else "")]


    def _past_plan(self, lr: float, max_steps: int) -> str:
        """What steps total+1..max_steps train at, the saved plan kept: its min-lr, unless its warmup is longer
        than the plan itself; then the warmup goes on, the peak, and min-lr after it (said step by step)."""
        if self.warmup <= self.total:
            return f"{_steps(self.total + 1, max_steps)} train at min-lr {lr * self.min_ratio:g}"
        top = min(self.warmup, max_steps)
        parts = [f"{_steps(self.total + 1, top)} go on with its warmup of {self.warmup} steps (longer than the"
                 f" plan) to lr {lr * self(top - 1):g}"]
        s = self.warmup  # past the warmup the plan is already over: a step or two above min-lr, then min-lr
        while s < max_steps and not math.isclose(self(s), self.min_ratio):
            parts.append(f"step {s + 1} at lr {lr * self(s):g}")
            s += 1
        if s < max_steps:
            parts.append(f"{_steps(s + 1, max_steps)} at min-lr {lr * self.min_ratio:g}")
        return ", ".join(parts)


def _steps(first: int, last: int) -> str:
    return f"steps {first}-{last}" if last > first else f"step {first}"


def make_scheduler(cfg):
    """A callable for deepspeed.initialize(lr_scheduler=...): optimizer -> LambdaLR over this run's Schedule.
    `cfg` is resolved (zerotrain.launcher.hparams): lr, min_lr, warmup_steps are concrete."""
    s = cfg.schedule
    schedule = Schedule(s.lr, s.min_lr, s.warmup_steps, s.max_steps, s.shape or "cosine",
                        cfg.schedule.decay_fraction)
    return lambda optimizer: LambdaLR(optimizer, schedule)


def reapply(scheduler) -> None:
    """Set the optimizer's lr to what the (re-planned) schedule says for the step about to be taken: LambdaLR
    wrote the old plan's value into the param groups when it stepped, before the checkpoint was saved."""
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
