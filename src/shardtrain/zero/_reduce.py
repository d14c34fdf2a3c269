"""Gradient reducers: how each rank's gradients become the averaged gradient the optimizer
steps with.

Two gradient holders (:class:`GradientHolder`) cover the four stages, one per way of
keeping gradients between micro-steps:

* :class:`FullGrads` (stages 0-1): full gradients accumulate in flat buckets (each ``.grad``
  is a view into one); at a synchronising backward each bucket goes through its exchange:
  :class:`AllReduceExchange` (stage 0) all-reduces it in place, so every rank ends up with
  the whole averaged gradient; :class:`ScatterExchange` (stage 1) reduce-scatters it, so
  each rank keeps only the averaged slices its optimizer updates.
* :class:`ShardedGrads` (stages 2 and 3): every backward's gradients are reduce-scattered
  as soon as a bucket is ready and freed at once; each rank adds its reduced slices into a
  gradient shard (:class:`ScatterRows` lays them out). No rank keeps a full gradient for
  longer than its bucket, which is why ``no_sync()`` is refused there.

Whether a backward synchronises is the caller's decision, passed to :meth:`begin_backward`
(the engine knows the accumulation boundary and ``no_sync()``); a reducer never asks. A
backward that was not announced accumulates locally, and :meth:`grads` reduces whatever
has not been reduced when the step needs it.

Buckets leave in the same order on every rank (a bucket waits for the ones before it):
collectives are matched by order, so a parameter one rank does not use must not let that
rank send its buckets in another order. A used-flag per parameter travels in the same
collective as the gradients; after the sum, a zero flag means no rank produced a gradient,
and the parameter keeps ``grad=None`` as single-process training would.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from ..comm import Group
from . import _collectives as coll
from ._buckets import FlatBucket
from ._shards import ShardLayout, full_numel

Grads = List[Optional[torch.Tensor]]


class GradientHolder(Protocol):
    """Where gradients go between backward and the step: :class:`FullGrads` (stages 0-1),
    :class:`ShardedGrads` (stages 2-3) and, once DeepCompile reduces them inside the compiled
    graphs, ``_in_graph.InGraphGrads`` answer the same calls, in this order."""

    keeps_full: bool  # a full gradient per parameter lives here between micro-steps
    received: bool    # a gradient arrived since the last :meth:`zero`
    settings: "ReduceSettings"  # how summed gradients become averages

    @property
    def buckets(self) -> List[FlatBucket]:
        """The flat buckets, in launch order."""

    def begin_forward(self) -> None:
        """A new micro-batch."""

    def begin_backward(self, sync: bool) -> None:
        """A backward starts; ``sync``: its gradients are averaged across ranks."""

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient was accumulated by autograd."""

    def end_backward(self, accumulation_steps: int) -> None:
        """The backward ended."""

    def grads(self, accumulation_steps: int) -> Grads:
        """Each parameter's averaged gradient (this rank's slice), None where no rank had one."""

    def accumulated(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's unaveraged gradient of ``param`` so far (None where none is kept)."""

    def zero(self) -> None:
        """Drops every gradient."""

    def storage(self) -> List[torch.Tensor]:
        """The tensors it holds (memory accounting)."""


class ReduceSettings:
    """How a summed gradient becomes an average (DeepSpeed's prescale/predivide rules), the
    dtype it travels in (``comm_dtype``) and the dtype micro-steps accumulate in between
    optimizer steps (``accum_dtype``; None: the parameters')."""

    def __init__(self, world_size: int, op: str = "mean", prescale: bool = False,
                 predivide_factor: float = 1.0, comm_dtype: Optional[torch.dtype] = None,
                 accum_dtype: Optional[torch.dtype] = None):
        self.world_size = world_size
        self.op = op
        self.prescale = prescale
        self.predivide_factor = predivide_factor
        self.comm_dtype = comm_dtype
        self.accum_dtype = accum_dtype

    def pre_factor(self) -> float:
        if self.op != "mean":
            return 1.0
        return 1.0 / self.world_size if self.prescale else 1.0 / self.predivide_factor

    def post_factor(self, accumulation_steps: int) -> float:
        """Applied after the sum; also averages over the accumulated micro-steps."""
        if self.op != "mean" or self.prescale:
            return 1.0 / accumulation_steps
        return self.predivide_factor / (self.world_size * accumulation_steps)


class _BucketQueue:
    """Buckets in launch order, with what is in flight. ``next`` only moves forward within
    a reduction, so a bucket is sent once and after every bucket before it."""

    def __init__(self, buckets: List[FlatBucket]):
        self.buckets = buckets
        self._where: Dict[int, Tuple[FlatBucket, int]] = {
            id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self.next = 0
        self.inflight: List[Tuple[FlatBucket, coll.Inflight]] = []

    def locate(self, param: torch.nn.Parameter) -> Tuple[FlatBucket, int]:
        return self._where[id(param)]

    def take_ready(self) -> List[FlatBucket]:
        """The buckets, in order from ``next``, whose gradients have all arrived."""
        start = self.next
        while self.next < len(self.buckets) and \
                self.buckets[self.next].arrived >= len(self.buckets[self.next].params):
            self.next += 1
        return self.buckets[start:self.next]

    def take_rest(self) -> List[FlatBucket]:
        start, self.next = self.next, len(self.buckets)
        return self.buckets[start:]

    def sent(self, bucket: FlatBucket, flight: coll.Inflight) -> None:
        bucket.launched = True
        self.inflight.append((bucket, flight))

    def drain(self) -> List[Tuple[FlatBucket, coll.Inflight]]:
        done, self.inflight = self.inflight, []
        return done

    def in_param_order(self, params: Sequence[torch.nn.Parameter], per_bucket: Grads) -> Grads:
        """``per_bucket`` (bucket by bucket, parameter by parameter) in ``params`` order."""
        by_id, flat = {}, iter(per_bucket)
        for bucket in self.buckets:
            for p in bucket.params:
                by_id[id(p)] = next(flat)
        return [by_id[id(p)] for p in params]


def _check_not_reduced(bucket: FlatBucket) -> None:
    if bucket.launched:
        raise RuntimeError(
            "A gradient arrived after its bucket was already reduced. Call backward once "
            "per micro-batch (sum the losses first) and engine.step() after each. With "
            "reentrant activation checkpointing, a parameter used both inside and outside "
            "a checkpointed region gets two gradients in one backward: set "
            "zero_optimization.overlap_comm to false, or use use_reentrant=False.")


def _flag_tensor(flags: List[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if all(flags):
        return torch.ones(len(flags), dtype=dtype, device=device)
    host = torch.tensor(flags, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _unused(flags: Optional[torch.Tensor], used_here: bool) -> set:
    """Indices whose summed used-flag is zero: no rank produced that gradient."""
    if used_here or flags is None:
        return set()  # this rank used each of them: every summed flag is non-zero
    return {i for i, used in enumerate((flags > 0).tolist()) if not used}


# -- full accumulation (stages 0 and 1) ----------------------------------------------------------

class AllReduceExchange:
    """Stage 0's exchange: a bucket is all-reduced in place, every rank keeps it whole."""

    def __init__(self, settings: ReduceSettings, group: Group):
        self.settings, self.group = settings, group

    def send(self, bucket: FlatBucket) -> coll.Inflight:
        bucket.write_flags()
        pre = self.settings.pre_factor()
        if pre != 1.0:
            bucket.grads.mul_(pre)
        return coll.all_reduce_flat(bucket.buffer, self.settings.comm_dtype, self.group)

    def land(self, bucket: FlatBucket, summed: torch.Tensor, post: float) -> None:
        if summed is not bucket.buffer:
            bucket.buffer.copy_(summed)
        if post != 1.0:
            bucket.grads.mul_(post)
        if not all(bucket.used):
            for p, used in zip(bucket.params, (bucket.flags > 0).tolist()):
                if not used:
                    p.grad = None

    def grads(self, bucket: FlatBucket) -> Grads:
        if bucket.attached:
            return [p.grad for p in bucket.params]
        return [view if used else None for view, used in zip(bucket.views, (bucket.flags > 0).tolist())]

    def reset(self) -> None:
        """Nothing is kept between steps."""


class ScatterExchange:
    """Stage 1's exchange: a bucket is reduce-scattered; the reduced slices are written back
    at this rank's positions of the flat bucket. The rest of the bucket is stale, so the
    module's ``.grad`` is cleared (as DeepSpeed does)."""

    def __init__(self, rows: "ScatterRows"):
        self.rows = rows
        self._flags: Dict[int, Tuple[torch.Tensor, bool]] = {}

    def send(self, bucket: FlatBucket) -> coll.Inflight:
        return self.rows.send(bucket, [view.view(-1) for view in bucket.views])

    def land(self, bucket: FlatBucket, mine: torch.Tensor, post: float) -> None:
        width = self.rows.width(bucket)
        if post != 1.0:
            mine[:width].mul_(post)
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            lo, hi = self.rows.slice(bucket, i)
            if hi > lo:
                view.view(-1)[lo:hi].copy_(self.rows.own(bucket, mine, i))
            p.grad = None
        # A copy of the summed flags only: a view would keep the whole reduce-scatter output
        # (a shard-sized gradient) alive until the step ends, beyond ZeRO-1's formula.
        self._flags[id(bucket)] = (mine[width:].clone(), all(bucket.used))

    def grads(self, bucket: FlatBucket) -> Grads:
        flags, used_here = self._flags.get(id(bucket), (None, True))
        unused = _unused(flags, used_here)
        out: Grads = []
        for i, view in enumerate(bucket.views):
            lo, hi = self.rows.slice(bucket, i)
            out.append(None if i in unused else view.view(-1)[lo:hi])
        return out

    def reset(self) -> None:
        self._flags.clear()


Exchange = Union[AllReduceExchange, ScatterExchange]


class FullGrads:
    """Full gradients accumulate between steps in flat buckets (each ``.grad`` a view into
    one); a synchronising backward sends each bucket through ``exchange`` (stages 0-1).

    Args:
        params: the trainable parameters, each once.
        buckets: flat buckets holding them (``reduce_bucket_size`` elements each).
        overlap: send each bucket as soon as its gradients are in, while backward goes on;
            otherwise every bucket is sent when backward ends.
        settings: the averaging rules.
        exchange: :class:`AllReduceExchange` or :class:`ScatterExchange`.
    """

    def __init__(self, params: List[torch.nn.Parameter], buckets: List[FlatBucket],
                 overlap: bool, settings: ReduceSettings, exchange: Exchange):
        self.params, self.overlap, self.settings = params, overlap, settings
        self.keeps_full = True
        self.queue = _BucketQueue(buckets)
        self.exchange = exchange
        self._sync = False
        self._passed = False  # a backward ended since the last forward
        self.zero()

    @property
    def buckets(self) -> List[FlatBucket]:
        return self.queue.buckets

    def begin_forward(self) -> None:
        """A new micro-batch: readiness is counted per backward pass."""
        for bucket in self.queue.buckets:
            bucket.arrived = 0
        self._passed = False

    def begin_backward(self, sync: bool) -> None:
        if self._passed:
            # a backward right after another, with no forward between (a pipeline stage
            # draining its micro-batches): readiness starts again
            self.begin_forward()
        self._sync = sync

    def on_grad(self, param: torch.nn.Parameter) -> None:
        bucket, index = self.queue.locate(param)
        view = bucket.views[index]
        if not bucket.attached:
            # Accumulating in another dtype (data_types.grad_accum_dtype): this backward's
            # gradient is added in, and the parameter's own is dropped.
            _check_not_reduced(bucket)
            view.add_(param.grad)
            param.grad = None
        elif param.grad.data_ptr() != view.data_ptr():
            # The gradient was replaced (zero_grad(set_to_none=True) by the user, say): what
            # autograd produced is the whole accumulated gradient now.
            view.copy_(param.grad)
            param.grad = view
        _check_not_reduced(bucket)
        bucket.used[index] = True
        bucket.arrived += 1
        self.received = True
        if self.overlap and self._sync:
            for ready in self.queue.take_ready():
                self.queue.sent(ready, self.exchange.send(ready))

    def end_backward(self, accumulation_steps: int) -> None:
        """Finishes a synchronising backward: every bucket sent, landed and averaged."""
        if self._sync:
            self._finish(accumulation_steps)
        self._sync = False
        self._passed = True

    def grads(self, accumulation_steps: int) -> Grads:
        """The averaged gradient of each parameter (of this rank's slice at stage 1), in
        ``params`` order; reduced now if no synchronising backward did it."""
        self._finish(accumulation_steps)
        per_bucket = [g for bucket in self.queue.buckets for g in self.exchange.grads(bucket)]
        return self.queue.in_param_order(self.params, per_bucket)

    def _finish(self, accumulation_steps: int) -> None:
        for bucket in self.queue.take_rest():
            self.queue.sent(bucket, self.exchange.send(bucket))
        post = self.settings.post_factor(accumulation_steps)
        for bucket, flight in self.queue.drain():
            self.exchange.land(bucket, flight.wait(), post)

    def accumulated(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's gradient of ``param`` summed over the backward passes since the last
        step, before any averaging; None when it has none or its bucket was reduced."""
        bucket, index = self.queue.locate(param)
        if bucket.launched or not bucket.used[index]:
            return None
        return bucket.views[index]

    def zero(self) -> None:
        for bucket in self.queue.buckets:
            bucket.reset()
        self.queue.drain()
        self.queue.next = 0
        self.exchange.reset()
        self._sync = False
        self.received = False  # a gradient arrived since the last step

    def storage(self) -> List[torch.Tensor]:
        return [bucket.buffer for bucket in self.queue.buckets]


# -- sharded accumulation (stages 2 and 3) -------------------------------------------------------

class ScatterRows:
    """Packs a bucket's gradients rank-major for a reduce-scatter, this rank's used-flags
    repeated in every row so that each rank receives the sum of all ranks' flags."""

    def __init__(self, buckets: List[FlatBucket], group: Group, settings: ReduceSettings,
                 use_reduce_scatter: bool):
        self.group, self.world, self.settings = group, group.size(), settings
        self.use_reduce_scatter = use_reduce_scatter
        self.layouts = {id(b): ShardLayout([full_numel(p) for p in b.params], self.world,
                                           group.rank(), extra=len(b.params))
                        for b in buckets}

    def send(self, bucket: FlatBucket, flats: Sequence[Optional[torch.Tensor]]) -> coll.Inflight:
        layout = self.layouts[id(bucket)]
        dtype = self.settings.comm_dtype or bucket.params[0].dtype
        rows = torch.empty(self.world, layout.row, dtype=dtype, device=bucket.params[0].device)
        layout.pack(flats, rows)
        rows[:, layout.params_width:] = _flag_tensor(bucket.used, dtype, rows.device)
        pre = self.settings.pre_factor()
        if pre != 1.0:
            rows.mul_(pre)
        return coll.reduce_scatter_rows(rows, self.group, self.use_reduce_scatter)

    def width(self, bucket: FlatBucket) -> int:
        """Columns of the gradients in a row (the flags follow)."""
        return self.layouts[id(bucket)].params_width

    def row(self, bucket: FlatBucket) -> int:
        return self.layouts[id(bucket)].row

    def slice(self, bucket: FlatBucket, i: int) -> Tuple[int, int]:
        """This rank's ``[lo, hi)`` of parameter ``i`` of the bucket."""
        return self.layouts[id(bucket)].slices[i]

    def own(self, bucket: FlatBucket, row: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's elements of parameter ``i`` within a reduced row."""
        return self.layouts[id(bucket)].own(row, i)


class ShardedGrads:
    """Every backward's gradients are reduce-scattered bucket by bucket and freed; this
    rank's reduced slices accumulate in one gradient shard per bucket (stages 2 and 3).

    Every backward synchronises, whatever :meth:`begin_backward` is told: keeping a full
    gradient between micro-steps is what these stages exist to avoid.
    """

    def __init__(self, params: List[torch.nn.Parameter], buckets: List[FlatBucket],
                 overlap: bool, settings: ReduceSettings, rows: "ScatterRows"):
        self.params, self.overlap, self.settings = params, overlap, settings
        self.keeps_full = False
        self.queue = _BucketQueue(buckets)  # readiness only: flat=False, no gradient storage
        self.rows = rows
        # One accumulator row per bucket: this rank's gradient slices, then summed flags.
        self.shards = {id(b): torch.zeros(self.rows.row(b), dtype=settings.accum_dtype or b.params[0].dtype,
                                          device=b.params[0].device) for b in self.queue.buckets}
        self._used_everywhere = {id(b): True for b in self.queue.buckets}
        self.zero()

    @property
    def buckets(self) -> List[FlatBucket]:
        return self.queue.buckets

    def begin_forward(self) -> None:
        """A new micro-batch: its own buckets, flags and readiness."""
        for bucket in self.queue.buckets:
            bucket.arrived = 0
            bucket.launched = False
            bucket.used = [False] * len(bucket.params)
        self.queue.next = 0

    def begin_backward(self, sync: bool) -> None:
        del sync  # every micro-step is reduced
        if any(b.launched for b in self.queue.buckets):
            # a backward right after another, with no forward between (a pipeline stage
            # draining its micro-batches): this pass reduces its own buckets
            self.begin_forward()

    def on_grad(self, param: torch.nn.Parameter) -> None:
        bucket, index = self.queue.locate(param)
        _check_not_reduced(bucket)
        bucket.used[index] = True
        bucket.arrived += 1
        self.received = True
        if self.overlap:
            for ready in self.queue.take_ready():
                self._send(ready)

    def end_backward(self, accumulation_steps: int) -> None:
        """Sends what is left of this micro-step and adds it into the gradient shards."""
        del accumulation_steps  # averaged once, when the optimizer takes the shards
        for bucket in self.queue.take_rest():
            self._send(bucket)
        for bucket, flight in self.queue.drain():
            reduced, shard = flight.wait(), self.shards[id(bucket)]
            shard.add_(reduced if reduced.dtype == shard.dtype else reduced.to(shard.dtype))

    def grads(self, accumulation_steps: int) -> Grads:
        """This rank's averaged gradient slices, in ``params`` order (None where no rank
        produced a gradient)."""
        self.end_backward(accumulation_steps)  # a micro-step not reduced yet, if any
        post = self.settings.post_factor(accumulation_steps)
        per_bucket: Grads = []
        for bucket in self.queue.buckets:
            shard, width = self.shards[id(bucket)], self.rows.width(bucket)
            if post != 1.0:
                shard[:width].mul_(post)
            unused = _unused(shard[width:], self._used_everywhere[id(bucket)])
            per_bucket += [None if i in unused else self.rows.own(bucket, shard, i)
                           for i in range(len(bucket.params))]
        return self.queue.in_param_order(self.params, per_bucket)

    def accumulated(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """None: each micro-step's gradients are reduce-scattered and freed."""
        return None

    def _send(self, bucket: FlatBucket) -> None:
        flats = [p.grad.view(-1) if used and p.grad is not None else None
                 for p, used in zip(bucket.params, bucket.used)]
        flight = self.rows.send(bucket, flats)
        for p in bucket.params:
            p.grad = None  # packed: the full gradient is not needed any more
        if not all(bucket.used):
            self._used_everywhere[id(bucket)] = False
        self.queue.sent(bucket, flight)

    def zero(self) -> None:
        for shard in self.shards.values():
            shard.zero_()
        for key in self._used_everywhere:
            self._used_everywhere[key] = True
        for p in self.params:
            p.grad = None
        self.begin_forward()
        self.queue.drain()
        self.received = False  # a gradient arrived since the last step

    def storage(self) -> List[torch.Tensor]:
        return list(self.shards.values())
