"""The training step as an object: `StepRunner.step_once(pending, state)` trains the micro-batches every rank agreed
on, fetches the next step's ahead, and gathers once.

Per step there is one small collective besides DeepSpeed's own, and one host sync: an all-gather (`agree`) of each
rank's row of NAMED fields: this step's loss sum, rank 0's gradient norm and the NEXT step's data (ended? error?
batch digest, labelled tokens: fetched ahead so that it rides on the same collective), plus whatever the step's
participants add (participants/base.py: the fields and their layout in the row). Every decision is therefore taken
on the same values on every rank, at the same step.

What the step does not own: the run's counters, save, rollback and resume (run_state.RunState, which this advances
by one step), and the loop that calls it and the participants (launcher/trainer.py). Test faults never appear
here: a planted loss spike wraps `compute` and a slow or failing loader wraps `loader` (components/hooks.py), only
when their ZEROTRAIN_TEST_* variable is set.
"""
from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Callable

import torch

from zerotrain.dataio.format.errors import DataError
from zerotrain.dataio.pipeline.loader import MODEL_KEYS, Batches, batch_digest, trainable_tokens
from zerotrain.launcher.components.observe.phases import PhaseClock, device_done
from zerotrain.launcher.components.participants.base import STEP_FIELDS, Agreed, Layout, Participant, StepState
from zerotrain.launcher.errors import StopRun
from zerotrain.modeling.loss import global_token_mean_scale

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from zerotrain.launcher.components.run_state import RunState


class QuietExit(Exception):
    """Another rank met a data error and says so; this rank leaves without a second message."""


