"""A parameter's values as the other rooms read and write them, whatever ZeRO-3 keeps of it.

Checkpoints, pretrained weights, full weights and the ``deepspeed`` tree read and write a
parameter's *local* value: the whole parameter, or on a device mesh this rank's
tensor-parallel piece of it (:func:`shardtrain.layout.layout_of` says which). At stages 0-2
that value is the parameter's own data. At stage 3 a partitioned parameter keeps only this
rank's even shard (``layout_of(p).shard``), so reading another range of it, or all of it, is
a gather over its group (a collective: every rank of the group calls), and writing it writes
the shard. These functions are the only way in from outside ``zero/``; how the shard is
stored is ``zero/``'s own business.

Example:
    >>> from shardtrain.zero import values
    >>> flat = values.read_whole(model.fc1.weight)       # at stage 3: gathered (every rank)
    >>> values.write_whole(model.fc1.weight, flat * 0.5)  # each rank keeps its shard
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..layout import layout_of
from ._params import (GatheredParameters, ZeroParamStatus, gather_one, is_partitioned)

__all__ = ["is_partitioned", "read_range", "read_whole", "write_whole", "write_shard",
           "regather", "GatheredParameters"]


def _own(p: torch.Tensor):
    return layout_of(p).shard if is_partitioned(p) else None


def read_range(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this rank's flattened local value: a view of the parameter,
    or of its shard when ``[lo, hi)`` is this rank's shard; any other range of a partitioned
    parameter is gathered (a collective) and copied."""
    own = _own(p)
    if own is None:
        return p.detach().reshape(-1)[lo:hi]
    if (lo, hi) == own:
        return p.ds_tensor[: hi - lo]
    with GatheredParameters([p]):
        return p.ds_full.reshape(-1)[lo:hi].clone()


def read_whole(p: torch.Tensor) -> torch.Tensor:
    """This rank's whole flattened local value (a partitioned parameter is gathered, a
    collective, and copied; any other is a view)."""
    if not is_partitioned(p):
        return p.detach().reshape(-1)
    with GatheredParameters([p]):
        return p.ds_full.detach().reshape(-1).clone()


@torch.no_grad()
def write_whole(p: torch.Tensor, full: torch.Tensor) -> None:
    """Writes this rank's whole local value ``full`` (any shape with the right element
    count, any dtype): into the parameter, or into its shard when partitioned (no
    collective: each rank keeps its own range of ``full``)."""
    own = _own(p)
    if own is None:
        p.data.copy_(full.reshape(p.shape))
        return
    lo, hi = own
    p.ds_tensor[: hi - lo].copy_(full.reshape(-1)[lo:hi])


@torch.no_grad()
def write_shard(p: torch.Tensor, shard: torch.Tensor) -> None:
    """Writes the first elements of this rank's shard of a partitioned parameter (1-D,
    at most the shard's length)."""
    p.ds_tensor[: shard.numel()].copy_(shard)


def regather(params: Iterable[torch.Tensor]) -> None:
    """Partitioned parameters that were gathered while their shards were written (inside a
    ``GatheredParameters`` block, say) are gathered again, so their full value is the new
    one (a collective: every rank has the same ones gathered)."""
    for p in params:
        if is_partitioned(p) and p.ds_status == ZeroParamStatus.AVAILABLE:
            gather_one(p)
