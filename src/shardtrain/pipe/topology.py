"""Process topologies: ranks laid out on named axes, the last axis varying fastest.

DeepSpeed's pipeline scripts describe their mesh with these classes
(``deepspeed.runtime.pipe.topology``); the engine reads the sizes of the ``pipe``, ``data``
and ``model`` axes and builds its :class:`shardtrain.comm.Mesh` in the same rank order.

Example:
    >>> topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    >>> topo.get_rank(pipe=1, data=0, model=1)
    5
    >>> topo.get_coord(5)
    ProcessCoord(pipe=1, data=0, model=1)
"""
from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Dict, List, Sequence

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]


class ProcessTopology:
    """Ranks ``0 .. prod(dims) - 1`` on the axes ``axes`` of sizes ``dims`` (row-major)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"a topology needs one size per distinct axis, got axes {list(axes)} "
                             f"and dims {list(dims)}.")
        if any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"topology sizes must be positive integers, got {list(dims)}.")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping: Dict = {}
        for rank, at in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*at)] = rank
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate (every axis named)."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs every axis of {self.axes}, got "
                             f"{sorted(coord_kwargs)}.")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {self}.")
        return self.mapping[key]

    def get_axis_names(self) -> List[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"),
                      inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``rank``'s coordinate on the axes not omitted, as checkpoint file names carry it
        (``model_01``)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is outside the topology {self} of "
                             f"{self.world_size()} ranks.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> List[List[int]]:
        """The groups of ranks that differ only along ``axis`` (empty for an unknown axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for at in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, at))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> List[int]:
        """The ranks whose coordinate matches every given axis value."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> List[int]:
        """The ranks at position ``idx`` of ``axis``."""
        if axis not in self.axes:
            return []
        return sorted(self.filter_match(**{axis: idx}))

    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(zip(self.axes, self.dims))})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel ranks (data innermost: its gradient all-reduce stays
    on the fast links, the activations cross the slow ones)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel x model (tensor) parallel ranks, model innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
