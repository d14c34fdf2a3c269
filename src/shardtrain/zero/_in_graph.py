"""ZeRO's collectives inside the compiled graphs (DeepCompile).

Eager ZeRO moves data from Python hooks: stage 3 gathers a module's parameters in a forward
pre-hook and releases them after, and every stage reduces gradients from a hook on their
accumulation. Compiled, the same collectives become nodes of the traced forward and
backward, through torch's functional collectives (:mod:`shardtrain.comm`'s in-graph ones):

* ``z3`` (stage 3): the module runs with each partitioned parameter replaced by the
  all-gather of its group's flat shard (``torch.func.functional_call``), so the graph holds
  one all-gather per group before the parameters' first use, and its backward the
  reduce-scatter that gives each rank the sum of its shard's gradient, which autograd
  accumulates into the flat shard itself. Each gather sits in a region whose recomputation
  is forced (selective activation checkpointing), so the gathered weights are not kept from
  forward to backward: backward gathers again, as eager ZeRO-3 does, and every full weight
  is freed after its last use.
  :mod:`._placement` puts each gather just before its group's first use, so one group's full
  weights are alive at a time, and the reduce-scatter follows the group's last gradient.
* ``z1`` (stages 1-2, and the parameters stage 3 keeps whole): the parameters enter the graph
  through identities whose backward reduce-scatters (sums) their gradients, one collective
  per bucket of ``reduce_bucket_size`` elements once its last gradient is in, each rank's
  row landing in the bucket's sink, so no rank keeps a full gradient past its bucket.
* ``prefetch``: each gather is issued ahead of its use, by up to ``stage3_prefetch_bucket_size``
  elements (within what a memory budget leaves), and waited for at the use (inductor).
* ``selective_gather``: the groups listed in the pass's plan keep their gathered weights
  from forward to backward instead of gathering again (small ones, within a memory budget).

Gradients land summed (not averaged) in those leaves' ``.grad``; :class:`InGraphGrads` hands
the optimizer each rank's slice, averaged, through the same :class:`GradientHolder` interface
eager reduction uses, so the step after it is the eager step.
"""
from __future__ import annotations

import functools
import itertools
import logging
import types
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..comm import Group, InGraph
from ..layout import layout_of
from ..log import log_dist
from ._buckets import split_into_buckets
from ._groups import ParamGroup
from ._placement import Placing, split_options
from ._reduce import ReduceSettings
from ._shards import ShardLayout

__all__ = ["PASSES", "InGraphGrads", "InGraphForward", "gathered_bytes"]

#: The passes a schedule may name, in the order they apply.
PASSES = ("z1", "z3", "prefetch", "selective_gather", "offload_opt_states")

Grads = List[Optional[torch.Tensor]]


