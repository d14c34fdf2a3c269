"""A model's full weights, one module at a time, and files written as they arrive.

At ZeRO stage 3 no rank holds the whole model, and none should have to in order to save it.
:func:`iter_full_weights` walks the tensors of ``module.state_dict()`` module by module; a
module's partitioned parameters are gathered (a collective: every rank iterates) while the
caller uses them, and released before the next module's are gathered. So a save adds at most
one module's parameters to the device memory of any rank, whatever the model's size.

:func:`save_full_weights` writes them to one file from rank 0. A safetensors file is written
as the tensors arrive: its header (names, dtypes, shapes, offsets) is known before any tensor
is gathered, so rank 0's host holds one tensor at a time, never the model. A ``torch.save``
file cannot be written that way (a pickle needs every tensor at once), so rank 0 holds the
whole model on the host for it.

With tensor parallelism, a split parameter (``layout_of(p).tp``) is also joined from the slices of
its tensor-parallel group (one all-gather), so the names and shapes are the unsplit model's.
So are the experts of a mixture-of-experts layer split over ranks (``layout_of(p).expert``):
stacked experts are joined along their first dimension over the expert-parallel group, and a
layer's expert modules are gathered over it and yielded under their global names.

Example:
    >>> for names, tensor in iter_full_weights(engine.module):   # on every rank
    ...     if rank == 0:
    ...         print(names, tensor.shape)
    >>> save_full_weights(engine.module, "out/model.safetensors")  # on every rank
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from . import comm
from .files import Layout, atomic_path, fsync_dir, header_bytes, tensor_bytes, write_weights
from .layout import layout_of
from .zero.values import GatheredParameters, is_partitioned

__all__ = ["iter_full_weights", "save_full_weights", "full_state_dict"]

Entry = Tuple[List[str], torch.Tensor]  # the state_dict names of one tensor, and the tensor

def _entries(module: torch.nn.Module, exclude: Set[str]) -> List[Entry]:
    """Every distinct tensor of ``module.state_dict()`` with all of its names (tied weights
    share one tensor), without gathering anything."""
    by_id: Dict[int, Entry] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if name in exclude or not isinstance(value, torch.Tensor):
            continue
        by_id.setdefault(id(value), ([], value))[0].append(name)
    return list(by_id.values())


def _by_module(module: torch.nn.Module, entries: List[Entry]) -> List[List[Entry]]:
    """The entries grouped by the module that owns each tensor, in module order."""
    owner: Dict[int, int] = {}
    for index, m in enumerate(module.modules()):
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                owner.setdefault(id(t), index)
    groups: Dict[int, List[Entry]] = {}
    for entry in entries:
        groups.setdefault(owner.get(id(entry[1]), -1), []).append(entry)
    return [groups[k] for k in sorted(groups)]


def iter_full_weights(module: torch.nn.Module, exclude: Iterable[str] = ()) -> Iterator[Entry]:
    """Yields ``(names, full tensor)`` for each distinct tensor of ``module.state_dict()``
    (names not in ``exclude``). At stage 3 every rank must iterate to the end: a module's
    partitioned parameters are gathered while its tensors are yielded, then released.
    A yielded tensor is valid until the next one is requested; copy what you keep."""
    for group in _by_module(module, _entries(module, set(exclude))):
        params = [t for _, t in group if is_partitioned(t)]
        with GatheredParameters(params):  # nothing to gather at stages 0-2
            for names, tensor in group:
                split = layout_of(tensor).expert
                if split is None or split.stacked:
                    yield names, _joined(tensor.detach(), tensor)
                    continue
                for r, value in enumerate(_over_experts(tensor.detach(), tensor)):
                    yield [split.global_name(n, r) for n in names], value


def _over_experts(value: torch.Tensor, param: torch.Tensor) -> List[torch.Tensor]:
    """An expert module's parameter as each rank of its expert-parallel group holds it (each
    another expert), in rank order: a collective over that group."""
    ep = layout_of(param).expert_groups[0]
    rows = torch.empty((ep.size(),) + tuple(value.shape), dtype=value.dtype, device=value.device)
    comm.all_gather(rows.view(-1), value.contiguous().view(-1), group=ep)
    return list(rows.unbind(0))


def _joined(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tensor-parallel slice (a collective over its group); any other
    tensor as it is."""
    layout = layout_of(param)
    spec = layout.tp
    if spec is not None:
        group = layout.tp_group
        flat = torch.empty(group.size() * value.numel(), dtype=value.dtype, device=value.device)
        comm.all_gather(flat, value.contiguous().view(-1), group=group)
        value = spec.join(list(flat.view(group.size(), *value.shape).unbind(0)))
    if layout.expert is not None and layout.expert.stacked:  # every rank's experts, in order
        return torch.cat(_over_experts(value, param))
    return value


