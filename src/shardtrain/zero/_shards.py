"""The rank-major layout collectives need, over the even shards of
:func:`shardtrain.layout.shard_range` (each parameter cut into ``world`` chunks of
``ceil(n / world)`` elements, rank ``r`` owning chunk ``r``).

Collectives move several parameters at once in a ``[world, row]`` buffer: row ``r`` holds
rank ``r``'s chunk of every parameter of the group (zero-padded to ``c``) side by side, so
a reduce-scatter hands each rank exactly its row, and an all-gather returns all rows.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..layout import chunk_size, layout_of, shard_range

__all__ = ["full_numel", "chunk_size", "shard_range", "ShardLayout"]


def full_numel(p: torch.Tensor) -> int:
    """Elements of this rank's (tensor-parallel) parameter, whole (a ZeRO-3 parameter's own
    data may be empty)."""
    return layout_of(p).local_numel


class ShardLayout:
    """The rank-major layout of one group of parameters.

    Args:
        numels: element count of each parameter.
        world, rank: the data-parallel group.
        extra: columns appended to each row after the parameters (e.g. flags).
    """

    def __init__(self, numels: Sequence[int], world: int, rank: int, extra: int = 0):
        self.world, self.rank = world, rank
        self.numels = list(numels)
        self.chunks = [chunk_size(n, world) for n in self.numels]
        self.offsets: List[int] = []
        offset = 0
        for c in self.chunks:
            self.offsets.append(offset)
            offset += c
        self.params_width = offset
        self.row = offset + extra
        self.slices = [shard_range(n, world, rank) for n in self.numels]

    def pack(self, flats: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        """Writes each flattened tensor into its columns of ``out`` ([world, row]); None
        writes zeros. Padding is zeroed."""
        for i, flat in enumerate(flats):
            region = out[:, self.offsets[i]: self.offsets[i] + self.chunks[i]]
            if flat is None:
                region.zero_()
                continue
            full, rem = divmod(self.numels[i], self.chunks[i])
            c = self.chunks[i]
            region[:full].copy_(flat[: full * c].view(full, c))
            used_rows = full
            if rem:
                region[full, :rem].copy_(flat[full * c:])
                region[full, rem:].zero_()
                used_rows += 1
            if used_rows < self.world:
                region[used_rows:].zero_()

    def unpack(self, gathered: torch.Tensor, flats: Sequence[torch.Tensor]) -> None:
        """Copies each parameter's columns of ``gathered`` ([world, row]) back into it."""
        for i, flat in enumerate(flats):
            c = self.chunks[i]
            region = gathered[:, self.offsets[i]: self.offsets[i] + c]
            full, rem = divmod(self.numels[i], c)
            flat[: full * c].view(full, c).copy_(region[:full])
            if rem:
                flat[full * c:].copy_(region[full, :rem])

    def own(self, row: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's elements of parameter ``i`` within its own ``row`` (1-D view)."""
        lo, hi = self.slices[i]
        return row[self.offsets[i]: self.offsets[i] + (hi - lo)]
