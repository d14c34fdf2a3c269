"""What one rank writes, prepared before anything touches the disk.

Staging is where a save refuses: a client_state value that cannot be stored, an optimizer
state that cannot be resharded. It runs on every rank before the first file is written, so a
refusal on any rank leaves the disk as it was.

Each rank stages its even shard ``shard_range(numel, world, rank)`` of every trainable
parameter, of its fp32 master (16-bit modes) and of each per-element optimizer state; rank 0
also the frozen parameters and persistent buffers whole, and meta.json. Every rank stages its
RNG states and its own client_state. On a device mesh the shards are cut from the unsplit
tensors (:mod:`._mesh_values`), so the files are the same whatever mesh wrote them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import comm
from ..state import TrainingParts
from ..layout import shard_range
from . import _engine_state as engine_state
from . import _mesh_values as mesh
from ._client_state import pickle_objects, split_client_state
from ._engine_state import Trainable
from ._format import encode
from ._manifest import describe, elementwise


__all__ = ["Staged", "stage_rank"]


@dataclass
class Staged:
    """What one rank writes, prepared (and validated) before anything touches the disk."""

    tensors: Dict[str, torch.Tensor]
    rank_json: Dict[str, Any]
    meta: Optional[Dict[str, Any]] = None  # rank 0 only
    rank: int = 0
    client_objects: Optional[bytes] = None  # the pickled part of client_state, if any
    # tensor name -> [lo, hi) of the flattened parameter it holds (recorded in the header)
    ranges: Dict[str, List[int]] = field(default_factory=dict)


def stage_rank(parts: TrainingParts, client_state: Dict[str, Any],
               exclude_frozen: bool, copy: bool = False) -> Staged:
    client_json, client_tensors, client_objects = split_client_state(client_state)
    rank = comm.get_rank()
    trainables = engine_state.trainables(parts)
    tensors, ranges = _model_tensors(parts, trainables, exclude_frozen)
    tensors.update({f"client/{k}": v for k, v in client_tensors.items()})
    rng_json, rng_tensors = _rng_state(parts)
    tensors.update(rng_tensors)
    # Device tensors are copied to the CPU now. CPU ones are written from where they are when
    # the save is synchronous (nothing changes them meanwhile), copied when it is not.
    cpu = {k: v.detach().to("cpu", copy=copy).contiguous() for k, v in tensors.items()}
    rank_json = {"rank": rank, "rng": rng_json,
                 "client": {"json": client_json, "tensors": sorted(client_tensors),
                            "objects": sorted(map(str, client_objects))}}
    meta = describe(parts, trainables, exclude_frozen) \
        if rank == 0 or engine_state.pipelined(parts) else None
    return Staged(cpu, rank_json, meta, rank, pickle_objects(client_objects), ranges)


def _model_tensors(parts: TrainingParts, trainables: Dict[str, Trainable],
                   exclude_frozen: bool) -> Tuple[Dict[str, torch.Tensor], Dict[str, List[int]]]:
    """This rank's shards of the trainable parameters; on the first rank of the writers (rank
    0, or each pipeline stage's first), the whole tensors too; and for each, the ``[lo, hi)``
    of the flattened parameter it holds."""
    group = engine_state.writers(parts)
    rank, world = group.rank(), group.size()
    tensors: Dict[str, torch.Tensor] = {}
    ranges: Dict[str, List[int]] = {}
    plain = engine_state.plain_layout(parts)
    keys = {} if plain else mesh.state_keys(parts, trainables)
    for t in trainables.values():
        shard = _trainable_shard(parts, t, world, rank) if plain else \
            _trainable_shard_on_mesh(parts, t, keys.get(t.name, {}), group)
        tensors.update(shard)
        lo, hi = shard_range(engine_state.numel(t.param), world, rank)
        ranges.update({key: [lo, hi] for key in shard})
    # A frozen partitioned, tensor-parallel or expert parameter is gathered: a collective that
    # every rank joins.
    if rank == 0 or engine_state.any_partitioned(parts) or engine_state.any_tp_split(parts) \
            or engine_state.any_split_expert(parts):
        whole = _whole_tensors(parts, trainables, exclude_frozen)
        if rank == 0:
            tensors.update(whole)
            ranges.update({key: [0, value.numel()] for key, value in whole.items()})
    return tensors, ranges


def _trainable_shard(parts: TrainingParts, t: Trainable, world: int,
                     rank: int) -> Dict[str, torch.Tensor]:
    """This rank's even shard of the parameter, its master and its per-element states."""
    lo, hi = shard_range(engine_state.numel(t.param), world, rank)
    if hi <= lo:
        return {}
    assert t.lo <= lo and hi <= t.hi, "a rank's optimizer slice must hold its even shard"
    out = {f"param/{t.name}": engine_state.param_range(t.param, lo, hi)}
    a, b = lo - t.lo, hi - t.lo  # the shard within the optimizer's slice
    if t.has_master:
        out[f"master/{t.name}"] = t.tensor.detach().reshape(-1)[a:b]
    opt = engine_state.optimizer(parts)
    for key, value in (opt.state.get(t.tensor, {}) if opt is not None else {}).items():
        if elementwise(value, t.tensor):
            out[f"optim/{t.name}/{key}"] = value.detach().reshape(-1)[a:b]
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise NotImplementedError(
                f"optimizer state {key!r} of parameter {t.name!r} has shape "
                f"{list(value.shape)}, neither per-element ({list(t.tensor.shape)}) nor scalar: "
                "checkpoints cannot reshard it. Use an elementwise optimizer (Adam, SGD, ...).")
    return out


