"""Collectives that ``torch.compile`` puts inside its graphs (DeepCompile's compiled ZeRO).

They are torch's functional collectives: each returns a new tensor and carries its own
autograd rule, so a traced forward holds the all-gather of a shard as a graph node and the
traced backward holds the reduce-scatter of its gradient, with no Python
hook and no graph break. The graph runs them, not :mod:`._ops`: they are not timed, bounded
or written to the trail one by one (the step around them is).

Example:
    >>> in_graph = InGraph(group)
    >>> full = in_graph.gather_rows(shard)        # [world * len(shard)], inside the trace
    >>> w, b = in_graph.scatter_grads(sink, weight, bias)  # sink.grad: this rank's row of
    >>>                                                    # their gradients, summed over ranks
"""
from __future__ import annotations

from typing import Sequence, Tuple

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

    def scatter_grads(self, sink: torch.Tensor, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The ``tensors`` themselves. In backward, once every one of them has its gradient,
        the gradients are laid out rank-major (each flattened, padded and cut into one chunk
        per rank, chunk after chunk in a row per rank) and reduce-scattered (summed) at once:
        this rank's row is ``sink``'s gradient, and the tensors get none. ``sink`` holds one
        row: the sum over the tensors of ``ceil(numel / ranks)`` elements."""
        return _ScatterGrads.apply(self.pg, self.size, sink, *tensors)


def _funcol():
    """torch's functional collectives, imported when first used (they import torch's compiler
    stack, seconds that a process which never compiles would pay at start)."""
    import torch.distributed._functional_collectives as funcol
    return funcol


class _ScatterGrads(torch.autograd.Function):
    """Identity forward; backward packs the gradients (zeros for one that got none) into one
    row per rank, reduce-scatters them and gives this rank's row to the sink."""

    @staticmethod
    def forward(ctx, pg, size: int, sink: torch.Tensor, *tensors: torch.Tensor
                ) -> Tuple[torch.Tensor, ...]:
        ctx.pg, ctx.size = pg, size
        ctx.numels = [t.numel() for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        rows = _pack_rows(grads, ctx.numels, ctx.size)
        mine = rows.reshape(-1) if ctx.pg is None else \
            _funcol().reduce_scatter_tensor(rows.reshape(-1), "sum", 0, ctx.pg)
        return (None, None, mine, *(None for _ in grads))


def _pack_rows(grads: Sequence[torch.Tensor], numels: Sequence[int], size: int) -> torch.Tensor:
    """``[size, sum of chunks]``: each gradient flattened, zero-padded to ``size`` chunks of
    ``ceil(numel / size)`` (at least 1) and cut into them, rank ``r``'s chunks in row ``r``."""
    columns = []
    for grad, numel in zip(grads, numels):
        chunk = max(1, -(-numel // size))
        flat = grad.reshape(-1)
        if chunk * size > numel:
            flat = torch.nn.functional.pad(flat, (0, chunk * size - numel))
        columns.append(flat.view(size, chunk))
    return torch.cat(columns, dim=1)
