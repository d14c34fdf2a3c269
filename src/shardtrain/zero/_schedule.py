"""The ZeRO-3 schedule: when each parameter group is gathered, prefetched and released.

Hooks drive the life of a group (:mod:`._groups`):

* before a module's forward its groups are gathered, and the next groups of the order
  recorded in the previous step are prefetched, up to ``stage3_prefetch_bucket_size``
  elements; after it they are released, unless the group is used again within
  ``stage3_max_reuse_distance`` elements;
* a hook on the module's outputs gathers its groups again before its backward, and a group
  is released as soon as the gradients of all its parameters have arrived.

The order is *traced* during each forward and becomes the *plan* the next step prefetches
from. Every rank must run the same modules in the same order (the gathers are collectives,
matched by order); the order may change from step to step: prefetching then stops until the
new order is learned.

Parameters read outside the forward of a module that owns them are gathered on attribute
access (:mod:`._access`) and kept until backward has used them (until the last backward,
when several forwards ran before their backwards, as on a pipeline stage). While a backward runs
nothing is released by forward hooks, so activation checkpointing (which re-runs forward
inside backward) finds its parameters in place.
"""
from __future__ import annotations

import enum
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

from .. import comm
from ..layout import layout_of
from . import _access
from ._groups import AVAILABLE, RELEASED, ParamGroup, Units


class Window(enum.Enum):
    """Where the engine's pass is, as the gathers see it (one value, not two flags)."""

    OUTSIDE = "outside"    # no engine forward or backward: an attribute read gathers nothing
    FORWARD = "forward"    # from the engine's forward to its backward (or its end without grad)
    BACKWARD = "backward"  # inside backward (forwards re-run by checkpointing included)


