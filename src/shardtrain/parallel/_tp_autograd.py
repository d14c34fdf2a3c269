"""The four conjugate communication steps of tensor parallelism, as autograd functions.

Megatron-LM names the first two f and g: a column-parallel layer's input enters the group
through :func:`copy_to_group` (every rank needs all of it; each rank's gradient covers only
its own columns, so the gradients are summed), and a row-parallel layer's partial output
leaves through :func:`reduce_from_group` (summed forward, the gradient is already whole).
:func:`gather_from_group` and :func:`scatter_to_group` move a tensor between split and whole
along one dimension. Each backward is the forward's adjoint, so gradients stay exact.

Collectives go through :mod:`shardtrain.comm` (the communication observers count them). A
group of one rank makes every function the identity, with no collective at all.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from .. import comm

__all__ = ["copy_to_group", "reduce_from_group", "gather_from_group", "scatter_to_group"]


def _all_reduce_sum(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    # A fresh buffer: the input may be saved for backward or alias a gradient elsewhere.
    out = x.contiguous().clone()
    comm.all_reduce(out, "sum", group=group)
    return out


def _gather(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in group rank order."""
    moved = x.movedim(dim, 0).contiguous()  # the collective concatenates flat buffers
    out = moved.new_empty((group.size() * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved, group=group)
    return out.movedim(0, dim)


def _own_slice(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    size = group.size()
    if x.shape[dim] % size:
        raise ValueError(f"cannot split size {x.shape[dim]} along dim {dim} over {size} "
                         f"tensor-parallel ranks: make that size a multiple of {size}.")
    local = x.shape[dim] // size
    return x.narrow(dim, group.rank() * local, local).contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return _all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return _own_slice(grad, ctx.group, ctx.dim), None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim), None, None


def copy_to_group(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """``x`` unchanged; in backward, the gradient summed over ``group``.

    Example:
        >>> y = F.linear(copy_to_group(x, mesh.tp), local_weight)   # a column-parallel layer
    """
    return x if group.size() == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """``x`` summed over ``group``; in backward, the gradient passes unchanged.

    Example:
        >>> y = reduce_from_group(F.linear(x_local, local_weight), mesh.tp)   # row-parallel
    """
    return x if group.size() == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (group rank order); in backward, this
    rank's slice of the gradient.

    Example:
        >>> logits = gather_from_group(local_logits, mesh.tp)    # [..., vocab]
    """
    dim = dim % x.dim()
    return x if group.size() == 1 else _GatherFromGroup.apply(x, group, dim)


def scatter_to_group(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim``; in backward, the gradient gathered
    from every rank.

    Example:
        >>> x_local = scatter_to_group(x, mesh.tp)    # input of a row-parallel layer
    """
    dim = dim % x.dim()
    return x if group.size() == 1 else _ScatterToGroup.apply(x, group, dim)
