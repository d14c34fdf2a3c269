"""ZeRO-3 parameter groups: the unit that is gathered and released together.

Every rank keeps only its shard of each partitioned parameter (:mod:`._params`). The
parameters one module owns directly form a *unit*; a leaf module (:mod:`.leaf`) owns every
parameter below it, and the modules inside it get no unit of their own. A unit's parameters
form one :class:`ParamGroup` per dtype, whose shards sit side by side in one flat buffer, so
one all-gather brings the whole unit back.

Small parameters (``stage3_param_persistence_threshold``, within the
``stage3_model_persistence_threshold`` budget) stay whole on every rank; they belong to no
group and are all-gathered after the step as at stage 2.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import torch

from .. import accelerator, comm
from ..comm import Group
from . import _collectives as coll
from . import leaf
from ._params import (ZeroParamStatus, adopt, is_partitioned, mark_available, materialize,
                      partition, release)
from ._shards import ShardLayout, full_numel
from ..layout import layout_of, place

RELEASED, INFLIGHT, AVAILABLE = "released", "inflight", "available"
#: The attribute an error raised while gathering a group carries: the group's module name.
GATHERING = "shardtrain_gathering"


class ParamGroup:
    """The shards of one unit's parameters of one dtype, gathered and released together.

    Args:
        params: partitioned parameters (their shards move into the group's flat buffer).
        group: the data-parallel group.
        offload, pin_memory: the shards live in (pinned) host memory between uses
            (``offload_param``).
        name: the owning module's qualified name (``"blocks.1"``; ``"(root)"`` for the
            model itself), carried by its gathers into the collective trail.
    """

    def __init__(self, params: List[torch.nn.Parameter], group: Group,
                 offload: bool = False, pin_memory: bool = False, name: str = ""):
        self.params = params
        self.group = group
        self.name = name
        self.layout = ShardLayout([layout_of(p).local_numel for p in params], group.size(), group.rank())
        first = params[0].ds_tensor
        self.device = first.device  # where the full parameters are used
        self.offload = offload
        home = torch.device("cpu") if offload else first.device
        self.flat = torch.zeros(self.layout.row, dtype=first.dtype, device=home,
                                pin_memory=pin_memory and accelerator.is_cuda())
        for i, p in enumerate(params):
            start = self.layout.offsets[i]
            region = self.flat[start: start + self.layout.chunks[i]]
            region.copy_(p.ds_tensor)
            p.ds_tensor = region  # the shard now lives in the group's flat buffer
            p.ds_group = self
            place(p, unit=name)
        self.numel = sum(layout_of(p).local_numel for p in params)
        self.trainable = {id(p) for p in params if p.requires_grad}
        self.status = RELEASED
        self.owner: Any = None  # the schedule that gathers it (reads outside forward ask it)
        self.last_pos: Optional[int] = None  # its last position in this step's forward trace
        self._flight: Optional[coll.Inflight] = None
        self.active = 0        # forwards of modules using this group now running
        self.hold = False      # read outside its module: keep until backward has used it
        self.done: set = set()  # trainable parameters whose gradient arrived this backward

    def launch(self) -> None:
        """Starts the all-gather (no wait)."""
        if self.status != RELEASED:
            return
        # An offloaded shard travels to the device first (a copy even when both are the CPU).
        try:
            mine = self.flat.to(self.device, copy=True, non_blocking=True) if self.offload \
                else self.flat
            with comm.labelled(self.name):
                self._flight = coll.all_gather_rows(mine, self.group, self.device)
        except RuntimeError as err:
            self._tag(err)
            raise
        self.status = INFLIGHT
        for p in self.params:
            p.ds_status = ZeroParamStatus.INFLIGHT

    def wait(self) -> None:
        """Lands a launched all-gather in the parameters."""
        if self.status != INFLIGHT:
            return
        try:
            gathered = self._flight.wait()
            with torch.no_grad():  # one copy for the group: column block i is parameter i's
                torch.split_with_sizes_copy(gathered, self.layout.chunks, dim=1,
                                            out=[materialize(p) for p in self.params])
        except RuntimeError as err:
            self._tag(err)
            raise
        for p in self.params:
            mark_available(p)
        self._flight = None
        self.status = AVAILABLE

    def gather(self) -> None:
        self.launch()
        self.wait()

    def _tag(self, error: BaseException) -> None:
        """Names this group's module on an error raised while gathering it (an out-of-memory
        report says which module; the innermost gather keeps its name)."""
        if getattr(error, GATHERING, None) is None:
            setattr(error, GATHERING, self.name)

    def release(self) -> None:
        self.wait()  # an all-gather in flight must land before its memory goes
        if self.status == AVAILABLE:
            for p in self.params:
                release(p)
        self.status = RELEASED
        self.hold = False


@dataclass
class Units:
    """How a model's partitioned parameters are grouped."""

    groups: List[ParamGroup] = field(default_factory=list)
    by_module: Dict[int, List[ParamGroup]] = field(default_factory=dict)  # id(module) -> groups
    inside_leaf: set = field(default_factory=set)  # ids of modules inside a leaf module

    def of(self, m: torch.nn.Module) -> List[ParamGroup]:
        return self.by_module.get(id(m), [])


