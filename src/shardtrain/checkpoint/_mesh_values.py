"""Between this rank's tensors and the unsplit model a checkpoint describes, on a device mesh.

A checkpoint holds every tensor of the unsplit model, cut into even shards over the saving
world, so it loads on any mesh. A split expert's parameter is one of several experts under one
name (each rank of its expert-parallel group holds another): saving gathers them over that
group and writes each under its expert's name in the unsplit model.

Without a mesh a rank's optimizer slice *is* its even shard (:mod:`._staging` writes it as
it is). On a mesh it is not: the optimizer's slices are spread
over the data-parallel group only, and a tensor-parallel parameter (``layout_of(p).tp``) is one slice
of the unsplit tensor. Saving then rebuilds each unsplit tensor, one at a time, with two
all-gathers (over the data-parallel group, then the tensor-parallel one) and keeps this rank's
even shard of it; loading reads the unsplit tensor and keeps this rank's slice.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from .. import comm
from ..layout import chunk_size, layout_of, shard_range
from ..zero import values
from . import _engine_state as engine_state
from ._engine_state import Trainable
from ._manifest import elementwise

__all__ = ["unsplit", "local_of", "whole_local", "local_param", "state_keys", "read_local",
           "even_shard", "over_experts"]


def unsplit(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The unsplit flattened tensor, from this rank's whole local flattened one (an all-gather
    over the tensor-parallel group of a split parameter, or over the expert-parallel group of
    stacked experts: every rank of it calls)."""
    layout = layout_of(p)
    spec = layout.tp
    if spec is not None:
        group: comm.Group = layout.tp_group
        shape = list(layout.local_shape)
        flat = torch.empty(group.size() * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather(flat, local.contiguous().view(-1), group=group)
        local = spec.join(list(flat.view(group.size(), *shape).unbind(0))).reshape(-1)
    if _stacked(p):  # each rank's experts follow the previous rank's along the first dim
        ep: comm.Group = layout.expert_groups[0]
        flat = torch.empty(ep.size() * local.numel(), dtype=local.dtype, device=local.device)
        comm.all_gather(flat, local.contiguous().view(-1), group=ep)
        return flat
    return local


def over_experts(full: torch.Tensor, p: torch.Tensor) -> List[torch.Tensor]:
    """``[full]``; for a split expert, its value on each rank of the expert-parallel group, in
    rank order (an all-gather over that group: each holds other experts under one name)."""
    groups = layout_of(p).expert_groups
    if groups is None or _stacked(p):
        return [full]
    ep: comm.Group = groups[0]
    rows = torch.empty(ep.size() * full.numel(), dtype=full.dtype, device=full.device)
    comm.all_gather(rows, full.contiguous().view(-1), group=ep)
    return list(rows.view(ep.size(), -1).unbind(0))


def local_of(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's local flattened tensor, from the unsplit flattened one."""
    layout = layout_of(p)
    spec = layout.tp
    if _stacked(p):  # this rank's experts: rows of the stacked tensor
        n = math.prod(layout.full_shape) // layout.expert.ep_size
        full = full[layout.expert.ep_rank * n:(layout.expert.ep_rank + 1) * n]
    if spec is None:
        return full
    group: comm.Group = layout.tp_group
    shape = list(layout.full_shape)
    if _stacked(p):
        shape[0] = layout.expert.num_local
    whole = full.view(shape)
    return spec.shard(whole, group.rank(), group.size()).reshape(-1)


def whole_local(mine: Optional[torch.Tensor], t: Trainable, group: comm.Group,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's whole local flattened tensor of a per-element optimizer value, from the
    even slices ``[lo, hi)`` the ranks of the data-parallel ``group`` hold (an all-gather when
    they are slices; every rank of the group calls, holding a slice or not)."""
    n = engine_state.local_numel(t.param)
    if not t.sharded:
        return mine.detach().reshape(-1).to(device)
    size = group.size()
    c = chunk_size(n, size)
    row = torch.zeros(c, dtype=dtype, device=device)
    if mine is not None and t.hi > t.lo:
        row[: t.hi - t.lo].copy_(mine.detach().reshape(-1))
    rows = torch.empty(size * c, dtype=dtype, device=device)
    comm.all_gather(rows, row, group=group)
    return rows[:n]


def local_param(p: torch.Tensor) -> torch.Tensor:
    """This rank's whole local flattened parameter (at stage 3, gathered over its group: a
    collective)."""
    return values.read_whole(p)


def state_keys(parts, trainables: Dict[str, Trainable]) -> Dict[str, Dict[str, torch.dtype]]:
    """Each trainable's per-element optimizer states, as any rank holds them (a rank whose
    slice of a parameter is empty holds none, yet must join the gathers)."""
    opt = engine_state.optimizer(parts)
    mine: Dict[str, Dict[str, str]] = {}
    for name, t in trainables.items():
        state = opt.state.get(t.tensor, {}) if opt is not None and t.tensor is not None else {}
        mine[name] = {k: str(v.dtype) for k, v in state.items() if elementwise(v, t.tensor)}
    merged: Dict[str, Dict[str, torch.dtype]] = {}
    for seen in comm.all_gather_object(mine):
        for name, keys in seen.items():
            for key, dtype in keys.items():
                merged.setdefault(name, {})[key] = getattr(torch, dtype.split(".")[-1])
    return merged


def read_local(reader, key: str, entry: Dict, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of this rank's local flattened tensor ``key``: a range of the
    saved tensor, or (for a tensor-parallel split parameter) this rank's slice of the whole of it."""
    if _stacked(p) and layout_of(p).tp is None:  # this rank's experts: one range of it
        start = layout_of(p).expert.ep_rank * layout_of(p).local_numel
        return reader.read(key, entry, start + lo, start + hi)
    if layout_of(p).tp is None:
        return reader.read(key, entry, lo, hi)
    return local_of(reader.read(key, entry, 0, engine_state.numel(p)), p)[lo:hi]


def _stacked(p: torch.Tensor) -> bool:
    split = layout_of(p).expert
    return split is not None and split.stacked


def even_shard(full: torch.Tensor, writers: comm.Group = comm.WORLD) -> torch.Tensor:
    """This rank's even shard over ``writers`` (the world, or a pipeline stage) of an unsplit
    flattened tensor."""
    lo, hi = shard_range(full.numel(), writers.size(), writers.rank())
    return full[lo:hi]
