"""ZeRO strategies: where parameters, gradients and optimizer states live, and how they move.

The engine talks to one :class:`Strategy` through the members of :class:`StrategyProtocol`,
and only those. Each stage is the same class assembled from different parts:

=====  ===============================  ==================  ==============  ================
stage  gradients (``_reduce``)          optimizer holds     after the step  parameters
=====  ===============================  ==================  ==============  ================
0      full, all-reduced                whole tensors       nothing         whole
1      full, reduce-scattered at the    this rank's slices  all-gather      whole
       boundary                                             slices
2      reduce-scattered every           this rank's slices  all-gather      whole
       micro-step into a shard                              slices
3      as stage 2                       this rank's shards  all-gather the  gathered per
                                                            small ones      module
                                                                            (``_schedule``)
=====  ===============================  ==================  ==============  ================

A gradient's path: autograd accumulates it into the parameter, the parameter's
post-accumulate hook hands it to the reducer (:mod:`._reduce`), which packs full buckets and
sends them with the free functions of :mod:`._collectives`; at the step the reducer returns
the averaged gradients, which the optimizer view (:mod:`._optview`) attaches to the tensors
the optimizer updates.

The caller says whether a backward synchronises (``begin_backward(sync=...)``): off the
accumulation boundary and inside ``no_sync()`` it does not, and stages 0-1 then accumulate
locally. Every hook a strategy installs is removed by :meth:`Strategy.remove_hooks`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Protocol, Sequence

import torch

from ..comm import Group
from . import _collectives as coll
from ._experts import WithExperts
from ._gather import SliceGatherer
from ._in_graph import InGraphForward, InGraphGrads
from ._groups import partition_model
from ._optview import OptimizerView, ParamSlot, full_slices
from ._params import is_partitioned
from ._buckets import FlatBucket, split_into_buckets
from ._reduce import (AllReduceExchange, FullGrads, GradientHolder, ReduceSettings, ScatterExchange,
                      ScatterRows, ShardedGrads)
from ._schedule import GatherSchedule
from ._shards import full_numel, shard_range

__all__ = ["Strategy", "StrategyProtocol", "ReducedGrads", "ParamSlot", "ReduceSettings",
           "build_strategy", "build_with_experts"]


@dataclasses.dataclass
class ReducedGrads:
    """The averaged gradients the optimizer takes at a step, with what measuring them needs.

    Attributes:
        tensors: the gradient of each tensor the optimizer updates on this rank (those of
            parameters with a gradient), attached to it as ``.grad``.
        split: for each of ``tensors``: whether it is a tensor-parallel slice (``layout_of(p).tp``),
            whose square adds up over the tensor-parallel group in the global norm.
        unused: the trainable parameters no rank produced a gradient for (the same on every
            rank: it comes from the reduced used-flags).
    """

    tensors: List[torch.Tensor]
    split: List[bool]
    unused: List[torch.nn.Parameter]


class StrategyProtocol(Protocol):
    """Everything the engine asks of a strategy, in the order of a training step."""

    stage: int
    supports_no_sync: bool  # stages 2-3 never keep a full gradient between micro-steps
    params: List[torch.nn.Parameter]  # the trainable parameters, each once

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-points a client optimizer at the tensors this rank updates."""

    def begin_forward(self) -> None:
        """A forward through the engine starts (a new micro-batch)."""

    def end_forward(self, grad_enabled: bool) -> None:
        """It ended; ``grad_enabled`` says whether a backward will follow."""

    def begin_backward(self, sync: bool) -> None:
        """A backward starts; ``sync``: its gradients are averaged across ranks."""

    def end_backward(self, accumulation_steps: int) -> None:
        """The backward announced by :meth:`begin_backward` ended."""

    def optimizer_grads(self, accumulation_steps: int) -> ReducedGrads:
        """Finishes the reduction; the optimizer's tensors get their averaged gradients."""

    def accumulated_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's full gradient of ``param`` summed since the last step, not averaged
        yet (stages 0-1, before the boundary's reduction); None where there is none."""

    def global_norm(self, grads: ReducedGrads, device: torch.device) -> torch.Tensor:
        """The norm of the whole model's gradient, the same on every rank."""

    def all_finite(self, grads: ReducedGrads, device: torch.device) -> bool:
        """Whether the whole model's gradient is finite, the same answer on every rank."""

    def after_step(self) -> None:
        """The optimizer stepped: module parameters catch up with what it updated."""

    def zero_grads(self) -> None:
        """Drops the accumulated gradients (after a step, or on request)."""

    def slots(self) -> List[ParamSlot]:
        """What the optimizer holds of each trainable parameter on this rank."""

    def received_grads(self) -> bool:
        """A gradient arrived since the last :meth:`zero_grads`."""

    def refresh_masters(self, params: Optional[List[torch.nn.Parameter]] = None) -> None:
        """Weights were written into the module: the optimizer's copies follow."""

    def copy_masters_to_params(self) -> None:
        """The optimizer's copies were written: the module's weights follow."""

    def compile(self, module: torch.nn.Module, backend: str, options: dict) -> Any:
        """``torch.compile`` the module as this stage allows; returns what forward runs."""

    def held_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """Storage held beyond the module's own tensors (memory accounting)."""

    def model_states(self) -> Dict[str, List[torch.Tensor]]:
        """This rank's model states by kind (``lp_params``, ``hp_params``, ``lp_grads``,
        ``contiguous_grad_buffer``): what ``offload_states`` moves."""

    def release_all(self) -> None:
        """Frees gathered parameters no running forward needs (stage 3)."""

    def stats(self) -> Dict[str, Any]:
        """What the strategy is doing, for diagnostics (buckets, stage-3 prefetches)."""

    def units(self) -> List[torch.nn.Module]:
        """The modules around whose forward parameters are gathered (stage 3)."""

    def remove_hooks(self) -> None:
        """Removes every hook the strategy installed (``engine.destroy()``)."""


class Strategy:
    """One ZeRO stage, composed of a gradient reducer, an optimizer view, an after-step
    gatherer and, at stage 3, a parameter schedule. Built by :func:`build_strategy`.

    Args:
        stage: the ZeRO stage it implements.
        module: the model.
        params: the trainable parameters, each once.
        grads: the gradient reducer (:class:`._reduce.FullGrads` or ``ShardedGrads``).
        view: what the optimizer holds of each parameter.
        group: the data-parallel group (ranks that hold the same parameters).
        tp: the tensor-parallel group, whose ranks hold different slices of the parameters
            split by tensor parallelism (None: no tensor parallelism).
        gatherer: all-gathers updated slices after the step (None at stage 0).
        schedule: gathers and releases partitioned parameters (stage 3 only).
        bucket_numel: ``reduce_bucket_size`` (DeepCompile's in-graph reductions bucket by it).
    """

    def __init__(self, stage: int, module: torch.nn.Module, params: List[torch.nn.Parameter],
                 grads: GradientHolder, view: OptimizerView, group: Group,
                 gatherer: Optional[SliceGatherer] = None,
                 schedule: Optional[GatherSchedule] = None, tp: Optional[Group] = None,
                 bucket_numel: int = 500_000_000):
        self.stage = stage
        self.supports_no_sync = grads.keeps_full
        self._module = module
        self._group, self._tp = group, tp
        self._world = group.size()
        self.params = params
        self._grads = grads
        self._view = view
        self._gatherer = gatherer
        self._schedule = schedule
        self._in_graph: Optional[InGraphForward] = None  # DeepCompile: collectives in graphs
        self._bucket_numel = bucket_numel  # reduce_bucket_size, for the graphs' reductions too
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    # -- optimizer ----------------------------------------------------------------------------

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        self._view.adopt(optimizer)

    def slots(self) -> List[ParamSlot]:
        return self._view.slots(sharded=self.stage > 0 and self._world > 1)

    def received_grads(self) -> bool:
        return self._grads.received

    def refresh_masters(self, params: Optional[List[torch.nn.Parameter]] = None) -> None:
        self._view.refresh_masters(params)

    def copy_masters_to_params(self) -> None:
        self._view.copy_masters_to_params()

    # -- forward and backward -----------------------------------------------------------------

    def _hooked_schedule(self) -> Optional[GatherSchedule]:
        """The stage-3 schedule while its hooks gather (not once the graphs do)."""
        return self._schedule if self._in_graph is None else None

    def begin_forward(self) -> None:
        self._grads.begin_forward()
        if self._hooked_schedule() is not None:
            self._schedule.begin_forward()

    def end_forward(self, grad_enabled: bool) -> None:
        if self._hooked_schedule() is not None:
            self._schedule.end_forward(grad_enabled)

    def begin_backward(self, sync: bool) -> None:
        self._grads.begin_backward(sync)
        if self._hooked_schedule() is not None:
            self._schedule.begin_backward()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        self._grads.on_grad(param)
        if self._hooked_schedule() is not None:
            self._schedule.on_grad(param)  # its group may be released now

    def end_backward(self, accumulation_steps: int) -> None:
        self._grads.end_backward(accumulation_steps)
        if self._hooked_schedule() is not None:
            self._schedule.end_backward()

    # -- the step -----------------------------------------------------------------------------

    def optimizer_grads(self, accumulation_steps: int) -> ReducedGrads:
        per_param = self._grads.grads(accumulation_steps)
        unused = [p for p, g in zip(self.params, per_param) if g is None]
        split = self._view.split_flags(per_param)
        return ReducedGrads(self._view.load_grads(per_param), split, unused)

    def accumulated_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return self._grads.accumulated(param)

    def global_norm(self, grads: ReducedGrads, device: torch.device) -> torch.Tensor:
        return coll.global_norm(grads.tensors, device, self._norm_groups(), grads.split)

    def all_finite(self, grads: ReducedGrads, device: torch.device) -> bool:
        return coll.all_finite(grads.tensors, device, self._norm_groups())

    def _norm_groups(self) -> coll.NormGroups:
        """Where the parts of the whole gradient live: sharded slices over the data-parallel
        group (stages 1-3), split parameters' slices over the tensor-parallel one."""
        return coll.NormGroups(self._group if self.stage > 0 else None, self._tp)

    def after_step(self) -> None:
        """Updated masters into the module's slices, then every rank's slices gathered."""
        self._view.copy_masters_to_params()
        if self._gatherer is not None:
            self._gatherer.gather()

    def zero_grads(self) -> None:
        self._grads.zero()
        self._view.release_grads()
        if self._schedule is not None:
            self._schedule.reset()

    # -- the rest -----------------------------------------------------------------------------

    def compile(self, module: torch.nn.Module, backend: str, options: dict):
        """The callable the engine runs forward through. Stages 0-2 compile the whole
        module (gradient hooks sit on gradient accumulation, outside the graphs); stage 3
        compiles block by block around its gathers (see :meth:`GatherSchedule.compile`)."""
        if self._schedule is not None:
            return self._schedule.compile(module, backend, options)
        return torch.compile(module, backend=backend, **options)

    def compile_in_graph(self, backend: str, options: dict) -> InGraphForward:
        """DeepCompile: from now on forward runs the returned callable, whose compiled graphs
        hold this stage's collectives (:mod:`._in_graph`); gradients come from the graphs,
        summed, and :meth:`optimizer_grads` averages them as before."""
        if self.stage == 0:
            raise NotImplementedError("DeepCompile needs ZeRO stage 1, 2 or 3 (as DeepSpeed's).")
        if self._in_graph is None:
            groups = self._schedule.units.groups if self._schedule is not None else []
            if self._schedule is not None:
                self._schedule.hand_over()
            settings = self._grads.settings
            self._grads.zero()
            for p in self.params:
                p.grad = None  # stages 0-1 attach bucket views; the graphs' sums land anew
            self.supports_no_sync = False
            whole = [p for p in self.params if not is_partitioned(p)]
            ahead = 0 if self._schedule is None else \
                min(self._schedule.prefetch_numel, self._schedule.max_live)
            self._in_graph = InGraphForward(self._module, groups, whole, self._group,
                                            backend, options, self._bucket_numel, ahead)
            self._grads = InGraphGrads(self.params, self._view.slices, settings,
                                       self._in_graph.homes)
        return self._in_graph

    def release_all(self) -> None:
        """Frees the gathered parameters no running forward needs (stage 3)."""
        if self._schedule is not None:
            self._schedule.release_all()

    def held_tensors(self) -> Dict[str, List[torch.Tensor]]:
        """Storage this strategy holds beyond the module's own tensors, for memory
        accounting: parameter shards (stage 3), gradient buckets or shards, fp32 masters."""
        shards = [g.flat for g in self._schedule.units.groups] if self._schedule else []
        return {"params": shards, "grads": self._grads.storage(),
                "master": list(self._view.masters)}

    def model_states(self) -> Dict[str, List[torch.Tensor]]:
        """This rank's model states by kind, under the names of DeepSpeed's
        ``OffloadStateTypeEnum``: the trainable parameters as the module holds them
        (``lp_params``; stage 3: the shards, and the parameters too small to partition), the
        optimizer's own copies of them (``hp_params``: fp32 masters of 16-bit parameters, or
        host copies; none in fp32 training, where the optimizer updates the parameters
        themselves), the gradients kept between micro-steps (``lp_grads``) and
        the flat buffers they are reduced from (``contiguous_grad_buffer``: at stages 0-1 the
        same buckets; stages 2-3 keep none between backward passes)."""
        shards = [g.flat for g in self._schedule.units.groups] if self._schedule else []
        grads = self._grads.storage()
        return {"lp_params": [p for p in self.params if not is_partitioned(p)] + shards,
                "hp_params": list(self._view.masters),
                "lp_grads": grads,
                "contiguous_grad_buffer": grads if self._grads.keeps_full else []}

    def stats(self) -> Dict[str, Any]:
        """What the strategy is doing, for diagnostics: gradient buckets (parameters and
        gradients arrived in the current backward) and, at stage 3, how gathered groups
        arrived (prefetched or on demand)."""
        buckets = self._grads.buckets
        out: Dict[str, Any] = {"stage": self.stage, "params": len(self.params),
                               "buckets": len(buckets),
                               "arrived": sum(b.arrived for b in buckets)}
        if self._schedule is not None:
            out.update(self._schedule.stats)
        return out

    def units(self) -> List[torch.nn.Module]:
        """The modules around whose forward parameters are gathered (stage 3)."""
        if self._schedule is None:
            return []
        return [m for m in self._module.modules() if id(m) in self._schedule.module_hooks]

    def remove_hooks(self) -> None:
        """Removes every hook this strategy installed (gradient hooks, stage-3 module hooks
        and attribute hooks)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        if self._schedule is not None:
            self._schedule.remove_hooks()


def build_strategy(module: torch.nn.Module, params: List[torch.nn.Parameter], zero: Any,
                   settings: ReduceSettings, group: Group, tp: Optional[Group] = None,
                   master_dtype: torch.dtype = torch.float32,
                   keep_whole: Sequence[torch.nn.Parameter] = ()) -> Strategy:
    """Assembles the strategy of ``zero.stage`` (``zero`` is the ``zero_optimization``
    config) for the trainable ``params`` of ``module`` on the data-parallel ``group``
    (``tp``: the tensor-parallel group, when the model's layers are split over one;
    ``master_dtype``: the optimizer's copies of 16-bit parameters, fp32 unless the config
    keeps bf16 masters, at stages 1-3)."""
    units = partition_model(module, group, zero, keep_whole) if zero.stage == 3 else None
    buckets = [FlatBucket(group, flat=zero.stage < 2, dtype=settings.accum_dtype)
               for group in split_into_buckets(params, int(zero.reduce_bucket_size))]
    overlap = bool(zero.overlap_comm)
    if zero.stage == 0:
        grads = FullGrads(params, buckets, overlap, settings,
                          AllReduceExchange(settings, group))
        view = OptimizerView(params, full_slices(params))
        return Strategy(0, module, params, grads, view, group, tp=tp,
                        bucket_numel=int(zero.reduce_bucket_size))
    rows = ScatterRows(buckets, group, settings, bool(zero.reduce_scatter))
    if zero.stage == 1:
        grads = FullGrads(params, buckets, overlap, settings, ScatterExchange(rows))
    else:
        grads = ShardedGrads(params, buckets, overlap, settings, rows)
    view = _sharded_view(params, group, zero.offload_optimizer, master_dtype)
    whole = [p for p in params if not is_partitioned(p)]
    gatherer = SliceGatherer(whole, int(zero.allgather_bucket_size), group)
    schedule = GatherSchedule(module, units, zero, view.refresh_masters) if units else None
    return Strategy(zero.stage, module, params, grads, view, group, gatherer, schedule, tp,
                    int(zero.reduce_bucket_size))


def build_with_experts(module: torch.nn.Module, params: List[torch.nn.Parameter],
                       experts: List[torch.nn.Parameter], zero: Any, settings: ReduceSettings,
                       group: Group, edp: Group, ep: Group,
                       master_dtype: torch.dtype = torch.float32,
                       tp: Optional[Group] = None) -> WithExperts:
    """The strategy of a model with expert-parallel MoE layers: the dense ``params`` over the
    data-parallel ``group`` at the config's stage, the ``experts`` over their
    expert-data-parallel group ``edp`` (averaged by the same ``settings``: the data-parallel
    size). At stage 3 the experts are not partitioned (each rank holds its own whole, already
    a share of the layer) and their gradients and optimizer states are sharded as at stage 2.
    With tensor parallelism (``tp``) the dense parameters' slices are as without experts; the
    experts are whole on each rank of a tensor-parallel group (which sees the same tokens),
    or AutoTP's slices of them (their squares then add up over ``tp`` in the norm)."""
    dense = build_strategy(module, params, zero, settings, group, tp, master_dtype,
                           keep_whole=experts)
    expert_zero = zero.model_copy(update={"stage": 2}) if zero.stage == 3 else zero
    return WithExperts(dense, build_strategy(module, experts, expert_zero, settings, edp, tp,
                                             master_dtype), ep)


def _sharded_view(params: List[torch.nn.Parameter], group: Group, offload: Any,
                  master_dtype: torch.dtype = torch.float32) -> OptimizerView:
    """This rank's slice of each parameter; at stage 3 a partitioned parameter's slice is
    its shard (the optimizer updates it in place when it is fp32)."""
    world, rank = group.size(), group.rank()
    on_host = offload is not None and offload.device == "cpu"
    slices = [shard_range(full_numel(p), world, rank) for p in params]
    sources = [p.ds_tensor[: hi - lo] if is_partitioned(p) else None
               for p, (lo, hi) in zip(params, slices)]
    return OptimizerView(params, slices, sources, offload=on_host,
                         pin_memory=bool(on_host and offload.pin_memory), master_dtype=master_dtype)