def partition_model(module: torch.nn.Module, group: Group, zero: Any,
                    keep_whole: Sequence[torch.nn.Parameter] = ()) -> Units:
    """Partitions ``module``'s parameters (but the small ones, and ``keep_whole``: split
    experts, which another strategy trains) and groups them into units.

    ``zero`` is the ``zero_optimization`` config (persistence thresholds, leaf modules,
    parameter offload).
    """
    _partition_params(module, group, zero, {id(p) for p in keep_whole})
    leaf.apply_config(module, zero.leaf_module, int(zero.module_granularity_threshold))
    leaves = {id(m) for m in leaf.outermost_leaves(module)}
    units = Units(inside_leaf={id(x) for m in module.modules() if id(m) in leaves
                               for x in m.modules() if x is not m})
    offload = zero.offload_param is not None and zero.offload_param.device == "cpu"
    pin = bool(offload and zero.offload_param.pin_memory)
    owned: set = set()
    for qualified, m in module.named_modules(remove_duplicate=True):
        if id(m) in units.inside_leaf:
            continue
        mine = [p for p in unit_params(m, id(m) in leaves) if id(p) not in owned]
        owned.update(id(p) for p in mine)
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for p in mine:
            by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
        units.groups += [ParamGroup(ps, group, offload, pin, qualified or "(root)")
                         for ps in by_dtype.values()]
    for m in module.modules():
        # (a module inside a leaf maps to its leaf's groups: for its state_dict and for
        # reads of its parameters outside the leaf's forward)
        groups = {id(p.ds_group): p.ds_group for p in unit_params(m, id(m) in leaves)}
        if groups:
            units.by_module[id(m)] = list(groups.values())
    return units


def _partition_params(module: torch.nn.Module, group: Group, zero: Any,
                      keep_whole: Set[int]) -> None:
    unique = [p for p in {id(p): p for p in module.parameters()}.values()
              if id(p) not in keep_whole]
    budget = int(zero.model_persistence_threshold)
    for p in sorted(unique, key=full_numel):
        small = full_numel(p) <= int(zero.param_persistence_threshold)
        if small and not is_partitioned(p) and full_numel(p) <= budget:
            budget -= full_numel(p)
            place(p, local_shape=tuple(p.shape), zero_group=group, persistent=True)
            continue
        if is_partitioned(p):
            adopt(p, group)  # built under zero.Init, before the engine moved it
        else:
            partition(p, group, src=None)  # the engine already broadcast rank 0's


def unit_params(m: torch.nn.Module, whole: bool) -> List[torch.nn.Parameter]:
    """The partitioned parameters of ``m``: all of its subtree's when ``whole`` (a leaf),
    else those it holds directly; each once."""
    params = m.parameters() if whole else (p for p in m._parameters.values() if p is not None)
    return list({id(p): p for p in params if is_partitioned(p)}.values())
