"""Differentiable collectives over a sequence-parallel group.

Each collective's backward is the collective that carries the gradient back to where the
input came from: an all-to-all's is the inverse all-to-all, a summing all-reduce's is a
summing all-reduce (every rank's output depends on every rank's input with weight one).
All communication goes through :mod:`shardtrain.comm`, so it is counted like the rest.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import comm


def _exchange(x: torch.Tensor, group: comm.Group, scatter_dim: int,
              gather_dim: int) -> torch.Tensor:
    """Cuts ``x`` into the group's size pieces along ``scatter_dim``, sends piece r to the
    group's rank r and concatenates the pieces received along ``gather_dim``, in rank order."""
    size = group.size()
    # all_to_all_single splits dim 0: put the destination rank there, pieces contiguous.
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=group)
    # received[r] is rank r's piece, shaped like x with scatter_dim cut by size; the source
    # rank becomes the outer index of gather_dim, so rank 0's piece comes first.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` forward; the inverse exchange (gather and scatter swapped) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: comm.Group, scatter_dim: int,
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: comm.Group, scatter_dim: int,
               gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: ``scatter_dim`` shrinks and ``gather_dim`` grows by the
    group's size. ``x.shape[scatter_dim]`` must be divisible by it (the caller checks, with
    a message that names what the dimension holds)."""
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    assert x.shape[scatter_dim] % group.size() == 0, (x.shape, scatter_dim, group.size())
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; sum of the gradients over the group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, "sum", group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        # Every rank's output is the same sum of every rank's input, so the gradient that
        # reaches a rank's input is the sum of the gradients on all the outputs.
        grad = grad.clone()
        comm.all_reduce(grad, "sum", group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Differentiable sum over ``group`` whose backward sums the gradient over ``group``
    (torch.distributed.nn.functional.all_reduce's rule, through :mod:`shardtrain.comm`)."""
    return _AllReduceSum.apply(x, group)
