"""Ulysses sequence parallelism's groups and the model's shard: DeepSpeed's sequence-parallel unit (the `mpu` the
engine is built with), the all-to-all around attention (timed as the phase "all_to_all" when asked), and the
gradient factor known once the engine is built. Moved here from launcher/components/engine.py, which calls
`sequence_shard` and `with_gradient_factor`; pre-flight's stability stage times `sequence_groups`' exchange.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zerotrain.launcher.components import ds_compat
from zerotrain.modeling.model import SequenceShard, check_sequence_parallel


def sequence_groups(size: int) -> tuple[Any, Callable]:
    """(DeepSpeed's sequence-parallel unit for `size` ranks a row, its groups made once per process; the
    differentiable all-to-all over this rank's sequence-parallel group). The process group must exist."""
    mpu = ds_compat.sequence_parallel_mpu(size)
    return mpu, ds_compat.sequence_all_to_all(mpu.get_sequence_parallel_group())


def sequence_shard(size: int, model_args, exchange_phase: Callable | None = None) -> tuple[Any, SequenceShard]:
    """(the mpu, the model's SequenceShard) for `size` ranks a row, the model checked against it (ValueError);
    `exchange_phase`: a context manager around each exchange (the health check's and the watchdog's phase)."""
    check_sequence_parallel(model_args, size)
    mpu, exchange = sequence_groups(size)
    if exchange_phase is not None:
        exchange = functools.partial(_MeasuredExchange.apply, around=exchange_phase, exchange=exchange)
    return mpu, SequenceShard(size, mpu.get_sequence_parallel_rank(), exchange)


def with_gradient_factor(shard: SequenceShard, engine) -> SequenceShard:
    """The shard with the gradient factor of the reduction DeepSpeed built (known only once the engine is)."""
    return shard._replace(gradient_factor=ds_compat.sequence_parallel_gradient_factor(engine, shard.size))


class _MeasuredExchange(torch.autograd.Function):
    """`exchange(x)` inside `around()` (the health check's and the watchdog's phase "all_to_all"), in forward
    and in backward. A dimension-0 all-to-all is its own adjoint (DeepSpeed's backward of it is the same op on
    the gradient: deepspeed/sequence/layer.py _dim_zero_all_to_all_backward), so backward calls `exchange` on
    the gradient. Both run without grad (an autograd.Function's passes do), so nothing is recorded twice. The
    phase is the host's wall time in the call: the exchange itself on a CPU (gloo returns when it is done);
    on a GPU the time to queue it (not measured)."""

    @staticmethod
    def forward(ctx, x, exchange, around):
        ctx.exchange, ctx.around = exchange, around
        with around():
            return exchange(x)

    @staticmethod
    def backward(ctx, grad):
        with ctx.around():
            return ctx.exchange(grad), None, None
