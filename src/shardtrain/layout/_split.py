"""How a full tensor is cut into tensor-parallel shards, and put back together.

A :class:`SplitSpec` is pure data: the dimension a parameter is split along and the sizes
of the sub-parameters fused along it. Every sharded parameter's layout record holds one
(:attr:`ParamLayout.tp`), so that code that never saw the model's layers (checkpoints, the
gradient norm, the memory estimator) can tell a shard from a replica and rebuild the full
value.

Fused sub-parameters are split one by one: a ``gate_up_proj`` of ``[gate; up]`` gives each
rank ``[gate piece r; up piece r]``, so the rank's local ``chunk(2)`` still separates gate
from up. Splitting the fused tensor as a whole would hand rank 0 all of ``gate``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

__all__ = ["SplitSpec"]


@dataclass(frozen=True)
class SplitSpec:
    """How a full tensor is split over the ranks of a tensor-parallel group.

    Along ``dim``, the full tensor is the concatenation of ``parts`` (the full sizes of the
    fused sub-parameters: one part for a plain weight). Each part is cut into N equal
    contiguous pieces; rank r's shard is piece r of every part, concatenated in order.

    Args:
        dim: the dimension split (non-negative).
        parts: the full sizes of the fused sub-parameters along ``dim``; they sum to the
            full tensor's size there.

    Example:
        >>> spec = SplitSpec(0, (4, 2, 2))            # a GQA qkv weight: q, k, v rows
        >>> full = torch.arange(8.0).view(8, 1)
        >>> spec.shard(full, rank=1, size=2).view(-1).tolist()
        [2.0, 3.0, 5.0, 7.0]
        >>> torch.equal(spec.join([spec.shard(full, r, 2) for r in range(2)]), full)
        True
    """

    dim: int
    parts: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"SplitSpec: dim must be a non-negative integer, got {self.dim!r}.")
        parts = tuple(self.parts)
        if not parts or any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in parts):
            raise ValueError(f"SplitSpec: parts must be positive integers (one per fused "
                             f"sub-parameter), got {self.parts!r}.")
        object.__setattr__(self, "parts", parts)  # a list given by a caller becomes a tuple

    @property
    def full_size(self) -> int:
        """The full tensor's size along ``dim``."""
        return sum(self.parts)

    def check(self, size: int) -> None:
        """Raises ValueError unless every part splits into ``size`` equal pieces."""
        for i, part in enumerate(self.parts):
            if part % size:
                which = "" if len(self.parts) == 1 else f"part {i} of {self.parts}, "
                raise ValueError(
                    f"cannot split {which}size {part} along dim {self.dim} into {size} equal "
                    f"tensor-parallel pieces: choose a tensor-parallel size that divides {part}, "
                    f"or keep this parameter replicated (a 'skip' layer spec).")

    def local_shape(self, full_shape: Sequence[int], size: int) -> Tuple[int, ...]:
        """The shape of one rank's shard of a tensor of ``full_shape`` over ``size`` ranks."""
        self._check_full(tuple(full_shape))
        self.check(size)
        shape = list(full_shape)
        shape[self.dim] = self.full_size // size
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` over ``size`` ranks (a new tensor, not a view)."""
        self._check_full(tuple(full.shape))
        self.check(size)
        if not 0 <= rank < size:
            raise ValueError(f"SplitSpec.shard: rank {rank} is outside a group of {size}.")
        pieces, offset = [], 0
        for part in self.parts:
            piece = part // size
            pieces.append(full.narrow(self.dim, offset + rank * piece, piece))
            offset += part
        return torch.cat(pieces, dim=self.dim)

    def join(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in group rank order (inverse of shard)."""
        size = len(shards)
        if size == 0:
            raise ValueError("SplitSpec.join: no shards given; pass one shard per rank.")
        self.check(size)
        expected = self.full_size // size
        for rank, shard in enumerate(shards):
            if shard.dim() <= self.dim or shard.shape[self.dim] != expected:
                raise ValueError(f"SplitSpec.join: shard {rank} has shape {tuple(shard.shape)}; "
                                 f"expected size {expected} along dim {self.dim} for {size} shards "
                                 f"of parts {self.parts}.")
        local = [part // size for part in self.parts]
        split = [s.split(local, dim=self.dim) for s in shards]  # [rank][part]
        return torch.cat([split[r][i] for i in range(len(local)) for r in range(size)],
                         dim=self.dim)

    def _check_full(self, shape: Tuple[int, ...]) -> None:
        if len(shape) <= self.dim or shape[self.dim] != self.full_size:
            raise ValueError(f"SplitSpec: a tensor of shape {shape} does not have size "
                             f"{self.full_size} (parts {self.parts}) along dim {self.dim}.")

