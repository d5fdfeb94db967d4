"""The next-token loss, never holding (B, T, V) logits: the cross-entropy of the output projection computed in
chunks of tokens with its gradients (`chunked_next_token_loss`, `chunked_target_loss`), the plain form it equals
(`next_token_loss`, tests/test_chunked_loss.py), the shifted targets and the token-weighted scale of an SFT
loss (`global_token_mean_scale`). modeling/model.py's LMHead calls it; it imports nothing of the model."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the Hugging Face convention for "no loss at this position"


def next_token_loss(logits, labels, reduction: str = "mean"):
    """Cross-entropy of logits[:, :-1] against labels[:, 1:] (-100: no loss), in fp32.

    "mean": over this micro-batch's labelled positions (pretraining: every micro-batch then weighs
    the same). "sum": the sum over them, 0 when there are none, for a loss that is the mean over
    the labelled tokens of the whole global batch (SFT, where micro-batches hold different numbers
    of response tokens): each micro-batch's sum is scaled by `global_token_mean_scale` before the
    DeepSpeed backward.

    This is the definition, on full logits; the model computes the same loss with
    `chunked_next_token_loss` (tests/test_chunked_loss.py holds them equal).
    """
    check_reduction(reduction)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")


def chunked_next_token_loss(hidden, weight, labels, reduction: str = "mean", chunk_tokens: int = 256):
    """`next_token_loss(hidden @ weight.T, labels, reduction)` without the (B, T, V) logits.

    hidden (B, T, D) (the final norm's output), weight (V, D), labels (B, T). The projection and the
    cross-entropy run `chunk_tokens` positions at a time, in fp32 like next_token_loss; when gradients
    are wanted each chunk's gradients are computed right there (softmax minus one-hot, then two
    matmuls: the technique of Liger's fused linear cross-entropy), so nothing of the chunk is kept for
    backward. Memory: one chunk's logits, plus d(hidden) (B*T, D) and an fp32 d(weight) (V, D).
    """
    return chunked_target_loss(hidden, weight, next_token_targets(labels), reduction, chunk_tokens)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the token each position predicts, the next label of its row (the last position
    of a row predicts nothing: IGNORE_INDEX)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def chunked_target_loss(hidden, weight, targets, reduction: str = "mean", chunk_tokens: int = 256, mean_over=None):
    """`chunked_next_token_loss` for targets already shifted (B, T). "mean" divides the sum by `mean_over`
    when given (a tensor: a sequence shard's whole row group's labelled count), else by the labelled
    positions of `targets`."""
    check_reduction(reduction)
    B, T, D = hidden.shape
    targets = targets.reshape(B * T)
    hidden = hidden.reshape(B * T, D)
    mean = reduction == "mean"
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedNextTokenLoss.apply(hidden, weight, targets, mean, chunk_tokens, mean_over)
    return _loss_and_grads(hidden, weight, targets, mean, chunk_tokens, False, False, mean_over)[0]


class _ChunkedNextTokenLoss(torch.autograd.Function):
    """Forward computes the loss and its gradients for an upstream gradient of 1; backward scales them by
    the real one (DeepSpeed's 1/grad_accum, a loss scale, the SFT token scale). The weight is not used in
    backward, so nothing needs it gathered again there. The gradients are saved with save_for_backward
    (not as ctx attributes) so that saved-tensor hooks, and the planner's test through them, see them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mean: bool, chunk_tokens: int, mean_over=None):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        loss, grad_hidden, grad_weight = _loss_and_grads(hidden, weight, targets, mean, chunk_tokens, want_hidden,
                                                         want_weight, mean_over)
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight) if g is not None))
        ctx.wanted, ctx.used = (want_hidden, want_weight), False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:  # the gradients are scaled in place below, so a second pass would be wrong
            raise RuntimeError("backward through the chunked next-token loss twice (retain_graph) is not supported")
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        grad_hidden, grad_weight = (next(saved).mul_(grad_loss) if wanted else None for wanted in ctx.wanted)
        return grad_hidden, grad_weight, None, None, None, None


