"""Every collective the ZeRO strategies issue, as free functions.

The strategies decide *what* moves and *when*; these functions only move it. Each starts
one asynchronous collective over the data-parallel group and returns an :class:`Inflight`
whose ``out`` holds the result once :meth:`Inflight.wait` returned. Keeping them apart
from the bookkeeping makes the traffic of a step readable in one place:

* stage 0: :func:`all_reduce_flat` per gradient bucket;
* stages 1-3: :func:`reduce_scatter_rows` per gradient bucket (each rank receives the sum of
  its own row), :func:`all_gather_rows` after the step (and at stage 3 before each use of a
  parameter group);
* :func:`global_norm` and :func:`all_finite`: one all-reduce of a scalar when the gradients are
  sharded;
* outside the step, :func:`broadcast` (rank 0's initial values; a parameter that stays
  gathered after a ``GatheredParameters`` block with a ``modifier_rank``),
  :func:`scatter_rows` (the modifier's values of a parameter that block releases: each rank
  receives only its shard) and :func:`gather_chunks` (one parameter gathered on demand).

Rows follow the rank-major layout of :mod:`._shards`: a ``[world, row]`` buffer whose row
``r`` is rank ``r``'s chunk of every parameter of the group.

Every function takes the data-parallel ``group`` (a :class:`shardtrain.comm.Group`; None is
the world): on a device mesh that is the ``dp`` x ``sp`` group, and ranks are ranks in it.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .. import comm
from ..comm import Group
from ._buckets import local_norm


class Inflight(NamedTuple):
    """An asynchronous collective in flight."""

    work: comm.Work
    out: torch.Tensor
    #: Tensors the backend reads until the collective completes: they must stay alive.
    keep: Tuple[torch.Tensor, ...] = ()

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out


def all_reduce_flat(buffer: torch.Tensor, comm_dtype: Optional[torch.dtype], group: Group
                    ) -> Inflight:
    """Sums ``buffer`` across ranks, sent in ``comm_dtype`` when given. ``out`` is
    ``buffer`` itself, or a ``comm_dtype`` copy the caller copies back."""
    wire = buffer if comm_dtype in (None, buffer.dtype) else buffer.to(comm_dtype)
    return Inflight(comm.all_reduce(wire, "sum", group=group, async_op=True), wire)


def reduce_scatter_rows(rows: torch.Tensor, group: Group, use_reduce_scatter: bool = True
                        ) -> Inflight:
    """Sums ``rows`` ([world, row]) across ranks; ``out`` is this rank's summed row.

    ``use_reduce_scatter=False`` (DeepSpeed's ``reduce_scatter: false``) all-reduces every
    row instead: the same result for twice the traffic.
    """
    if use_reduce_scatter:
        out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        return Inflight(comm.reduce_scatter(out, rows.view(-1), async_op=True, group=group),
                        out, (rows,))
    return Inflight(comm.all_reduce(rows, group=group, async_op=True),
                    rows[comm.get_rank(group)], (rows,))


def all_gather_rows(mine: torch.Tensor, group: Group, device: Optional[torch.device] = None
                    ) -> Inflight:
    """Gathers every rank's ``mine`` (one row, 1-D) into ``out`` ([world, row]) on
    ``device`` (default ``mine``'s)."""
    gathered = torch.empty(comm.get_world_size(group), mine.numel(), dtype=mine.dtype,
                           device=device if device is not None else mine.device)
    work = comm.all_gather(gathered.view(-1), mine, async_op=True, group=group)
    return Inflight(work, gathered, (mine,))


class NormGroups(NamedTuple):
    """Where the parts of the whole model's gradient live."""

    #: Each rank holds distinct slices, over this group (None: every rank holds them all).
    data: Optional[Group] = None
    #: Gradients of tensor-parallel split parameters are slices over this group (None: no tensor
    #: parallelism); the others are the same on each of its ranks.
    tensor: Optional[Group] = None


def global_norm(grads: Sequence[torch.Tensor], device: torch.device, groups: NormGroups,
                split: Sequence[bool] = ()) -> torch.Tensor:
    """L2 norm of the whole model's gradient, the same on every rank.

    Replicated gradients (stage 0) already are the whole gradient on each rank: no
    collective. Sharded ones hold distinct slices, whose squared norms add up across ranks.
    With tensor parallelism, the gradients flagged in ``split`` are slices too, whose squares
    add up over the tensor-parallel group; the others are counted once.
    """
    if _size(groups.tensor) > 1:
        parts = [g for g, s in zip(grads, split) if s]
        whole = [g for g, s in zip(grads, split) if not s]
        squared = torch.stack([local_norm(parts, device).square().to(device),
                               local_norm(whole, device).square().to(device)])
        if _covers_world(groups):  # one collective: the replicated part counted tp times
            comm.all_reduce(squared)
            return (squared[0] + squared[1] / groups.tensor.size()).sqrt()
        comm.all_reduce(squared[:1], group=groups.tensor)
        squared = squared.sum().reshape(1)
    elif groups.data is None:
        return local_norm(grads, device)
    else:
        squared = local_norm(grads, device).square().reshape(1).to(device)
    if groups.data is not None:  # offloaded gradients sit in host memory: reduce on the device
        comm.all_reduce(squared, group=groups.data)
    return squared.sqrt()[0]


def _covers_world(groups: NormGroups) -> bool:
    """Whether the data- and tensor-parallel groups together are the world (a mesh), so that
    one collective over the world replaces one over each."""
    return (_size(groups.data) > 0 and _size(groups.tensor) > 0
            and groups.data.size() * groups.tensor.size() == comm.get_world_size())


def all_finite(grads: Sequence[torch.Tensor], device: torch.device, groups: NormGroups
               ) -> bool:
    """Whether every element of the whole model's gradient is finite, the same answer on
    every rank. A sum is cheaper than a norm (no squares) and as telling: one inf or NaN
    makes it non-finite; slices add their sums across ranks (one scalar)."""
    total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum() if grads \
        else torch.zeros((), device=device)
    # finiteness survives counting a value twice: one collective over a mesh's world
    reductions = [comm.WORLD] if _covers_world(groups) else \
        [g for g in (groups.tensor, groups.data) if _size(g) > 1]
    for group in reductions:
        total = total.reshape(1).to(device)
        comm.all_reduce(total, group=group)
    return math.isfinite(total.item())  # the one host synchronisation of such a step


def _size(group: Optional[Group]) -> int:
    return 0 if group is None else group.size()


def broadcast(tensor: torch.Tensor, src: int, group: Group) -> None:
    """``src``'s values into ``tensor`` on every rank (synchronous)."""
    comm.broadcast(tensor, src, group=group)


def scatter_rows(rows: torch.Tensor, out: torch.Tensor, src: int, group: Group) -> Inflight:
    """Rank ``src``'s row r of ``rows`` ([world, row]) into rank r's ``out`` (one row)."""
    return Inflight(comm.scatter(out, rows, src, async_op=True, group=group), out, (rows,))


def gather_chunks(out: torch.Tensor, mine: torch.Tensor, group: Group) -> None:
    """Every rank's ``mine`` side by side into the flat ``out`` (synchronous)."""
    comm.all_gather(out, mine, group=group)
