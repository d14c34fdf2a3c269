"""Whole parameters again after a sharded optimizer step.

At stages 1 and 2 (and for the small parameters stage 3 keeps whole) every rank updates only
its own slice of each parameter. :class:`SliceGatherer` all-gathers the updated slices back
into the full parameters, in groups of at most ``allgather_bucket_size`` elements, all
groups in flight at once.
"""
from __future__ import annotations

from typing import List

import torch

from ..comm import Group
from . import _collectives as coll
from ._buckets import split_into_buckets
from ._shards import ShardLayout, full_numel


class SliceGatherer:
    """Args: ``params`` (whole on every rank), ``gather_numel`` elements per collective,
    and the data-parallel ``group``."""

    def __init__(self, params: List[torch.nn.Parameter], gather_numel: int, group: Group):
        self.group = group
        world, rank = group.size(), group.rank()
        self.groups = [(ps, ShardLayout([full_numel(p) for p in ps], world, rank))
                       for ps in split_into_buckets(params, gather_numel)] if params else []

    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's slices into every parameter (a collective)."""
        flights = []
        for group, layout in self.groups:
            mine = torch.empty(layout.row, dtype=group[0].dtype, device=group[0].device)
            for i, p in enumerate(group):
                lo, hi = layout.slices[i]
                if hi > lo:
                    layout.own(mine, i).copy_(p.data.view(-1)[lo:hi])
            flights.append((group, layout, coll.all_gather_rows(mine, self.group)))
        for group, layout, flight in flights:
            layout.unpack(flight.wait(), [p.data.view(-1) for p in group])
