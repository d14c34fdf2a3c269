"""ZeRO-3 parameters: each rank keeps only its shard; the full tensor exists on demand.

A partitioned parameter keeps its Python identity (optimizers, hooks and tied modules
still point at it). Its layout record (:func:`shardtrain.layout.layout_of`: the full shape,
the group it is sharded over, this rank's shard) is what other rooms read; it also gains
DeepSpeed's attributes, for the libraries that read them:

* ``ds_shape``, ``ds_numel``: the full shape and element count (written from the record);
* ``ds_tensor``: this rank's shard (``chunk_size`` elements, zero-padded), 1-D;
* ``ds_status``: ``ZeroParamStatus.AVAILABLE`` while gathered, else ``NOT_AVAILABLE``;
* ``ds_id``: a creation-order number, the same on every rank;
* ``ds_process_group``: the data-parallel :class:`~shardtrain.comm.Group` it is sharded over.

While released, ``param.data`` is an empty tensor of shape ``(0,)`` (so a stray read
fails loudly instead of reading stale memory). The gathered value lives in ``ds_full``,
whose storage is resized to zero bytes on release and back on gather: tensors that autograd
saved during forward (views of the weight, for instance) share that storage, so they free
their memory too and see the right values again once backward re-gathers. That storage has
room for ``world`` whole chunks (``ds_padded``, the first ``ds_numel`` elements of which are
``ds_full``), so an all-gather can write every rank's chunk straight into it.
"""
from __future__ import annotations

import enum
import itertools
from typing import Iterable, List, Optional, Set

import torch

from .. import comm
from ..comm import Group
from . import _collectives as coll
from ..layout import chunk_size, place, shard_range

_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def is_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "ds_tensor", None) is not None


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


@torch.no_grad()
def partition(p: torch.nn.Parameter, group: Group, src: Optional[int] = 0) -> None:
    """Turns a full parameter into a partitioned one over ``group`` (the full value is
    dropped).

    With ``src`` (a rank of ``group``) set, every rank's shard is cut from that rank's value
    (one scatter: each rank receives its own chunk, not the whole tensor), so the shards
    come from the same full tensor even if ranks initialised differently.
    """
    if is_partitioned(p):
        return
    world, rank = group.size(), group.rank()
    full = p.data
    numel, c = full.numel(), chunk_size(full.numel(), world)
    place(p, local_shape=tuple(full.shape), zero_group=group, persistent=False)
    _give_full_storage(p, world, full.dtype, full.device)
    shard = torch.zeros(c, dtype=full.dtype, device=full.device)
    if src is None:
        lo, hi = shard_range(numel, world, rank)
        shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])
    else:
        if rank == src:  # the gathered layout: chunk r is row r, the last chunk zero-padded
            p.ds_padded[:numel].copy_(full.reshape(-1))
            p.ds_padded[numel:].zero_()
        coll.scatter_rows(p.ds_padded.view(world, c), shard, src, group).wait()
    p.ds_tensor = shard
    if getattr(p, "ds_id", None) is None:
        p.ds_id = next(_ids)
    release(p)


def _give_full_storage(p: torch.nn.Parameter, world: int, dtype: torch.dtype,
                       device: torch.device) -> None:
    """A storage of its own for the gathered value, ``world`` chunks long (contents undefined).
    It is resized on release, so nothing else may share it."""
    p.ds_padded = torch.empty(world * chunk_size(p.ds_numel, world), dtype=dtype, device=device)
    p.ds_full = p.ds_padded[: p.ds_numel].view(p.ds_shape)


def adopt(p: torch.nn.Parameter, group: Group) -> None:
    """A partitioned parameter takes the dtype and device the (empty) parameter was given
    after it was partitioned (``zero.Init`` builds, then the engine casts and moves)."""
    if p.ds_process_group.ranks() != group.ranks():
        raise ValueError(
            f"a parameter of shape {tuple(p.ds_shape)} was partitioned by zero.Init over ranks "
            f"{p.ds_process_group.ranks()}, but the engine shards over ranks {group.ranks()} "
            f"(its data-parallel group on this mesh): build the model without zero.Init "
            f"when tensor parallelism is on.")
    world = group.size()
    dtype, device = p.dtype, p.device
    if p.ds_tensor.dtype != dtype or p.ds_tensor.device != device:
        p.ds_tensor = p.ds_tensor.to(device=device, dtype=dtype)
    if p.ds_full.dtype != dtype or p.ds_full.device != device:
        _give_full_storage(p, world, dtype, device)
        release(p)


def release(p: torch.nn.Parameter) -> None:
    p.data = _empty_like(p.ds_full)
    p.ds_full.untyped_storage().resize_(0)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def materialize(p: torch.nn.Parameter) -> torch.Tensor:
    """Gives ``ds_full`` its memory back (contents undefined) and returns the whole storage
    as ``[world, chunk]``: row r is rank r's chunk, the flattened value is its first
    ``ds_numel`` elements."""
    padded = p.ds_padded
    nbytes = padded.numel() * padded.element_size()
    if padded.untyped_storage().nbytes() != nbytes:
        padded.untyped_storage().resize_(nbytes)
    return padded.view(-1, p.ds_tensor.numel())


def mark_available(p: torch.nn.Parameter) -> None:
    p.data = p.ds_full
    p.ds_status = ZeroParamStatus.AVAILABLE


