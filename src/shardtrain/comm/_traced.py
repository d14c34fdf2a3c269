"""Collectives that ``torch.compile`` puts inside its graphs (DeepCompile's compiled ZeRO).

They are torch's functional collectives: each returns a new tensor and carries its own
autograd rule, so a traced forward holds the all-gather of a shard as a graph node and the
traced backward holds the reduce-scatter (or all-reduce) of its gradient, with no Python
hook and no graph break. The graph runs them, not :mod:`._ops`: they are not timed, bounded
or written to the trail one by one (the step around them is).

Example:
    >>> in_graph = InGraph(group)
    >>> full = in_graph.gather_rows(shard)        # [world * len(shard)], inside the trace
    >>> w = in_graph.sum_grad(weight)             # the gradient of w is summed over ranks
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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
        return funcol.all_gather_tensor_autograd(flat, 0, self.pg)

    def sum_grad(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, whose gradient is all-reduced (summed) in backward."""
        if self.pg is None:
            return tensor
        return _SumGrad.apply(tensor, self.pg)


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient is summed over the process group's ranks."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, pg) -> torch.Tensor:
        ctx.pg = pg
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.pg), None
