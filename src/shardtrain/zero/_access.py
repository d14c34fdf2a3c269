"""ZeRO-3 partitioned parameters read outside their module's forward, and in ``state_dict``.

A module that owns partitioned parameters gets a subclass of its own class (made once per
class) whose ``__getattr__`` asks the schedule to gather a partitioned parameter that is
read outside the forward of a module that owns it (a tied head used in a custom loss, a
parent reading a child's weight), and whose ``_save_to_state_dict``/``_load_from_state_dict``
gather the module's groups so that ``state_dict()`` holds full values and
``load_state_dict()`` writes full values into the shards (``state_dict()`` reads groups that
are whole already, inside ``GatheredParameters``, without gathering; with
:func:`set_state_dict_gather` off it gathers nothing, as DeepSpeed's). The handle returned by
:func:`install` puts the original class back.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ._params import ZeroParamStatus, is_partitioned, write_shard_from_full

_ACCESS_CLASSES: Dict[type, type] = {}
_STATE_CLASSES: Dict[type, type] = {}


class ClassSwap:
    """Removable handle of :func:`install`: restores the module's original class."""

    def __init__(self, module: torch.nn.Module, original: type):
        self.module, self.original = module, original

    def remove(self) -> None:
        if getattr(type(self.module), "_zero_access_class", False):
            self.module.__class__ = self.original
            self.module.__dict__.pop("_zero_units", None)


def install(m: torch.nn.Module, units: Any, on_access: bool = True) -> ClassSwap:
    """Gives ``m`` the gathering subclass of its class. ``units`` answers ``of(m)`` (the
    module's groups). ``on_access=False`` leaves attribute reads alone (a module inside a
    compiled block: its block's unit is gathered around it) and only gathers for
    ``state_dict``."""
    original = getattr(type(m), "_zero_original_class", type(m))
    table = _ACCESS_CLASSES if on_access else _STATE_CLASSES
    if original not in table:
        members = {"_save_to_state_dict": _zero_save, "_load_from_state_dict": _zero_load,
                   "_zero_access_class": True, "_zero_original_class": original,
                   "__module__": original.__module__, "__qualname__": original.__qualname__}
        if on_access:
            members["__getattr__"] = _zero_getattr
        table[original] = type(original.__name__, (original,), members)
    m.__class__ = table[original]
    m._zero_units = units
    return ClassSwap(m, original)


def _zero_getattr(self, name: str):
    value = super(type(self), self).__getattr__(name)
    if isinstance(value, torch.nn.Parameter):
        group = getattr(value, "ds_group", None)
        if group is not None:
            group.owner.on_access(group)
    return value


def set_state_dict_gather(module: torch.nn.Module, gather: bool) -> None:
    """What ``module.state_dict()`` gives at ZeRO stage 3 for the engine's partitioned
    parameters: their full values on every rank's host, a collective every rank must join
    (``gather=True``, shardtrain's default), or DeepSpeed's: the local tensors, with empty
    placeholders for partitioned parameters (whole ones inside ``GatheredParameters``), so
    that one rank may ask alone (``gather=False``; what engines built through the
    ``deepspeed`` alias do). ``load_state_dict()`` writes full values either way.

    Example:
        >>> shardtrain.zero.set_state_dict_gather(engine.module, False)
        >>> if rank == 0:
        ...     names = set(engine.module.state_dict())     # no collective
    """
    for m in module.modules():
        owner = m.__dict__.get("_zero_units")
        if owner is not None:
            owner.gather_state_dict = gather


def _zero_save(self, destination, prefix, keep_vars):
    if keep_vars or not getattr(self._zero_units, "gather_state_dict", True):
        # the parameters themselves are asked for, or DeepSpeed's local state_dict: no gather
        return super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
    # Groups whose parameters are all whole already (inside GatheredParameters entered on
    # every rank, or a running forward) are read as they are: no collective, so one rank may
    # read them alone (OpenRLHF's rank-0 state_dict() inside GatheredParameters).
    groups = [g for g in self._zero_units.of(self) if not _whole(g)]
    for g in groups:
        g.active += 1
        g.gather()
    try:
        super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
        for name, p in self._parameters.items():
            if p is not None and is_partitioned(p) and prefix + name in destination:
                # a host copy: the gathered group is released right after, and no rank's
                # device holds the model again for a state_dict
                destination[prefix + name] = p.ds_full.detach().to("cpu", copy=True)
    finally:
        _done_with(groups)


def _whole(group) -> bool:
    return all(p.ds_status == ZeroParamStatus.AVAILABLE for p in group.params)


def _zero_load(self, state_dict, prefix, *args, **kwargs):
    groups = self._zero_units.of(self)
    for g in groups:
        g.active += 1
        g.gather()
    try:
        super(type(self), self)._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for p in self._parameters.values():
            if p is not None and is_partitioned(p):
                write_shard_from_full(p)
    finally:
        _done_with(groups)


def _done_with(groups) -> None:
    for g in groups:
        g.active -= 1
        if g.active == 0 and not g.hold:
            g.release()