def _full_shape(t: torch.Tensor) -> List[int]:
    """The shape of the unsplit, unpartitioned tensor ``t`` is a slice or shard of."""
    return list(layout_of(t).full_shape)


def full_state_dict(module: torch.nn.Module, exclude: Iterable[str] = (),
                    rank: Optional[int] = 0) -> Optional[Dict[str, torch.Tensor]]:
    """The full weights as host tensors on ``rank`` (every rank when None), None on the
    others; device memory grows by at most one module's parameters. Tied names share one
    tensor. Every rank must call it."""
    keep = rank is None or comm.get_rank() == rank
    out: Dict[str, torch.Tensor] = {}
    for names, tensor in iter_full_weights(module, exclude):
        if keep:
            host = tensor.to("cpu", copy=True)
            out.update({name: host for name in names})
    return out if keep else None


def save_full_weights(module: torch.nn.Module, path: str, exclude: Iterable[str] = ()) -> None:
    """Writes the full weights to ``path`` from rank 0 (atomically); every rank must call it.
    ``*.safetensors`` is written as the tensors arrive (rank 0 holds one tensor at a time);
    any other name is a ``torch.save`` file of the whole state dict."""
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        state = full_state_dict(module, exclude)
        if comm.get_rank() == 0:
            write_weights(state, path)
        return
    entries = _entries(module, set(exclude))
    if comm.get_rank() != 0:
        for _ in iter_full_weights(module, exclude):
            pass  # this rank's share of every gather
        return
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        stream = _SafetensorsStream(f, _plan(module, entries))
        for names, tensor in iter_full_weights(module, exclude):
            for name in names:
                stream.write(name, tensor)
        stream.finish()
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _plan(module: torch.nn.Module, entries: List[Entry]) -> Layout:
    """Every name's dtype and full shape, in the order :func:`iter_full_weights` yields."""
    plan = []
    for group in _by_module(module, entries):
        for names, t in group:
            split = layout_of(t).expert
            ranks = [None] if split is None or split.stacked else range(split.ep_size)
            plan += [(name if r is None else split.global_name(name, r), t.dtype, _full_shape(t))
                     for r in ranks for name in names]
    return plan


class _SafetensorsStream:
    """A safetensors file whose tensors arrive one by one, in the order of ``plan``: the
    header is written first from the plan; each :meth:`write` appends one tensor's bytes
    after checking it is the next one planned, with the planned dtype and shape."""

    def __init__(self, f, plan: Layout, metadata: Optional[Dict[str, str]] = None):
        self.f, self.plan, self.next = f, list(plan), 0
        f.write(header_bytes(self.plan, metadata or {"format": "pt"}))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        planned, dtype, shape = self.plan[self.next]
        if (name, tensor.dtype, list(tensor.shape)) != (planned, dtype, list(shape)):
            raise RuntimeError(f"safetensors stream: got {name!r} {tensor.dtype} {list(tensor.shape)}, "
                               f"expected {planned!r} {dtype} {list(shape)}")
        # A copy: numpy must not see the gathered storage itself, which is resized away on
        # release (torch refuses to resize a storage numpy has seen).
        self.f.write(tensor_bytes(tensor.detach().to("cpu", copy=True)))
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.plan):
            raise RuntimeError(f"safetensors stream: {len(self.plan) - self.next} planned tensors "
                               "were never written")
