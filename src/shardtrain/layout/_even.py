"""Even sharding: how ZeRO cuts one flattened tensor over the ranks of a group.

A tensor of ``n`` elements is cut into ``world`` chunks of ``c = ceil(n / world)`` elements
(the last ones shorter or empty); rank ``r`` owns elements ``[r*c, min((r+1)*c, n))``. A
shard is therefore always a contiguous slice of one parameter, which keeps clipping,
checkpoints and any elementwise optimizer simple, and a checkpoint written on one world size
is read on another by byte ranges.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["chunk_size", "shard_range"]


def chunk_size(numel: int, world: int) -> int:
    """Elements of one rank's chunk (at least 1: an empty tensor still has a row)."""
    return max(1, -(-numel // world))


def shard_range(numel: int, world: int, rank: int) -> Tuple[int, int]:
    """This rank's ``[lo, hi)`` of a flattened tensor (empty when it holds nothing)."""
    c = chunk_size(numel, world)
    lo = min(rank * c, numel)
    return lo, min(lo + c, numel)
