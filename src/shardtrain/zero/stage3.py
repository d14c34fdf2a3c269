"""ZeRO stage 3: parameters sharded too, gathered just in time around each module.

Every rank keeps only its shard of each parameter (``_params``). The parameters a module
owns directly form one *group* whose shards sit side by side in one flat buffer, so one
all-gather brings the whole module back; a leaf module (``leaf``) owns every parameter
below it, and the modules inside it get no hooks. Hooks drive the life of a group:

* before a module's forward its groups are gathered (and the next groups of the order
  recorded in the previous step are prefetched, up to ``stage3_prefetch_bucket_size``
  elements); after it they are released, unless the group is used again within
  ``stage3_max_reuse_distance`` elements;
* a hook on the module's outputs gathers its groups again before its backward, and a
  group is released as soon as the gradients of all its parameters have arrived;
* gradients are reduce-scattered into shards exactly as in stage 2.

Parameters read outside the forward of a module that owns them (a tied head used in a
custom loss, a parent reading a child's weight) are caught on attribute access and kept
gathered until backward has used them. While a backward runs nothing is released by
forward hooks, so activation checkpointing (which re-runs forward inside backward) finds
its parameters in place. Small parameters (``stage3_param_persistence_threshold``) stay
whole on every rank, with sharded optimizer states and an all-gather after the step, as
in stage 2.

Every rank must run the same modules in the same order (collectives are matched by order).
The order may change from step to step: prefetching then follows the new order.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .. import accelerator, comm
from . import leaf
from ._optview import OptimizerView
from ._params import (ZeroParamStatus, adopt, is_partitioned, mark_available, materialize,
                      partition, release, write_shard_from_full)
from ._shards import ShardLayout, full_numel
from .stage12 import ZeroStage2

_RELEASED, _INFLIGHT, _AVAILABLE = "released", "inflight", "available"


class _Group:
    """The shards of the parameters one module owns, gathered and released together."""

    def __init__(self, params: List[torch.nn.Parameter], world: int, rank: int,
                 offload: bool = False, pin_memory: bool = False):
        self.params = params
        self.world = world
        self.layout = ShardLayout([p.ds_numel for p in params], world, rank)
        first = params[0].ds_tensor
        self.device = first.device  # where the full parameters are used
        # offload_param: the shards live in host memory between uses.
        self.offload = offload
        home = torch.device("cpu") if offload else first.device
        self.flat = torch.zeros(self.layout.row, dtype=first.dtype, device=home,
                                pin_memory=pin_memory and accelerator.is_cuda())
        for i, p in enumerate(params):
            region = self.flat[self.layout.offsets[i]: self.layout.offsets[i] + self.layout.chunks[i]]
            region.copy_(p.ds_tensor)
            p.ds_tensor = region  # the shard now lives in the group's flat buffer
            p.ds_group = self
        self.numel = sum(p.ds_numel for p in params)
        self.trainable = {id(p) for p in params if p.requires_grad}
        self.status = _RELEASED
        self._work: Optional[comm.Work] = None
        self._gathered: Optional[torch.Tensor] = None
        self.active = 0        # forwards of modules using this group now running
        self.hold = False      # read outside its module: keep until backward has used it
        self.done: set = set()  # trainable parameters whose gradient arrived this backward

    def launch(self) -> None:
        if self.status != _RELEASED:
            return
        self._gathered = torch.empty(self.world, self.layout.row, dtype=self.flat.dtype,
                                     device=self.device)
        # An offloaded shard travels to the device first (a copy even when both are the CPU).
        mine = self.flat.to(self.device, copy=True, non_blocking=True) if self.offload \
            else self.flat
        self._work = comm.all_gather(self._gathered.view(-1), mine, async_op=True)
        self._sent = mine
        self.status = _INFLIGHT
        for p in self.params:
            p.ds_status = ZeroParamStatus.INFLIGHT

    def wait(self) -> None:
        if self.status != _INFLIGHT:
            return
        self._work.wait()
        with torch.no_grad():  # one copy for the group: column block i is parameter i's chunks
            torch.split_with_sizes_copy(self._gathered, self.layout.chunks, dim=1,
                                        out=[materialize(p) for p in self.params])
        for p in self.params:
            mark_available(p)
        self._work = self._gathered = self._sent = None
        self.status = _AVAILABLE

    def gather(self) -> None:
        self.launch()
        self.wait()

    def release(self) -> None:
        self.wait()  # an all-gather in flight must land before its memory goes
        if self.status == _AVAILABLE:
            for p in self.params:
                release(p)
        self.status = _RELEASED
        self.hold = False


class ZeroStage3(ZeroStage2):
    """Stage 3: sharded parameters gathered per module, gradients reduce-scattered.

    Args (beyond :class:`ZeroStage2`'s):
        module: the model; its parameters are partitioned here (unless small).
        zero: the ``zero_optimization`` config (stage-3 thresholds).
    """

    stage = 3

    def __init__(self, module: torch.nn.Module, params: List[torch.nn.Parameter],
                 bucket_numel: int, overlap: bool, reduce, should_reduce, gather_numel: int,
                 world: int, rank: int, use_reduce_scatter: bool, zero) -> None:
        self.module = module
        self.offload_param = zero.offload_param is not None and zero.offload_param.device == "cpu"
        self.pin_param = bool(self.offload_param and zero.offload_param.pin_memory)
        self.prefetch_numel = int(zero.prefetch_bucket_size)
        self.max_live = int(zero.max_live_parameters)
        self.max_reuse = int(zero.max_reuse_distance)
        self.in_backward = False
        self.in_step = False  # from the engine's forward to the end of its backward
        self._trace: List[_Group] = []
        self._module_pos: Dict[int, int] = {}  # where each module's forward began in _trace
        self._plan: List[_Group] = []
        self._plan_ok = False
        self.groups: List[_Group] = []
        self._unit_groups: Dict[int, List[_Group]] = {}
        # How groups arrived when needed: already there, prefetched, or fetched on demand.
        self.stats = {"prefetched": 0, "on_demand": 0}
        self._partition_all(module, world, rank, zero)
        optimizer_offload = (zero.offload_optimizer is not None
                             and zero.offload_optimizer.device == "cpu")
        super().__init__(params, bucket_numel, overlap, reduce, should_reduce, gather_numel,
                         world, rank, use_reduce_scatter, optimizer_offload,
                         bool(optimizer_offload and zero.offload_optimizer.pin_memory))
        persistent = [p for p in params if not is_partitioned(p)]
        self.gather_groups = self._persistent_gather_groups(persistent, gather_numel)
        self._hooks += self._install_module_hooks(module)

    # -- set-up -------------------------------------------------------------------------------

    def _partition_all(self, module: torch.nn.Module, world: int, rank: int, zero) -> None:
        unique = list({id(p): p for p in module.parameters()}.values())
        budget = int(zero.model_persistence_threshold)
        for p in sorted(unique, key=full_numel):
            small = full_numel(p) <= int(zero.param_persistence_threshold)
            if small and not is_partitioned(p) and full_numel(p) <= budget:
                budget -= full_numel(p)
                p.ds_persist, p.ds_shape, p.ds_numel = True, p.shape, p.numel()
                continue
            if is_partitioned(p):
                adopt(p, world)  # built under zero.Init, before the engine moved it
            else:
                partition(p, world, rank, src=None)  # the engine already broadcast rank 0's
        # Units: each leaf module with everything inside it, and each other module with the
        # parameters it holds directly. A unit's parameters are one group per dtype.
        leaf.apply_config(module, zero.leaf_module, int(zero.module_granularity_threshold))
        leaves = {id(m) for m in leaf.outermost_leaves(module)}
        self._inside_leaf = {id(x) for m in module.modules() if id(m) in leaves
                             for x in m.modules() if x is not m}
        owned: set = set()
        for m in module.modules():
            if id(m) in self._inside_leaf:
                continue
            mine = [p for p in _unit_params(m, id(m) in leaves) if id(p) not in owned]
            owned.update(id(p) for p in mine)
            by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
            for p in mine:
                by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
            self.groups += [_Group(ps, world, rank, self.offload_param, self.pin_param)
                            for ps in by_dtype.values()]
        for m in module.modules():
            # (a module inside a leaf maps to its leaf's groups: for its state_dict and for
            # reads of its parameters outside the leaf's forward)
            groups = {id(p.ds_group): p.ds_group for p in _unit_params(m, id(m) in leaves)}
            if groups:
                self._unit_groups[id(m)] = list(groups.values())
        for g in self.groups:
            g.owner = self

    def _build_view(self) -> OptimizerView:
        sources = [p.ds_tensor[: hi - lo] if is_partitioned(p) else None
                   for p, (lo, hi) in zip(self.params, self.slices)]
        return OptimizerView(self.params, self.slices, sources, offload=self.offload,
                             pin_memory=self.pin_memory)

    def _persistent_gather_groups(self, persistent, gather_numel):
        from ._buckets import split_into_buckets
        return [(group, ShardLayout([p.numel() for p in group], self.world, self.rank))
                for group in split_into_buckets(persistent, gather_numel)] if persistent else []

    def _install_module_hooks(self, module: torch.nn.Module) -> list:
        self._module_hooks: Dict[int, list] = {}
        for m in module.modules():
            if id(m) in self._inside_leaf and id(m) in self._unit_groups:
                _install_access_hooks(m, self)  # gathered with its leaf: no hooks of its own
            elif id(m) in self._unit_groups:
                self._hook_unit(m)
        return []

    def _hook_unit(self, m: torch.nn.Module) -> None:
        self._module_hooks[id(m)] = [m.register_forward_pre_hook(self._pre_forward),
                                     m.register_forward_hook(self._post_forward)]
        _install_access_hooks(m, self)

    # -- torch.compile --------------------------------------------------------------------------

    def compile(self, module: torch.nn.Module, backend: str, options: dict):
        """Compiles each block (a module held in an ``nn.ModuleList`` or ``nn.Sequential``)
        on its own. A block's parameters become one unit gathered around the whole block,
        so the compiled code contains no gather and no hook; modules outside blocks keep
        their own units and run eagerly."""
        for block in _blocks(module):
            self._merge_into_unit(block)
            block.forward = torch.compile(block.forward, backend=backend, **options)
        self._plan, self._plan_ok = [], False  # the units changed: learn the order again
        return module

    def _merge_into_unit(self, block: torch.nn.Module) -> None:
        """The block's unit becomes every group inside it (each keeps its own flat shard
        buffer, which the optimizer's tensors point into); inner modules lose their hooks."""
        inner = [m for m in block.modules() if id(m) in self._unit_groups]
        groups = list({id(g): g for m in inner for g in self._unit_groups[id(m)]}.values())
        if not groups:
            return
        for m in inner:
            for handle in self._module_hooks.pop(id(m), []):
                handle.remove()
            _install_state_hooks(m, self)
        self._unit_groups[id(block)] = groups
        self._module_hooks[id(block)] = [block.register_forward_pre_hook(self._pre_forward),
                                         block.register_forward_hook(self._post_forward)]

    # -- forward ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        super().begin_forward()
        self.in_step = True
        if not self.in_backward:
            self._trace = []
            self._plan_ok = bool(self._plan)
            for g in self.groups:
                g.done = set()

    def end_forward(self, grad_enabled: bool) -> None:
        """Learns the order for the next step's prefetching; frees what no backward needs."""
        if self.in_backward:
            return
        self.in_step = grad_enabled
        if self._trace and not (self._plan_ok and len(self._plan) == len(self._trace)):
            self._plan = list(self._trace)  # first step, or the path changed: re-learn
        used = {id(g) for g in self._trace}
        for g in self.groups:
            unused_prefetch = id(g) not in used and not g.hold
            if g.active == 0 and (not grad_enabled or unused_prefetch):
                g.release()

    def _pre_forward(self, m: torch.nn.Module, args) -> None:
        groups = self._unit_groups[id(m)]
        for g in groups:
            g.active += 1
        if not self.in_backward:
            self._module_pos[id(m)] = len(self._trace)
        for g in groups:
            if not self.in_backward:
                self._record(g)
            self._fetch(g)

    def _record(self, g: _Group) -> None:
        pos = len(self._trace)
        self._trace.append(g)
        g.last_pos = pos
        if self._plan_ok and (pos >= len(self._plan) or self._plan[pos] is not g):
            self._plan_ok = False  # the path changed: no prefetching until it is re-learned
        if self._plan_ok:
            self._prefetch(self._plan[pos + 1:])

    def _post_forward(self, m: torch.nn.Module, args, output) -> None:
        groups = self._unit_groups[id(m)]
        for g in groups:
            g.active -= 1
        if torch.is_grad_enabled():
            self._hook_backward_entry(m, output)
        if self.in_backward:
            return  # a re-run forward (checkpointing): backward needs these next
        for g in groups:
            if g.active == 0 and not g.hold and not self._reused_soon(g):
                g.release()

    def _reused_soon(self, g: _Group) -> bool:
        """Keeps a group whose next use (later in forward, or in backward) comes within
        ``stage3_max_reuse_distance`` gathered elements."""
        if not self._plan_ok or not torch.is_grad_enabled():
            return False
        pos = getattr(g, "last_pos", None)
        if pos is None:
            return False
        distance = 0
        for h in self._plan[pos + 1:]:
            if h is g:
                return distance <= self.max_reuse
            distance += h.numel
        return distance <= self.max_reuse  # its next use is this group's backward

    def _prefetch(self, upcoming: List[_Group]) -> None:
        budget = self.prefetch_numel
        for h in upcoming:
            if budget <= 0:
                return
            if h.status == _RELEASED:
                if self._live() + h.numel > self.max_live:
                    return
                h.launch()
                self.stats["prefetched"] += 1
                budget -= h.numel

    def _fetch(self, g: _Group) -> None:
        if g.status == _RELEASED:
            self.stats["on_demand"] += 1
            self._make_room(g)
        g.gather()

    def _live(self) -> int:
        return sum(g.numel for g in self.groups if g.status != _RELEASED)

    def _make_room(self, g: _Group) -> None:
        """Over ``stage3_max_live_parameters``: drop groups kept only for reuse."""
        if g.status != _RELEASED or self._live() + g.numel <= self.max_live:
            return
        for h in self.groups:
            if h is not g and h.status == _AVAILABLE and h.active == 0 and not h.hold \
                    and not self.in_backward:
                h.release()
                if self._live() + g.numel <= self.max_live:
                    return

    # -- backward -----------------------------------------------------------------------------

    def _hook_backward_entry(self, m: torch.nn.Module, output) -> None:
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            return
        fired = []

        def gather_for_backward(grad):
            if not fired:
                fired.append(True)
                self._pre_backward(m)
            return grad

        for t in tensors:
            t.register_hook(gather_for_backward)

    def _pre_backward(self, m: torch.nn.Module) -> None:
        self.in_backward = True
        groups = self._unit_groups[id(m)]
        for g in groups:
            self._fetch(g)
        # Backward runs the forward order in reverse: what this module's forward came after
        # comes next. (Its own position, not its groups': a tied group's last use may be a
        # module near the end, and prefetching from there would fetch the whole model.)
        pos = self._module_pos.get(id(m))
        if pos is not None:
            self._prefetch(list(reversed(self._trace[:pos])))

    def begin_backward(self) -> None:
        self.in_backward = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        super()._on_grad(param)
        g = getattr(param, "ds_group", None)
        if g is None:
            return
        g.done.add(id(param))
        if g.done >= g.trainable and g.active == 0:
            g.release()  # every use of it in this backward is over

    def end_backward(self, accumulation_steps: int) -> None:
        super().end_backward(accumulation_steps)
        self.in_backward = self.in_step = False
        for g in self.groups:
            # No forward is running now. A count left over is a forward that never finished:
            # non-reentrant checkpointing stops its re-run early, once it has what it needs.
            g.active = 0
            g.release()

    # -- access from outside a module's forward ------------------------------------------------

    def on_access(self, g: _Group) -> None:
        """Gathers on attribute access, between the engine's forward and the end of its
        backward only: a read there (a custom loss) happens on every rank, while a read
        elsewhere (logging on rank 0, say) may not, and must not start a collective."""
        if not self.in_step or (g.active > 0 and g.status == _AVAILABLE):
            return
        g.hold = True
        self._fetch(g)

    # -- step -----------------------------------------------------------------------------------

    def zero_grads(self) -> None:
        super().zero_grads()
        for g in getattr(self, "groups", []):
            g.active = 0
            g.release()  # after a step any gathered copy is stale

    def release_all(self) -> None:
        """Releases every gathered group no running forward needs (after inference or
        ``generate()``, whose parameters forward hooks keep around for reuse)."""
        for g in self.groups:
            if g.active == 0:
                g.release()

    def param_storage(self) -> List[torch.Tensor]:
        """What holds the parameters between steps: the group shards (and whole small ones)."""
        return [g.flat for g in self.groups]

    def unit_groups(self, m: torch.nn.Module) -> List[_Group]:
        return self._unit_groups.get(id(m), [])


def _unit_params(m: torch.nn.Module, whole: bool) -> List[torch.nn.Parameter]:
    """The partitioned parameters of ``m``: all of its subtree's when ``whole`` (a leaf),
    else those it holds directly; each once."""
    params = m.parameters() if whole else (p for p in m._parameters.values() if p is not None)
    return list({id(p): p for p in params if is_partitioned(p)}.values())


def _tensors(output) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    from torch.utils import _pytree as pytree
    return [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]


# -- attribute access ---------------------------------------------------------------------------

_ACCESS_CLASSES: Dict[type, type] = {}


def _install_access_hooks(m: torch.nn.Module, strategy: ZeroStage3) -> None:
    """Gives ``m`` a subclass of its own class that gathers partitioned parameters when they
    are read outside the forward of a module that owns them, and that saves and loads full
    values in ``state_dict``."""
    cls = type(m)
    if getattr(cls, "_zero_access_class", False):
        m._zero_strategy = strategy
        return
    if cls not in _ACCESS_CLASSES:
        _ACCESS_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__getattr__": _zero_getattr, "_save_to_state_dict": _zero_save,
            "_load_from_state_dict": _zero_load, "_zero_access_class": True,
            "_zero_original_class": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    m.__class__ = _ACCESS_CLASSES[cls]
    m._zero_strategy = strategy


_STATE_CLASSES: Dict[type, type] = {}


def _install_state_hooks(m: torch.nn.Module, strategy: ZeroStage3) -> None:
    """Like :func:`_install_access_hooks` without the attribute hook, for modules inside a
    compiled block (their block's unit is gathered around them)."""
    cls = getattr(type(m), "_zero_original_class", type(m))
    if cls not in _STATE_CLASSES:
        _STATE_CLASSES[cls] = type(cls.__name__, (cls,), {
            "_save_to_state_dict": _zero_save, "_load_from_state_dict": _zero_load,
            "_zero_access_class": True, "_zero_original_class": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    m.__class__ = _STATE_CLASSES[cls]
    m._zero_strategy = strategy


def _blocks(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost modules held in an ``nn.ModuleList`` or ``nn.Sequential``."""
    found: List[torch.nn.Module] = []
    inside: set = set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        for child in m.children():
            if any(True for _ in child.parameters()):
                found.append(child)
                inside.update(id(x) for x in child.modules())
    return found


def _zero_getattr(self, name: str):
    value = super(type(self), self).__getattr__(name)
    if isinstance(value, torch.nn.Parameter):
        group = getattr(value, "ds_group", None)
        if group is not None:
            group.owner.on_access(group)
    return value


def _zero_save(self, destination, prefix, keep_vars):
    if keep_vars:  # the parameters themselves are asked for, not their values: no gather
        return super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
    groups = self._zero_strategy.unit_groups(self)
    for g in groups:
        g.active += 1
        g.gather()
    try:
        super(type(self), self)._save_to_state_dict(destination, prefix, keep_vars)
        for name, p in self._parameters.items():
            if p is not None and is_partitioned(p) and prefix + name in destination:
                destination[prefix + name] = p.ds_full.detach().clone()
    finally:
        for g in groups:
            g.active -= 1
            if g.active == 0 and not g.hold:
                g.release()


def _zero_load(self, state_dict, prefix, *args, **kwargs):
    groups = self._zero_strategy.unit_groups(self)
    for g in groups:
        g.active += 1
        g.gather()
    try:
        super(type(self), self)._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for p in self._parameters.values():
            if p is not None and is_partitioned(p):
                write_shard_from_full(p)
    finally:
        for g in groups:
            g.active -= 1
            if g.active == 0 and not g.hold:
                g.release()