def _recompute(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _keep(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


class InGraphForward:
    """What the engine runs forward through once DeepCompile is active: the compiled module
    with the collectives of ``passes`` in its graphs.

    Args:
        module: the model.
        groups: stage 3's parameter groups (empty at stages 1-2).
        whole: the trainable parameters kept whole (their gradients reduce-scattered in
            graph, in buckets of up to ``bucket_numel`` elements, as eager reduction buckets
            them).
        group: the data-parallel group.
        backend, options: ``torch.compile``'s.
        bucket_numel: ``reduce_bucket_size``.
        prefetch_numel: the most elements ``prefetch`` may gather ahead of their use.
    """

    def __init__(self, module: torch.nn.Module, groups: Sequence[ParamGroup],
                 whole: Sequence[torch.nn.Parameter], group: Group, backend: str,
                 options: Dict[str, Any], bucket_numel: int = 500_000_000,
                 prefetch_numel: int = 0):
        self.module, self.groups, self.world = module, list(groups), group.size()
        self.group = group
        self.collectives = InGraph(group)
        self.backend, self.options = backend, dict(options)
        self.prefetch_numel = prefetch_numel
        names = {id(p): n for n, p in module.named_parameters()}
        self.whole = [(names[id(p)], p) for p in whole if id(p) in names]
        index = {id(p): i for i, (_, p) in enumerate(self.whole)}
        self.buckets = [[index[id(p)] for p in bucket] for bucket in
                        split_into_buckets([p for _, p in self.whole], bucket_numel)]
        # where each parameter's reduced gradient lands: the leaf whose .grad holds this
        # rank's row (a group's flat shard, or a whole bucket's sink) and its column there
        self.homes: Dict[int, Tuple[torch.Tensor, int]] = {
            id(p): (g.flat, off) for g in self.groups
            for p, off in zip(g.params, g.layout.offsets)}
        self.sinks = [self._sink([self.whole[i][1] for i in b], group) for b in self.buckets]
        self.placed = [[(names[id(p)], off, chunk, layout_of(p).local_shape)
                        for p, off, chunk in zip(g.params, g.layout.offsets, g.layout.chunks)
                        if id(p) in names] for g in self.groups]
        self.passes: FrozenSet[str] = frozenset()
        self.kept: FrozenSet[int] = frozenset()  # groups whose gathers are saved (selective_gather)
        self.ahead = 0  # the elements gathered ahead of their use (prefetch)
        self.placing: Optional[Placing] = None
        self.compiles: List[Tuple[FrozenSet[str], int]] = []  # (passes, kept groups) per build
        self._run: Any = None
        self._traced = False
        self.breaks: List[str] = []  # where the last compilation broke the forward apart
        for g in self.groups:
            g.flat.requires_grad_(True)  # the leaf the reduce-scatter's sum lands in

    def _sink(self, params: List[torch.nn.Parameter], group: Group) -> torch.Tensor:
        """The leaf a bucket's reduce-scatter gives this rank's row to (its value unused)."""
        layout = ShardLayout([p.numel() for p in params], self.collectives.size, group.rank())
        sink = torch.empty(layout.params_width, dtype=params[0].dtype, device=params[0].device,
                           requires_grad=True)
        self.homes.update((id(p), (sink, off)) for p, off in zip(params, layout.offsets))
        return sink

    def set_passes(self, passes: Iterable[str], kept: Iterable[int] = (), ahead: int = 0) -> None:
        """Rebuilds the compiled function with ``passes``, the groups ``selective_gather``
        keeps gathered and the elements ``prefetch`` may gather ahead of their use
        (``ahead``); the next call traces and compiles anew."""
        self.passes, self.kept, self.ahead = frozenset(passes), frozenset(kept), ahead
        given, rest = split_options(self.options)
        if ahead and self.backend == "inductor":
            # a gather issued ahead is waited for where its weights are first used
            config = dict(given.get("options") or {})
            config.setdefault("reorder_for_compute_comm_overlap", True)
            config.setdefault("reorder_for_compute_comm_overlap_passes", ["sink_waits"])
            given["options"] = config
        self.placing = Placing(self.backend, given, ahead)
        self._run = torch.compile(_own_code(self._forward), backend=self.placing, **rest)
        self._traced = False
        self.compiles.append((self.passes, len(self.kept)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = ([g.flat for g in self.groups], [p for _, p in self.whole], self.sinks, args,
                  kwargs)
        if self._traced:
            return self._run(*inputs)
        from torch._dynamo import utils as _dynamo_utils  # 2 s to import: only once compiling
        seen = len(_dynamo_utils.graph_break_reasons)
        out = self._run(*inputs)  # traced and compiled now
        self._traced = True
        # one break shows once per frame torch.compile resumes through: each place once
        self.breaks = list(dict.fromkeys(
            self._where_it_broke(r) for r in _dynamo_utils.graph_break_reasons[seen:]))
        if self.breaks:
            log_dist(f"DeepCompile: the compiled forward breaks into {len(self.breaks) + 1} "
                     "graphs (the collectives of each run apart): "
                     + "; ".join(self.breaks), ranks=[0], level=logging.WARNING)
        return out

    def _where_it_broke(self, reason: Any) -> str:
        """A graph break as the module whose forward caused it, and why."""
        why = str(getattr(reason, "reason", reason)).strip().splitlines()[0]
        for frame in reversed(getattr(reason, "user_stack", None) or []):
            names = [name for name, m in self.module.named_modules()
                     if _runs(type(m).forward, frame.filename, frame.lineno)]
            if names:
                kind = type(self.module.get_submodule(names[0])).__name__
                more = f", and {len(names) - 1} more of that class" if len(names) > 1 else ""
                return f"in module '{names[0] or '(root)'}' ({kind}{more}): {why}"
        return why

    def _forward(self, flats: List[torch.Tensor], whole: List[torch.Tensor],
                 sinks: List[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        params: Dict[str, torch.Tensor] = {}
        if self.placed and "z3" not in self.passes:  # read here: a change of passes retraces
            raise RuntimeError("DeepCompile at stage 3 runs with the z3 pass")
        for i, (flat, placed) in enumerate(zip(flats, self.placed)):
            rows = self._gathered(i, flat).view(self.world, -1)
            for name, off, chunk, shape in placed:
                numel = torch.Size(shape).numel()
                params[name] = rows[:, off: off + chunk].reshape(-1)[:numel].view(shape)
        for bucket, sink in zip(self.buckets, sinks):
            same = self.collectives.scatter_grads(sink, *(whole[i] for i in bucket))
            params.update((self.whole[i][0], t) for i, t in zip(bucket, same))
        return torch.func.functional_call(self.module, params, args, kwargs)

    def _gathered(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        policy = _keep if index in self.kept else _recompute
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.collectives.gather_rows, flat, use_reentrant=False,
                          context_fn=context)


_CODES = itertools.count()


def _runs(forward: Any, filename: str, line: Optional[int]) -> bool:
    """Whether ``line`` of ``filename`` is in the function ``forward``."""
    code = getattr(forward, "__code__", None)
    if code is None or line is None or code.co_filename != filename:
        return False
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return bool(lines) and code.co_firstlineno <= line <= max(lines)


def _own_code(method: Any) -> Any:
    """``method`` bound to a code object of its own. torch.compile keeps compiled code per code
    object, with a limit of recompilations (8): every engine's module is another trace, so
    engines sharing one code object (a test suite, TRL's reference models) would reach it and
    run uncompiled."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_CODES)}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


class InGraphGrads:
    """The gradients the compiled graphs reduce-scattered: this rank's row of each stage-3
    group in the group's flat shard, of each bucket of whole parameters in the bucket's sink
    (:attr:`InGraphForward.homes`); each parameter's slice of it, averaged, for the optimizer.

    Args:
        params: the trainable parameters, in the strategy's order.
        slices: this rank's ``(lo, hi)`` of each (what the optimizer updates).
        settings: the averaging rules.
        homes: each parameter's leaf and column (by ``id``).
    """

    keeps_full = False  # no no_sync(): every backward's gradients are reduced in its graph
    buckets: List[Any] = []

    def __init__(self, params: Sequence[torch.nn.Parameter], slices: Sequence[Tuple[int, int]],
                 settings: ReduceSettings, homes: Dict[int, Tuple[torch.Tensor, int]]):
        self.params, self.slices, self.settings = list(params), list(slices), settings
        self.homes = homes
        self.leaves = list({id(leaf): leaf for leaf, _ in homes.values()}.values())
        self.received = False

    def begin_forward(self) -> None:
        pass

    def begin_backward(self, sync: bool) -> None:
        pass

    def on_grad(self, param: torch.nn.Parameter) -> None:
        self.received = True

    def end_backward(self, accumulation_steps: int) -> None:
        self.received = self.received or any(leaf.grad is not None for leaf in self.leaves)

    def grads(self, accumulation_steps: int) -> Grads:
        """Each parameter's slice of the summed gradient, averaged over ranks and micro-steps
        (None where it has none)."""
        factor = self._factor(accumulation_steps)
        out: Grads = []
        for p, (lo, hi) in zip(self.params, self.slices):
            leaf, start = self.homes.get(id(p), (None, 0))
            if leaf is None or leaf.grad is None or hi <= lo:
                out.append(None)
                continue
            out.append(leaf.grad[start: start + hi - lo] * factor)
        return out

    def _factor(self, accumulation_steps: int) -> float:
        world = self.settings.world_size if self.settings.op == "mean" else 1
        return 1.0 / (world * accumulation_steps)

    def accumulated(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return None

    def zero(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None
        for p in self.params:
            p.grad = None
        self.received = False

    def storage(self) -> List[torch.Tensor]:
        return [leaf.grad for leaf in self.leaves if leaf.grad is not None]


def gathered_bytes(group: ParamGroup) -> int:
    """The bytes a gathered group takes (its shard row times the ranks)."""
    return group.layout.row * group.layout.world * group.flat.element_size()