class StepRunner:
    """One rank's step: fetch-ahead, forward/backward/optimizer step over the micro-batches, the step's collective.

    `compute(batches)` is the forward/backward/optimizer step returning the rank's loss sum (a device tensor);
    components/hooks.py may wrap it (ZEROTRAIN_TEST_SPIKE). `loader` may be replaced before the first step
    (pre-flight's sweep plants its own)."""

    def __init__(self, *, engine: DeepSpeedEngine, loader: Batches, clock: PhaseClock, dist, accel, rank: int,
                 world: int, accum: int, data_world: int, sequence_parallel: int, token_weighted: bool,
                 max_steps: int):
        self.engine, self.loader, self.clock, self.dist, self.accel = engine, loader, clock, dist, accel
        self.rank, self.world, self.is_main = rank, world, rank == 0
        self.accum, self.data_world, self.sequence_parallel = accum, data_world, sequence_parallel
        self.token_weighted, self.max_steps = token_weighted, max_steps
        self.compute: Callable[[list], torch.Tensor] = self._train_step
        self.participants: list[Participant] = []
        self.layout = Layout(STEP_FIELDS)
        self.final_loader_state = None  # set when the data runs out: the state before the unfinished step
        self.fetched = self.state_before_fetch = None  # the next step's batches, taken ahead (fetch())
        self.data_wait = 0.0  # seconds this step waited for its batches
        self.step_labelled = 0  # every rank's labelled tokens of this step, each row group counted once

    def attach(self, participants: list[Participant]) -> None:
        """The step's participants: their contributions and named fields ride on the step's gather."""
        self.participants = participants
        self.layout = Layout(STEP_FIELDS + [f for p in participants for f in p.fields()])

    def step_once(self, pending: Agreed, state: RunState) -> StepState:
        """Train the batches every rank agreed on, fetch the next step's, and gather: this step's loss,
        the next step's data and every participant's fields ride on the step's one collective."""
        t0 = time.time()  # step_s: from here to the end of the step's collective, host work included
        lr = self.engine.get_lr()[0]
        batches, tokens_sha = self.accept(pending, state.step)
        loss_sum = self.train_step(batches)
        now = time.time()
        # step_time: until the collective below, the compute and this step's data wait (what the budget's
        # projection of the next step reads in contribute); then the whole step
        step = StepState(state.step + 1, tokens_sha, lr, step_time=now - t0 + self.data_wait, trained_at=now,
                         last=state.step + 1 >= self.max_steps)
        # The next step's batches are taken now, so that their agreement rides on this step's one
        # collective with the loss and the participants' fields (none after the last step).
        ahead = self.fetch() if not step.last else {}
        step.fetched_at = time.time()
        values = {k: v for p in self.participants for k, v in p.contribute(step).items()}
        step.agreed = self.agree({**ahead, **values, "loss_sum": loss_sum})
        # with sequence parallelism each rank's loss is its share of its row group's: the sum over the ranks
        # counts every row group once
        step.loss = step.agreed["loss_sum"] / (self.accum * self.data_world)
        step.grad_norm = step.agreed["grad_norm"]
        # The whole step: its compute, the next step's batches (fetched here, so a slow loader shows), the
        # participants' fields and the collective with its one host sync. tokens/s and MFU count this, not the
        # device's share alone (evaluations and saves are their own phases, after it).
        step.step_time = time.time() - t0
        state.advance()
        self.clock.set_step(state.step)
        return step

    def fetch(self) -> dict:
        """Take this rank's micro-batches for the next step; returns what the other ranks must know of
        them (data ended? data error? batch digest, labelled tokens) for the step's collective."""
        # The state a checkpoint taken before these batches are trained must record (0.2-0.4 ms on the
        # demo mix, measured; the collective this fetch-ahead folds away cost 2-3 ms on 2 gloo ranks).
        self.state_before_fetch = self.loader.state_dict()
        error = None
        try:
            with self.clock.phase("data"):
                batches = [self.loader.next() for _ in range(self.accum)]  # every rank: the same count, or all stop
        except DataError as e:  # a bad record met mid-stream (streamed sources), on any rank
            error, batches = e, []
        self.fetched = (batches, error, self.clock.last_stay)  # the data wait: the clock's, not timed twice
        ended = error is None and any(b is None for b in batches)
        digest = 0 if (ended or error) else batch_digest(batches)
        # Each rank's labelled tokens: a token-weighted (SFT) loss needs the global count before the
        # first backward (zerotrain.modeling.loss.global_token_mean_scale).
        labelled = 0 if (ended or error) else sum(trainable_tokens(b) for b in batches)
        return {"data_ended": int(ended), "data_error": int(error is not None), "batch_digest": digest,
                "labelled": labelled}

    def agree(self, values: dict) -> Agreed:
        """The step's one collective: an all-gather of every rank's row of named fields (STEP_FIELDS and
        the participants'), and its one host sync. Returns the fields reduced (participants/base.py
        Layout): the same values on every rank, so every rank takes the same decisions at the same step."""
        with self.clock.phase("agree"):
            return self._agree(values)

    def _agree(self, values: dict) -> Agreed:
        if self.is_main and "loss_sum" in values:  # the same on every rank: one reader suffices
            values = {**values, "grad_norm": self.engine.get_global_grad_norm()}
        mine = self.layout.pack(values, device=self.engine.device)  # the loss: a device-side copy, no sync
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        self.dist.all_gather(every, mine)
        return self.layout.unpack(torch.stack(every).cpu())  # the host sync

    def accept(self, agreed: Agreed, done: int):
        """The fetched micro-batches of step `done` + 1, once every rank's fields say they may be trained; else the
        stop all ranks agree on (a StopRun, a DataError on the rank that met it, QuietExit on the others)."""
        batches, error, self.data_wait = self.fetched
        self.fetched = None
        if error is not None:
            error.any_rank = True  # this rank met it: it prints the run's one line, whatever its rank (exit 2)
            raise error
        if any(agreed["data_error"]):
            raise QuietExit()
        if any(agreed["data_ended"]):
            self.final_loader_state = self.state_before_fetch
            where = f": {self.loader.exhausted!r}" if self.loader.exhausted else " on another rank"
            raise StopRun("data-exhausted", f"data ran out before step {done + 1} (a source with on_exhausted:"
                          f" stop{where})")
        tokens_sha = hashlib.blake2b(b"".join(int(d).to_bytes(8, "little") for d in agreed["batch_digest"]),
                                     digest_size=8).hexdigest()
        # each row group's N ranks hold the same rows: its labelled tokens are counted N times
        self.step_labelled = sum(int(n) for n in agreed["labelled"]) // self.sequence_parallel
        if self.step_labelled == 0:  # the same sum on every rank: all stop together, nothing trained
            raise DataError(f"step {done + 1}: the global batch holds no token with a label (nothing to train"
                            " on); the data has records or documents without trainable tokens")
        return batches, tokens_sha

    def loader_state(self) -> dict:
        """The loader's state after the last trained step (the next step's batches may be fetched already)."""
        if self.final_loader_state is not None:
            return self.final_loader_state
        return self.state_before_fetch if self.fetched is not None else self.loader.state_dict()

    def train_step(self, batches) -> torch.Tensor:
        """Forward, backward and optimizer step over the micro-batches; returns the rank-mean loss sum."""
        with self.clock.phase("compute"):
            loss_sum = self.compute(batches)
            device_done(self.accel)  # the device has finished the step before any clock is read
            return loss_sum

    def _train_step(self, batches) -> torch.Tensor:
        # Pretraining mixes: each micro-batch's mean loss, as before (bit-compatible runs). A mix with an
        # SFT source: each micro-batch's loss SUM, scaled so that DeepSpeed's backward (/ accum, mean over
        # ranks) gives the mean over the global batch's labelled tokens.
        scale = None
        if self.token_weighted:
            scale = global_token_mean_scale(self.accum, self.data_world, self.step_labelled)
        device = self.engine.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            # the documents' layout is read from the host's position_ids before the copy, and the copy does not
            # wait (the loader pins the batch on an accelerator): nothing in the forward waits for the host
            documents = self.engine.module.document_layout(batch["position_ids"], device)
            batch = {k: batch[k].to(device, non_blocking=True) for k in MODEL_KEYS}
            batch["documents"] = documents
            loss = self.engine(**batch) if scale is None else self.engine(**batch, loss_reduction="sum") * scale
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.detach().double()
        return loss_sum