class GatherSchedule:
    """Gathers and releases the groups of ``units`` around ``module``'s forward and backward.

    Args:
        module: the model (hooks go on the modules that own a unit).
        units: the model's groups (:func:`._groups.partition_model`).
        zero: the ``zero_optimization`` config (prefetch, live and reuse budgets).
        weights_written: called with the parameters whose shards were written from outside
            (``GatheredParameters(modifier_rank=...)``), so optimizer copies follow.
    """

    def __init__(self, module: torch.nn.Module, units: Units, zero: Any,
                 weights_written: Callable[[List[torch.nn.Parameter]], None]):
        self.units = units
        self.prefetch_numel = int(zero.prefetch_bucket_size)
        self.max_live = int(zero.max_live_parameters)
        self.max_reuse = int(zero.max_reuse_distance)
        self.weights_written = weights_written
        self.gather_state_dict = True  # state_dict() gathers (see _access.set_state_dict_gather)
        self.window = Window.OUTSIDE
        self._trace: List[ParamGroup] = []
        self._module_pos: Dict[int, int] = {}  # where each module's forward began in _trace
        self._plan: List[ParamGroup] = []
        self._plan_ok = False
        self._pending = 0  # forwards with gradients whose backward has not run yet
        # How groups arrived when needed: already there, prefetched, or fetched on demand.
        self.stats = {"prefetched": 0, "on_demand": 0}
        self.module_hooks: Dict[int, list] = {}  # id(module) -> its forward hook handles
        self._swaps: List[_access.ClassSwap] = []
        self._names = {id(m): name or "(root)" for name, m in module.named_modules()}
        for g in units.groups:
            g.owner = self
        for p in module.parameters():
            if layout_of(p).persistent:
                p.ds_owner = self  # kept whole: GatheredParameters' writes reach masters here
        self._install(module)

    # -- hooks --------------------------------------------------------------------------------

    def _install(self, module: torch.nn.Module) -> None:
        for m in module.modules():
            if id(m) not in self.units.by_module:
                continue
            if id(m) not in self.units.inside_leaf:  # gathered with its leaf: no hooks of its own
                self._hook_unit(m)
            self._swaps.append(_access.install(m, self))

    def _hook_unit(self, m: torch.nn.Module) -> None:
        self.module_hooks[id(m)] = [m.register_forward_pre_hook(self._pre_forward),
                                    m.register_forward_hook(self._post_forward)]

    def remove_hooks(self) -> None:
        for handles in self.module_hooks.values():
            for handle in handles:
                handle.remove()
        self.module_hooks.clear()
        for swap in reversed(self._swaps):
            swap.remove()
        self._swaps.clear()

    def hand_over(self) -> None:
        """The compiled graphs gather and release from now on (DeepCompile's ``z3``): the
        forward hooks go; the class swaps stay, for ``state_dict`` and for reads outside a
        forward, which still gather eagerly."""
        for handles in self.module_hooks.values():
            for handle in handles:
                handle.remove()
        self.module_hooks.clear()
        self.release_all()

    def of(self, m: torch.nn.Module) -> List[ParamGroup]:
        """The groups gathered for ``m`` (its unit's, or its leaf's)."""
        return self.units.of(m)

    # -- torch.compile ------------------------------------------------------------------------

    def compile(self, module: torch.nn.Module, backend: str, options: dict) -> torch.nn.Module:
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
        inner = [m for m in block.modules() if id(m) in self.units.by_module]
        groups = list({id(g): g for m in inner for g in self.units.by_module[id(m)]}.values())
        if not groups:
            return
        for m in inner:
            for handle in self.module_hooks.pop(id(m), []):
                handle.remove()
            self._swaps.append(_access.install(m, self, on_access=False))
        self.units.by_module[id(block)] = groups
        self._hook_unit(block)

    # -- forward ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        if self.window is not Window.BACKWARD:  # not a forward re-run inside backward
            self.window = Window.FORWARD
            self._trace = []
            self._plan_ok = bool(self._plan)
            for g in self.units.groups:
                g.done = set()

    def end_forward(self, grad_enabled: bool) -> None:
        """Learns the order for the next step's prefetching; frees what no backward needs."""
        if self.window is Window.BACKWARD:
            return
        self.window = Window.FORWARD if grad_enabled else Window.OUTSIDE
        self._pending += 1 if grad_enabled else 0
        if self._trace and not (self._plan_ok and len(self._plan) == len(self._trace)):
            self._plan = list(self._trace)  # first step, or the path changed: re-learn
        used = {id(g) for g in self._trace}
        for g in self.units.groups:
            unused_prefetch = id(g) not in used and not g.hold
            if g.active == 0 and (not grad_enabled or unused_prefetch):
                g.release()

    def _pre_forward(self, m: torch.nn.Module, args) -> None:
        groups = self.units.by_module[id(m)]
        for g in groups:
            g.active += 1
        if self.window is not Window.BACKWARD:
            self._module_pos[id(m)] = len(self._trace)
            if groups:  # ranks must run the same modules in the same order: the trail says so
                comm.mark("forward", self._names.get(id(m), type(m).__name__), groups[0].group)
        for g in groups:
            if self.window is not Window.BACKWARD:
                self._record(g)
            self._fetch(g)

    def _record(self, g: ParamGroup) -> None:
        pos = len(self._trace)
        self._trace.append(g)
        g.last_pos = pos
        if self._plan_ok and (pos >= len(self._plan) or self._plan[pos] is not g):
            self._plan_ok = False  # the path changed: no prefetching until it is re-learned
        if self._plan_ok:
            self._prefetch(self._plan[pos + 1:])

    def _post_forward(self, m: torch.nn.Module, args, output) -> None:
        groups = self.units.by_module[id(m)]
        for g in groups:
            g.active -= 1
        if torch.is_grad_enabled():
            self._hook_backward_entry(m, output)
        if self.window is Window.BACKWARD:
            return  # a re-run forward (checkpointing): backward needs these next
        for g in groups:
            if g.active == 0 and not g.hold and not self._reused_soon(g):
                g.release()

    def _reused_soon(self, g: ParamGroup) -> bool:
        """Keeps a group whose next use (later in forward, or in backward) comes within
        ``stage3_max_reuse_distance`` gathered elements."""
        if not self._plan_ok or not torch.is_grad_enabled() or g.last_pos is None:
            return False
        distance = 0
        for h in self._plan[g.last_pos + 1:]:
            if h is g:
                return distance <= self.max_reuse
            distance += h.numel
        return distance <= self.max_reuse  # its next use is this group's backward

    def _prefetch(self, upcoming: List[ParamGroup]) -> None:
        budget = self.prefetch_numel
        for h in upcoming:
            if budget <= 0:
                return
            if h.status == RELEASED:
                if self._live() + h.numel > self.max_live:
                    return
                h.launch()
                self.stats["prefetched"] += 1
                budget -= h.numel

    def _fetch(self, g: ParamGroup) -> None:
        if g.status == RELEASED:
            self.stats["on_demand"] += 1
            self._make_room(g)
        g.gather()

    def _live(self) -> int:
        return sum(g.numel for g in self.units.groups if g.status != RELEASED)

    def _make_room(self, g: ParamGroup) -> None:
        """Over ``stage3_max_live_parameters``: drop groups kept only for reuse."""
        if g.status != RELEASED or self._live() + g.numel <= self.max_live:
            return
        for h in self.units.groups:
            if h is not g and h.status == AVAILABLE and h.active == 0 and not h.hold \
                    and self.window is not Window.BACKWARD:
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
        self.window = Window.BACKWARD
        for g in self.units.by_module[id(m)]:
            self._fetch(g)
        # Backward runs the forward order in reverse: what this module's forward came after
        # comes next. (Its own position, not its groups': a tied group's last use may be a
        # module near the end, and prefetching from there would fetch the whole model.)
        pos = self._module_pos.get(id(m))
        if pos is not None:
            self._prefetch(list(reversed(self._trace[:pos])))

    def begin_backward(self) -> None:
        self.window = Window.BACKWARD
        for g in self.units.groups:  # arrivals count per backward pass: two backwards may
            g.done = set()           # follow two forwards (a pipeline's micro-batches)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        g: Optional[ParamGroup] = getattr(param, "ds_group", None)
        if g is None:
            return
        g.done.add(id(param))
        if g.done >= g.trainable and g.active == 0 and not (g.hold and self._pending > 1):
            g.release()  # every use of it in this backward is over (a group read outside
            # a forward stays for the backward of another forward still to come)

    def end_backward(self) -> None:
        self.window = Window.OUTSIDE
        self._pending = max(self._pending - 1, 0)
        for g in self.units.groups:
            # No forward is running now. A count left over is a forward that never finished:
            # non-reentrant checkpointing stops its re-run early, once it has what it needs.
            g.active = 0
            if not (g.hold and self._pending):  # a later backward may still read it
                g.release()

    # -- outside forward and backward -----------------------------------------------------------

    def on_access(self, g: ParamGroup) -> None:
        """Gathers on attribute access, between the engine's forward and the end of its
        backward only: a read there (a custom loss) happens on every rank, while a read
        elsewhere (logging on rank 0, say) may not, and must not start a collective."""
        if self.window is Window.OUTSIDE or (g.active > 0 and g.status == AVAILABLE):
            return
        g.hold = True
        self._fetch(g)

    def release_all(self) -> None:
        """Releases every gathered group no running forward needs (after inference or
        ``generate()``, whose parameters forward hooks keep around for reuse)."""
        for g in self.units.groups:
            if g.active == 0:
                g.release()

    def reset(self) -> None:
        """After a step any gathered copy is stale: everything is released."""
        self._pending = 0
        for g in self.units.groups:
            g.active = 0
            g.release()


def _tensors(output) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]


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
