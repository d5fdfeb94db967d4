"""The initial weights: the one rule that sets them (`init_weights`, run by every Transformer built outside
`weights_loaded_after`), the generator it draws from, and what a load of weights needs of it (`drawn` for the
vocabulary rows a checkpoint lacks, `gathered` for a ZeRO-3 partitioned parameter). Imports no model: the
Transformer (modeling/model.py) calls in here."""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch
from torch import nn

from zerotrain import ds_attributes

_WEIGHTS_LOADED_AFTER = contextvars.ContextVar("zerotrain_weights_loaded_after", default=False)


@contextlib.contextmanager
def weights_loaded_after():
    """Transformers built inside draw no initial weights (`init_weights` is not run): every parameter is written
    next by a checkpoint's load: a resume's, or --init-from's (hf.load_weights: a checkpoint's vocabulary is not
    padded, so the file holds every value). init_weights draws every value on the CPU in fp32 and, at ZeRO-3, gathers
    each parameter to do it: 5.6 s for the 1.4B model on one CPU core (2026-11-28), ~10x that for 13B, on every rank
    at every restart, for values the load overwrites. The modules' own constructors (nn.Linear's default init) still
    run: the global RNG stream after construction is the one a fresh run has."""
    token = _WEIGHTS_LOADED_AFTER.set(True)
    try:
        yield
    finally:
        _WEIGHTS_LOADED_AFTER.reset(token)


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """The one place weights are initialised (deterministic under torch.manual_seed).

    Normal(0, init_std) for embeddings and projections; the two residual projections of
    each block (attention o_proj, MLP down_proj) are scaled by 1/sqrt(2 * n_layers) so the
    residual stream's variance does not grow with depth; norms start at 1.
    Every value is drawn on the CPU, in fp32, from a generator of its own seeded with the seed of
    torch.manual_seed (`init_generator`), then copied into the parameter (cast to its dtype on its
    device): under `deepspeed.zero.Init` the parameters live on cuda:LOCAL_RANK in bf16, and
    drawing there (the CUDA generator, in bf16) would start ZeRO-3 from other weights than ZeRO-2,
    whose model is built on the CPU in fp32. A ZeRO-3 partitioned parameter is gathered, set on
    rank 0 and scattered back. So every ZeRO stage and device starts from the same weights for a seed.
    A model on the meta device (shapes only: modeling/hf.py expected_shapes, the planner) has no values to set:
    nothing is drawn (drawing a 1.4B model's values on the CPU took 12 s and 5.6 GB for each shape check).
    """
    if all(p.is_meta for p in model.parameters()):
        return
    std = model.args.init_std
    resid_std = std / math.sqrt(2 * model.args.n_layers)
    generator = init_generator()
    for name, p in model.named_parameters():
        with gathered(p):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                scale = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(drawn(p.shape, scale, generator))


def drawn(shape, std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std) values of `shape` on the CPU in fp32, from `generator`: every initial value init_weights sets."""
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


def init_generator() -> torch.Generator:
    """The CPU generator init_weights draws from: seeded with torch.initial_seed() (torch.manual_seed's
    seed), so that neither the device the parameters live on nor what the modules' own constructors
    drew before it changes the weights."""
    return torch.Generator(device="cpu").manual_seed(torch.initial_seed())


def gathered(p):
    """Context in which a ZeRO-3 partitioned parameter is whole, and rank 0's writes to it are kept."""
    if ds_attributes.is_partitioned(p):
        import deepspeed

        return deepspeed.zero.GatheredParameters([p], modifier_rank=0)
    return contextlib.nullcontext()


def first_nonfinite(model: nn.Module) -> str | None:
    """The name of the first parameter whose values this rank holds (its ZeRO-3 partition, else all of it) that
    has a NaN or an infinity; None when all are finite. One pass over the rank's weights."""
    for name, p in model.named_parameters():
        if not torch.isfinite(ds_attributes.held(p).detach()).all():
            return name
    return None


def drawing() -> bool:
    """Whether a Transformer built now sets its initial weights (False inside `weights_loaded_after`)."""
    return not _WEIGHTS_LOADED_AFTER.get()