def _loss_and_grads(hidden, weight, targets, mean: bool, chunk_tokens: int, want_hidden: bool, want_weight: bool,
                    mean_over=None):
    """(loss, d loss/d hidden or None, d loss/d weight or None); hidden (N, D), targets (N,)."""
    N = hidden.shape[0]
    labelled = targets != IGNORE_INDEX  # (N,)
    # mean: 1/labelled tokens, a tensor (no host sync); with none, nan as F.cross_entropy's mean gives
    scale = 1.0 / (labelled.sum() if mean_over is None else mean_over).float() if mean else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    # fp32 accumulation over chunks (each chunk's product is rounded once, like the one full matmul)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    for start in range(0, N, chunk_tokens):
        h, target, keep = (t[start:start + chunk_tokens] for t in (hidden, targets, labelled))
        logits = (h @ weight.t()).float()  # (n, V); in 16-bit rounded first, as the model's logits are
        target = torch.where(keep, target, 0)  # any valid index for the ignored positions; masked below
        target_logit = logits.gather(1, target[:, None])[:, 0]  # (n,), before the logits are overwritten
        # logsumexp written out, in place of the logits: aten's logsumexp computes exactly this (max, exp of
        # the difference, sum, log, + max) but into an (n, V) fp32 temporary of its own, and the softmax then
        # took the same two passes again; here they are made once and the softmax is their result / total
        top = logits.amax(dim=-1)  # (n,)
        exps = logits.sub_(top[:, None]).exp_()  # exp(logits - max), the softmax's numerator
        total = exps.sum(dim=-1)  # (n,)
        loss += ((total.log() + top - target_logit) * keep).sum()
        if not (want_hidden or want_weight):
            continue
        # d loss/d logits = (softmax - one-hot) x the token's weight = (exps - total x one-hot) x weight / total:
        # the one-hot first, then one pass that scales and, in 16-bit, writes the gradient's 16-bit copy (the
        # dtype next_token_loss's .float() hands its gradient back in) without a scaled fp32 copy in between
        exps.scatter_add_(1, target[:, None], -total[:, None])
        per_token = ((keep * scale if mean else keep) / total)[:, None]
        dlogits = exps.mul_(per_token) if h.dtype == exps.dtype else \
            torch.mul(exps, per_token, out=torch.empty(exps.shape, dtype=h.dtype, device=exps.device))
        del logits, exps  # in 16-bit the fp32 chunk is freed before the two products (in fp32 it is dlogits)
        if want_hidden:
            grad_hidden[start:start + chunk_tokens] = dlogits @ weight
        if want_weight:
            if dlogits.dtype == torch.float32:
                grad_weight.addmm_(dlogits.t(), h)
            elif dlogits.device.type != "cpu":  # one kernel: 16-bit products accumulated into the fp32 gradient
                torch.addmm(grad_weight, dlogits.t(), h, out_dtype=torch.float32, out=grad_weight)
            else:  # torch has no CPU kernel for addmm with out_dtype: a (V, D) 16-bit product, then the add
                grad_weight += dlogits.t() @ h
    if mean:
        loss = loss * scale
    return loss, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)


def global_token_mean_scale(grad_accum: int, world: int, global_tokens: int) -> float:
    """The factor for each micro-batch's loss SUM so that DeepSpeed's backward yields the gradient of
    (sum of every token loss of the global batch) / global_tokens.

    `engine.backward(loss)` divides the loss by the gradient-accumulation steps, and the ZeRO
    gradient reduction averages over the data-parallel ranks, so the gradient that reaches the
    optimizer is (1 / (accum x world)) x the sum over all micro-batches of grad(loss). Giving it
    loss = sum_m x accum x world / N makes that sum_m grad(sum_m) / N. `global_tokens` (N: labelled
    tokens in all micro-batches of all ranks, `zerotrain.dataio.pipeline.loader.trainable_tokens`) must be known
    before the first backward: the step's pre-step all-gather carries each rank's count. The
    all-reduced sum of these scaled losses divided by accum x world is then the step's loss.
    """
    if global_tokens <= 0:
        raise ValueError(f"a global batch with {global_tokens} labelled tokens has no loss to average")
    return grad_accum * world / global_tokens
