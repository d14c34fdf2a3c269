"""Collectives that ``torch.compile`` puts inside its graphs (DeepCompile's compiled ZeRO).

They are torch's functional collectives: each returns a new tensor and carries its own
autograd rule, so a traced forward holds the all-gather of a shard as a graph node and the
traced backward holds the reduce-scatter (or all-reduce) of its gradient, with no Python
hook and no graph break. The graph runs them, not :mod:`._ops`: they are not timed, bounded
or written to the trail one by one (the step around them is).

Example:
    >>> in_graph = InGraph(group)
    >>> full = in_graph.gather_rows(shard)        # [world * len(shard)], inside the trace
    >>> w, b = in_graph.sum_grads(weight, bias)   # their gradients summed over ranks at once
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from ._groups import Group

__all__ = ["InGraph"]


class InGraph:
    """The in-graph collectives over ``group``, its process group and size resolved once,
    outside any trace (a world of one: identities)."""

    def __init__(self, group: Group):
        self.size = 1 if group.solo else group.size()
        self.pg = None if self.size == 1 else (group.handle if group.handle is not None
                                               else dist.group.WORLD)

    def gather_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's ``flat`` (one dimension, the same length on each), rank after rank;
        its gradient is the reduce-scatter (sum) of the result's, each rank getting the
        rows of its own."""
        if self.pg is None:
            return flat
        return _funcol().all_gather_tensor_autograd(flat, 0, self.pg)

    def sum_grads(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The ``tensors`` themselves, whose gradients are summed over the group in backward
        by one all-reduce of them all, once every one of them has its gradient (a bucket)."""
        if self.pg is None:
            return tensors
        return _SumGrads.apply(self.pg, *tensors)


def _funcol():
    """torch's functional collectives, imported when first used (they import torch's compiler
    stack, seconds that a process which never compiles would pay at start)."""
    import torch.distributed._functional_collectives as funcol
    return funcol


class _SumGrads(torch.autograd.Function):
    """Identity forward; backward concatenates the gradients (zeros for one that got none),
    all-reduces them at once and hands each its part."""

    @staticmethod
    def forward(ctx, pg, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.pg = pg
        ctx.shapes = [t.shape for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        flat = torch.cat([g.reshape(-1) for g in grads])
        summed = _funcol().all_reduce(flat, "sum", ctx.pg)
        parts = torch.split(summed, [s.numel() for s in ctx.shapes])
        return (None, *(part.view(shape) for part, shape in zip(parts, ctx.shapes)))
