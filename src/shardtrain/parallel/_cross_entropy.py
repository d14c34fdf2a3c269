"""Cross-entropy over logits split across the vocabulary, without gathering them.

With the vocabulary split over N ranks, the logits of a batch are N times smaller per rank
than whole; gathering them for the loss would undo that. The loss needs only three numbers
per token from the whole vocabulary: the maximum logit (for a stable exponent), the sum of
the exponentials, and the target's logit (on the one rank that owns the target id). The
first is all-reduced with ``max``, the other two together with one ``sum``.

The gradient is computed locally: ``softmax - one_hot(target)`` on this rank's columns,
which is exact because the softmax's denominator is already the global one.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import comm

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: comm.Group,
                ignore_index: int) -> torch.Tensor:
        x = logits.float()
        peak = x.max(dim=-1).values
        comm.all_reduce(peak, "max", group=group)
        x = x - peak.unsqueeze(-1)
        vocab = x.shape[-1]
        local = labels - group.rank() * vocab
        valid = labels != ignore_index
        mine = valid & (local >= 0) & (local < vocab)
        index = local.clamp(0, vocab - 1)
        target = x.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        exp = x.exp_()
        # One collective for both sums: [sum of exponentials, target logit (0 off its owner)].
        sums = torch.stack([exp.sum(dim=-1), torch.where(mine, target, torch.zeros_like(target))])
        comm.all_reduce(sums, "sum", group=group)
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(target))
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), index, mine, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        softmax, index, mine, valid = ctx.saved_tensors
        # Out of place: the saved softmax must survive a second backward (retain_graph).
        grad = softmax.scatter_add(-1, index.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
        grad = grad * (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor,
                                 group: comm.Group, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """The cross-entropy of logits whose vocabulary is split over ``group``.

    Equal to ``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(), ...)`` of the
    gathered logits, computed in fp32, on every rank of the group; the gradient reaches
    each rank's own slice. Rank r holds vocabulary ids ``[r * V_local, (r + 1) * V_local)``
    (the layout of a column-parallel LM head and a :class:`VocabParallelEmbedding`).

    Args:
        local_logits: ``[..., V_local]``, this rank's slice of the vocabulary.
        labels: ``[...]``, ids of the full vocabulary (``ignore_index`` for none).
        group: the tensor-parallel group the vocabulary is split over.
        ignore_index: labels that contribute neither loss nor gradient.
        reduction: ``"mean"`` (over labels not ignored), ``"sum"`` or ``"none"`` (per token).

    Example:
        >>> local_logits = model(ids)                        # lm_head split, not gathered
        >>> loss = vocab_parallel_cross_entropy(local_logits[:, :-1], ids[:, 1:], mesh.tp)
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction {reduction!r} is not one of "
                         f"{_REDUCTIONS}.")
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(local_logits.shape)} and "
                         f"labels {tuple(labels.shape)} disagree: labels need the logits' shape "
                         "without its last (vocabulary) dimension.")
    labels = labels.to(local_logits.device)
    losses = _VocabParallelCrossEntropy.apply(local_logits, labels, group, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    # A tensor count, not .item(): no host sync (and 0/0 gives nan, as F.cross_entropy does).
    return losses.sum() / (labels != ignore_index).sum().to(losses.dtype)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   group: comm.Group, num_items_in_batch: Optional[torch.Tensor] = None,
                   ignore_index: int = -100,
                   shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Transformers' causal-LM loss (``ForCausalLMLoss``: labels shifted left by one, mean
    over labels not ignored, or a sum divided by ``num_items_in_batch``) on logits split
    over the vocabulary."""
    if logits.shape[-1] * group.size() != vocab_size:
        raise ValueError(f"the loss got logits of width {logits.shape[-1]} on each of "
                         f"{group.size()} ranks for a vocabulary of {vocab_size}: it expects the "
                         "LM head's local (vocabulary-split) logits, not gathered ones.")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(logits, shift_labels, group, ignore_index, reduction)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    return loss