@torch.no_grad()
def gather_one(p: torch.nn.Parameter) -> None:
    """Synchronously all-gathers one partitioned parameter (collective)."""
    # every chunk lands in place
    coll.gather_chunks(materialize(p).view(-1), p.ds_tensor, p.ds_process_group)
    mark_available(p)


@torch.no_grad()
def write_shard_from_full(p: torch.nn.Parameter) -> None:
    """After the full value changed, stores this rank's part of it in the shard."""
    group = p.ds_process_group
    lo, hi = shard_range(p.ds_numel, group.size(), group.rank())
    p.ds_tensor[: hi - lo].copy_(p.ds_full.view(-1)[lo:hi])


class GatheredParameters:
    """Gathers partitioned parameters for the duration of a ``with`` block.

    Args:
        params: a parameter or an iterable of them; parameters that are not ZeRO-3 ones are
            ignored (a block over only plain parameters does nothing). The small ones stage 3
            keeps whole on every rank need no gather; with ``modifier_rank`` they receive
            the modifier's values too.
        modifier_rank: None: read-only (changes are discarded on exit). A rank ``r``: the
            values rank ``r`` holds at exit are stored in every shard (each rank receives
            its own shard; a parameter that stays gathered after the block receives the
            whole value).
        enabled: False makes the block a no-op.

    Example:
        >>> with shardtrain.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        ...     if torch.distributed.get_rank() == 0:
        ...         model.lm_head.weight.copy_(pretrained)
    """

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None,
                 enabled: bool = True):
        del fwd_module  # accepted for DeepSpeed compatibility
        if isinstance(params, torch.Tensor):
            params = [params]
        unique = {id(p): p for p in (params if enabled else [])
                  if is_partitioned(p) or getattr(p, "ds_persist", False)}
        self.params: List[torch.nn.Parameter] = sorted(
            (p for p in unique.values() if is_partitioned(p)), key=lambda p: p.ds_id)
        # Small parameters stage 3 keeps whole on every rank: nothing to gather, but the
        # modifier's values must reach the other ranks' copies too.
        self.whole = [p for p in unique.values() if not is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self._gathered: List[torch.nn.Parameter] = []

    def __enter__(self) -> "GatheredParameters":
        for p in self.params:
            if getattr(p, "ds_status", None) != ZeroParamStatus.AVAILABLE:
                _wait_inflight(p)
            if p.ds_status != ZeroParamStatus.AVAILABLE:
                gather_one(p)
                self._gathered.append(p)
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            if self.modifier_rank is not None:
                leaving = {id(p) for p in self._gathered}
                _store_modified(self.params, leaving, self.modifier_rank)
                for p in self.whole:
                    coll.broadcast(p.data, self.modifier_rank, _group_of(p))
                _refresh_masters(self.params + self.whole)
            for p in self._gathered:
                release(p)
        self._gathered = []


def _store_modified(params: List[torch.nn.Parameter], leaving: Set[int], src: int) -> None:
    """Rank ``src``'s full values become every rank's shard.

    A parameter the block gathered (``id`` in ``leaving``) is released right after, so a
    rank needs only its own shard of them: one scatter sends each rank its shard, where a
    broadcast would send every rank the whole tensor. A parameter that was already whole
    before the block stays whole, so every rank must see the new values: it is broadcast.
    """
    flights = []
    for p in params:
        if id(p) in leaving:
            flights.append((p, _scatter_shard(p, src)))
        else:
            coll.broadcast(p.ds_full, src, p.ds_process_group)
            write_shard_from_full(p)
    for p, flight in flights:
        landed = flight.wait()
        if landed is not p.ds_tensor:  # received on the device, kept in host memory
            p.ds_tensor.copy_(landed)


def _scatter_shard(p: torch.nn.Parameter, src: int) -> coll.Inflight:
    """Starts sending rank ``src``'s chunk r of ``p`` to rank r's shard."""
    rows = p.ds_padded.view(-1, p.ds_tensor.numel())  # row r: rank r's chunk
    if p.ds_process_group.rank() == src:
        p.ds_padded[p.ds_numel:].zero_()  # the last chunk's padding, as partition() leaves it
    here = p.ds_tensor.device == rows.device
    out = p.ds_tensor if here else torch.empty_like(p.ds_tensor, device=rows.device)
    return coll.scatter_rows(rows, out, src, p.ds_process_group)


def _group_of(p: torch.nn.Parameter) -> Group:
    """The group a parameter stage 3 keeps whole is replicated over (the world outside an
    engine)."""
    return getattr(p, "ds_process_group", None) or comm.WORLD


def _refresh_masters(params: List[torch.nn.Parameter]) -> None:
    """Shards written under an engine: its fp32 masters (and offloaded copies) follow, or the
    next step would write the old values back."""
    owners = {id(o): o for p in params for o in [_owner(p)] if o is not None}
    for owner in owners.values():
        owner.weights_written(params)


def _owner(p: torch.nn.Parameter):
    """The stage-3 schedule that manages ``p`` (through its group, or directly for a
    parameter kept whole), or None outside an engine."""
    group = getattr(p, "ds_group", None)
    return group.owner if group is not None else getattr(p, "ds_owner", None)


def _wait_inflight(p: torch.nn.Parameter) -> None:
    group = getattr(p, "ds_group", None)
    if group is not None and p.ds_status == ZeroParamStatus.INFLIGHT:
        group.wait()


def partition_module(module: torch.nn.Module, group: Group,
                     params: Optional[Iterable[torch.nn.Parameter]] = None) -> None:
    for p in (params if params is not None else module.parameters()):
        partition(p, group)
