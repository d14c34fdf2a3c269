"""The collectives: each counted by the observers, written into the trail, guarded (a
failure becomes a :class:`~shardtrain.comm.CollectiveError` that says who and where), and
a no-op over a group of one."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _divergence, _timing, _tracing
from ._groups import Group, _global, _handle
from ._process import all_gather_flat, get_rank, get_world_size, reduce_scatter_flat
from ._report import guarded as _guarded

_observers: List[Tuple[Callable[..., None], bool]] = []


def barrier(group: Optional["Group"] = None) -> None:
    if get_world_size(group) > 1:
        _trace("barrier", None, group)
        _guarded("barrier", group, None, lambda: dist.barrier(group=_handle(group)))


class Work:
    """A handle on an asynchronous collective; ``wait()`` is idempotent."""

    def __init__(self, handle=None, then: Optional[Callable[[], None]] = None,
                 op: str = "collective", group: Optional["Group"] = None,
                 tensor: Optional[torch.Tensor] = None, peer: Optional[int] = None):
        self._handle, self._then = handle, then
        self._op, self._group, self._tensor, self._peer = op, group, tensor, peer

    def wait(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _guarded(self._op, self._group, self._tensor, handle.wait, timed=False,
                     peer=self._peer)
            _timing.completed(handle)
        if self._then is not None:
            then, self._then = self._then, None
            then()


def add_observer(fn: Callable[..., None], with_group: bool = False) -> None:
    """Calls ``fn(op_name, tensor)`` for every collective issued (for tests and profiling);
    with ``with_group``, ``fn(op_name, tensor, group)``, ``group`` the :class:`Group` given
    to the collective (None: the world)."""
    _observers.append((fn, with_group))


def remove_observer(fn: Callable[..., None]) -> None:
    _observers[:] = [(f, g) for f, g in _observers if f is not fn]


def _notify(op: str, tensor: torch.Tensor, group: Optional["Group"] = None) -> None:
    for fn, with_group in _observers:
        if with_group:
            fn(op, tensor, group)
        else:
            fn(op, tensor)
    if not _tracing.STATE.off:
        _trace(op, tensor, group)


def _trace(op: str, tensor: Optional[torch.Tensor], group: Optional["Group"]) -> None:
    """Writes the collective into the trail (and checks it in the per-collective mode)."""
    g = _tracing.record(op, tensor, group)
    if g is not None and _divergence.STATE.mode == "collective":
        _divergence.check_group(g, f"before {op} over the {g.name} group")


#: torch's reduction operations, so that ``comm.ReduceOp.SUM`` reads as in DeepSpeed scripts.
ReduceOp = dist.ReduceOp

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def _reduce_op(op) -> "dist.ReduceOp":
    if isinstance(op, str) and op.lower() in _REDUCE_OPS:
        return _REDUCE_OPS[op.lower()]
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        for known in _REDUCE_OPS.values():
            if op == known:
                return known
    raise ValueError(f"all_reduce: op {op!r} is not supported; use one of {', '.join(_REDUCE_OPS)} "
                     "or the matching comm.ReduceOp.")


def all_reduce(tensor: torch.Tensor, op="sum", group: Optional["Group"] = None,
               async_op: bool = False) -> Work:
    """Reduces ``tensor`` in place across the ranks of ``group`` (default: the world): ``op``
    is ``"sum"`` (default), ``"max"``, ``"min"``, ``"product"`` or ``"avg"``, or the matching
    :data:`ReduceOp`. A group of one returns at once."""
    reduce_op = _reduce_op(op)
    handle = _handle(group)
    _notify("all_reduce", tensor, group)
    size = get_world_size(group)
    if size == 1:
        return Work()
    if reduce_op == dist.ReduceOp.AVG and dist.get_backend() != "nccl":  # gloo has no AVG: sum, divide
        work = _guarded("all_reduce", group, tensor, lambda: dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, group=handle, async_op=async_op))
        if not async_op:
            tensor.div_(size)
            return Work()
        return Work(work, then=lambda: tensor.div_(size), op="all_reduce", group=group,
                    tensor=tensor)
    return Work(_guarded("all_reduce", group, tensor, lambda: dist.all_reduce(
        tensor, op=reduce_op, group=handle, async_op=async_op)), op="all_reduce", group=group,
        tensor=tensor)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   group: Optional["Group"] = None) -> Work:
    """Sums ``input`` (one equal row per rank of ``group``, flattened) across the group; the
    rank of group rank r receives row r in ``output``."""
    _notify("reduce_scatter", input, group)
    if get_world_size(group) == 1:
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return Work()
    return Work(_guarded("reduce_scatter", group, input, lambda: reduce_scatter_flat(
        output, input, group=_handle(group), async_op=async_op)), op="reduce_scatter",
        group=group, tensor=input)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
               group: Optional["Group"] = None) -> Work:
    """Concatenates every rank's ``input`` into ``output`` (in the group's rank order)."""
    _notify("all_gather", input, group)
    if get_world_size(group) == 1:
        output.view(-1).copy_(input.view(-1))
        return Work()
    return Work(_guarded("all_gather", group, input, lambda: all_gather_flat(
        output, input, group=_handle(group), async_op=async_op)), op="all_gather",
        group=group, tensor=input)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional["Group"] = None) -> None:
    """``src``'s values (``src`` a rank of ``group``) into ``tensor`` on every rank of it."""
    _notify("broadcast", tensor, group)
    if get_world_size(group) > 1:
        _guarded("broadcast", group, tensor,
                 lambda: dist.broadcast(tensor, src=_global(group, src), group=_handle(group)))