def _trainable_shard_on_mesh(parts: TrainingParts, t: Trainable, keys: Dict[str, torch.dtype],
                             writers: comm.Group) -> Dict[str, torch.Tensor]:
    """This rank's even shard of the unsplit parameter, master and per-element states, each
    rebuilt from the mesh's slices (collectives every rank joins, whatever its shard); a
    split expert's, for the expert it is on each rank of its expert-parallel group."""
    p, device = t.param, parts.device
    group = engine_state.zero_group(parts, p)
    values = {"param/{}": mesh.local_param(p)}
    if p.dtype != torch.float32:  # an fp32 master on every rank that holds a slice
        values["master/{}"] = mesh.whole_local(t.tensor, t, group, torch.float32, device)
    opt = engine_state.optimizer(parts)
    state = opt.state.get(t.tensor, {}) if opt is not None and t.tensor is not None else {}
    for key, dtype in keys.items():
        values["optim/{}/" + key] = mesh.whole_local(state.get(key), t, group, dtype, device)
    names = engine_state.saved_names(t.name, p)
    out = {}
    for pattern, local in values.items():
        for name, full in zip(names, mesh.over_experts(mesh.unsplit(local, p), p)):
            out[pattern.format(name)] = mesh.even_shard(full, writers).clone()
    return {name: value for name, value in out.items() if value.numel()}


def _whole_tensors(parts: TrainingParts, trainables: Dict[str, Trainable],
                   exclude_frozen: bool) -> Dict[str, torch.Tensor]:
    """Frozen parameters and buffers, written whole by rank 0."""
    out = {}
    if not exclude_frozen:
        for name, p in engine_state.named_params(parts):
            if name not in trainables:
                local = engine_state.param_range(p, 0, engine_state.local_numel(p))
                names = engine_state.saved_names(name, p)  # an expert on each rank's
                for saved, full in zip(names, mesh.over_experts(mesh.unsplit(local, p), p)):
                    out[f"param/{saved}"] = full
    for name, b in engine_state.named_buffers(parts):
        out[f"buffer/{name}"] = b.detach().reshape(-1)
    return out


def _rng_state(parts: TrainingParts) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    as_json = {"python": encode(random.getstate(), "random state"),
               "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                         "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    tensors = {"rng/torch": torch.get_rng_state()}
    device = engine_state.device_rng(parts)
    if device is not None:
        tensors["rng/device"] = device.get_rng_state()
    return as_json, tensors
