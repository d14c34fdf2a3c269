"""Where each parameter's elements lie in DeepSpeed's flat partitions (pure; no files).

DeepSpeed's ZeRO optimizers keep the fp32 masters and the optimizer states of a param group as
one flat vector, cut across the data-parallel ranks in one of two ways:

* **stages 1-2** (and the bf16 optimizer): the group's parameters are laid end to end, each
  followed by its alignment padding (``param_alignment_paddings``), and the whole is padded at
  its tail so it divides by the world size; rank ``r`` holds the ``r``-th equal piece. The
  padding at the tail is not saved with the masters (``group_paddings`` says how much of each
  rank's piece it is), but it is with the states, so both are cut to the saved master length.
  Concatenating the ranks' pieces gives the group's flat vector, in which parameter ``i``
  starts at the sum of the sizes and paddings before it.
* **stage 3**: every parameter is cut on its own into ``ceil(numel / world)``-element pieces
  (the last rank's padded), exactly as :func:`shardtrain.layout.shard_range` cuts it;
  a rank's flat vector is its pieces of every parameter end to end, in ``param_shapes`` order,
  sub-group after sub-group.

:class:`FlatView` reads such a vector without concatenating it: a range that lies in one
piece is a view of it, and only a range that crosses pieces is copied.
"""
from __future__ import annotations

import math
from typing import Iterator, List, Sequence, Tuple

import torch

from ..layout import chunk_size, shard_range

__all__ = ["FlatView", "group_offsets", "stage3_offsets", "stage3_param"]


class FlatView:
    """Tensors read as one 1-D vector, end to end, without concatenating them.

    Example:
        >>> v = FlatView([torch.arange(3.), torch.arange(3., 5.)])
        >>> v.numel, v.slice(1, 4).tolist()
        (5, [1.0, 2.0, 3.0])
    """

    def __init__(self, parts: Sequence[torch.Tensor]):
        self.parts = [p.reshape(-1) for p in parts]
        self.starts: List[int] = []
        offset = 0
        for part in self.parts:
            self.starts.append(offset)
            offset += part.numel()
        self.numel = offset

    def slice(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)``: a view when one part holds them, else a copy."""
        if not 0 <= lo <= hi <= self.numel:
            raise IndexError(f"[{lo}, {hi}) is outside a flat vector of {self.numel} elements")
        pieces = list(self._pieces(lo, hi))
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            dtype = self.parts[0].dtype if self.parts else torch.float32
            return torch.empty(0, dtype=dtype)
        return torch.cat(pieces)

    def _pieces(self, lo: int, hi: int) -> Iterator[torch.Tensor]:
        for start, part in zip(self.starts, self.parts):
            a, b = max(lo, start), min(hi, start + part.numel())
            if a < b:
                yield part[a - start: b - start]


def group_offsets(numels: Sequence[int], paddings: Sequence[int]) -> Tuple[List[int], int]:
    """Stages 1-2: where each parameter starts in its group's flat vector, and where the last
    one ends (the group's length without its tail padding)."""
    offsets, offset = [], 0
    for numel, padding in zip(numels, paddings):
        offsets.append(offset)
        offset += numel + padding
    end = offsets[-1] + numels[-1] if numels else 0
    return offsets, end


def stage3_offsets(numels: Sequence[int], world: int) -> Tuple[List[int], int]:
    """Stage 3: where each parameter's piece starts in every rank's flat vector, and that
    vector's length (the same on every rank)."""
    offsets, offset = [], 0
    for numel in numels:
        offsets.append(offset)
        offset += _piece(numel, world)
    return offsets, offset


def _piece(numel: int, world: int) -> int:
    """DeepSpeed's stage-3 piece of a parameter: ``ceil(numel / world)``, 0 for an empty one."""
    return math.ceil(numel / world) if numel else 0


def stage3_param(ranks: Sequence[FlatView], offset: int, numel: int) -> torch.Tensor:
    """A whole flattened parameter from every rank's stage-3 flat vector: rank ``r``'s piece
    starts at ``offset`` and holds ``shard_range(numel, world, r)`` of it (padding dropped)."""
    world = len(ranks)
    assert numel == 0 or chunk_size(numel, world) == _piece(numel, world)
    pieces = []
    for rank, view in enumerate(ranks):
        lo, hi = shard_range(numel, world, rank)
        if hi > lo:
            pieces.append(view.slice(offset, offset + hi - lo))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=ranks[0].slice(0, 0).dtype)