def scatter(output: torch.Tensor, rows: Optional[torch.Tensor], src: int = 0,
            async_op: bool = False, group: Optional["Group"] = None) -> Work:
    """Rank ``src`` (of ``group``) sends row r of ``rows`` (``[size, n]``, read on ``src``
    only; None elsewhere) to the group's rank r, which receives it in ``output``."""
    _notify("scatter", output, group)
    if get_world_size(group) == 1:
        output.view(-1).copy_(rows[0].view(-1))
        return Work()
    chunks = list(rows.unbind(0)) if get_rank(group) == src else None
    return Work(_guarded("scatter", group, output, lambda: dist.scatter(
        output, chunks, src=_global(group, src), group=_handle(group), async_op=async_op)),
        op="scatter", group=group, tensor=output)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      group: Optional["Group"] = None,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None) -> None:
    """Splits ``input`` along dim 0 into the group's size parts (equal ones, or of
    ``input_split_sizes`` rows) and sends part r to the group's rank r; ``output`` receives
    the parts from every rank in rank order (of ``output_split_sizes`` rows, when uneven)."""
    _notify("all_to_all", input, group)
    if get_world_size(group) == 1:
        output.copy_(input)
        return
    _guarded("all_to_all", group, input, lambda: dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=_handle(group)))


def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
    """Sends ``tensor`` to global rank ``dst`` without waiting (point to point: only ``dst``
    takes part, with a matching :func:`recv`); ``wait()`` before changing the tensor. Sends
    to one rank with one tag arrive in the order they were issued."""
    _notify("send", tensor, None)
    return Work(_guarded("send", None, tensor, lambda: dist.isend(tensor, dst, tag=tag),
                         peer=dst), op="send", tensor=tensor, peer=dst)


def recv(tensor: torch.Tensor, src: int, tag: int = 0) -> None:
    """Receives into ``tensor`` what global rank ``src`` sends with :func:`send` (waits, within
    the collective timeout)."""
    _notify("recv", tensor, None)
    _guarded("recv", None, tensor, lambda: dist.recv(tensor, src, tag=tag), peer=src)


def irecv(tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
    """Posts a receive into ``tensor`` of what global rank ``src`` sends with :func:`send`;
    ``wait()`` (within the collective timeout) before reading it."""
    _notify("recv", tensor, None)
    return Work(_guarded("recv", None, tensor, lambda: dist.irecv(tensor, src, tag=tag),
                         peer=src), op="recv", tensor=tensor, peer=src)


def all_gather_object(obj, group: Optional["Group"] = None) -> list:
    """Gathers one picklable object from every rank of ``group`` (small metadata only)."""
    size = get_world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    _trace("all_gather_object", None, group)
    _guarded("all_gather_object", group, None,
             lambda: dist.all_gather_object(out, obj, group=_handle(group)))
    return out


def broadcast_object(obj, src: int = 0, group: Optional[Group] = None):
    """Sends rank ``src``'s (of ``group``) picklable object to every rank of the group
    (small metadata only)."""
    if get_world_size(group) == 1:
        return obj
    box = [obj]
    _trace("broadcast_object", None, group)
    _guarded("broadcast_object", group, None, lambda: dist.broadcast_object_list(
        box, src=_global(group, src), group=_handle(group)))
    return box[0]


def broadcast_coalesced(tensors: List[torch.Tensor], src: int = 0,
                        chunk_numel: int = 64 * 1024 * 1024,
                        group: Optional[Group] = None) -> None:
    """Broadcasts many tensors in place from ``src`` (a rank of ``group``) with one
    collective per dtype chunk."""
    if get_world_size(group) == 1 or not tensors:
        return
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        chunk: List[torch.Tensor] = []
        size = 0
        for t in same + [None]:
            if t is None or (chunk and size + t.numel() > chunk_numel):
                _broadcast_flat(chunk, src, group)
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel()


def _broadcast_flat(chunk: List[torch.Tensor], src: int, group: Optional[Group]) -> None:
    if not chunk:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    broadcast(flat, src, group)
    offset = 0
    with torch.no_grad():
        for t in chunk:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


