"""ZeRO stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Every rank keeps full parameters, gradients and optimizer states. Gradients live in flat
buckets (each parameter's ``.grad`` is a view into one), so accumulation needs no copies
and a bucket is all-reduced in place. Communication happens only on the backward of an
accumulation boundary: with ``overlap_comm`` a bucket is sent as soon as its last gradient
is ready, while backward goes on; otherwise all buckets are sent when backward ends.

Buckets are always sent in the same order on every rank (a bucket waits for the ones
before it): collectives are matched by order, so a parameter that one rank does not use
must not let that rank send its buckets in a different order from the others.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import comm
from ._buckets import FlatBucket, local_norm, split_into_buckets
from ._optview import OptimizerView, full_slices


class ReduceSettings:
    """How a summed gradient becomes an average (DeepSpeed's prescale/predivide rules)."""

    def __init__(self, world_size: int, op: str = "mean", prescale: bool = False,
                 predivide_factor: float = 1.0, comm_dtype: Optional[torch.dtype] = None):
        self.world_size = world_size
        self.op = op
        self.prescale = prescale
        self.predivide_factor = predivide_factor
        self.comm_dtype = comm_dtype

    def pre_factor(self) -> float:
        if self.op != "mean":
            return 1.0
        return 1.0 / self.world_size if self.prescale else 1.0 / self.predivide_factor

    def post_factor(self, accumulation_steps: int) -> float:
        """Applied after the sum; also averages over the accumulated micro-steps."""
        if self.op != "mean" or self.prescale:
            return 1.0 / accumulation_steps
        return self.predivide_factor / (self.world_size * accumulation_steps)


class DataParallel:
    """Stage-0 strategy: full replicas, gradients averaged by bucketed all-reduce.

    Args:
        params: the trainable parameters (requires_grad), each listed once.
        bucket_numel: ``reduce_bucket_size``, in elements.
        overlap: send each bucket as soon as it is full during backward.
        reduce: averaging rules.
        should_reduce: asked when a gradient arrives; False off the accumulation boundary
            and inside ``no_sync()``.
    """

    stage = 0
    supports_no_sync = True
    keeps_full_grads = True  # gradients accumulate in flat buckets between steps

    def __init__(self, params: List[torch.nn.Parameter], bucket_numel: int, overlap: bool,
                 reduce: ReduceSettings, should_reduce: Callable[[], bool]):
        self.params = params
        self.overlap = overlap
        self.reduce = reduce
        self._should_reduce = should_reduce
        self.buckets = [FlatBucket(group, flat=self.keeps_full_grads)
                        for group in split_into_buckets(params, bucket_numel)]
        self._where: Dict[int, Tuple[FlatBucket, int]] = {}
        for bucket in self.buckets:
            for index, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, index)
        self._next = 0  # index of the next bucket to send: buckets leave in order
        self._pending: List[tuple] = []
        self._reduced = False
        self.view = self._build_view()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.zero_grads()

    def _build_view(self) -> OptimizerView:
        return OptimizerView(self.params, full_slices(self.params))

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        self.view.adopt(optimizer)

    # -- backward ---------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A new micro-batch: readiness is counted per backward pass, so it restarts here."""
        for bucket in self.buckets:
            bucket.arrived = 0

    def compile(self, module: torch.nn.Module, backend: str, options: dict):
        """Returns the callable the engine runs forward through: the compiled module."""
        return torch.compile(module, backend=backend, **options)

    def end_forward(self, grad_enabled: bool) -> None:
        """Forward finished (stage 3 frees what backward will not need)."""

    def begin_backward(self) -> None:
        """Backward is starting (stage 3 stops releasing parameters until it ends)."""

    def release_all(self) -> None:
        """Frees gathered parameters (stage 3); every parameter is whole here."""

    def param_storage(self) -> List[torch.Tensor]:
        """Parameter storage beyond the module's own tensors (stage 3 shards)."""
        return []

    def reduces_in_backward(self) -> bool:
        """Whether the backward now running communicates (the engine then calls
        :meth:`end_backward` when it ends)."""
        return self._should_reduce()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket, index = self._where[id(param)]
        view = bucket.views[index]
        if param.grad.data_ptr() != view.data_ptr():
            # The gradient was replaced (e.g. zero_grad(set_to_none=True) by the user):
            # what autograd produced is the whole accumulated gradient now.
            view.copy_(param.grad)
            param.grad = view
        self._check_not_reduced(bucket)
        bucket.used[index] = True
        bucket.arrived += 1
        if self.overlap and self._should_reduce():
            self._launch_ready()

    def _check_not_reduced(self, bucket) -> None:
        if bucket.launched or self._reduced:
            raise RuntimeError(
                "A gradient arrived after its bucket was already reduced. Call backward once "
                "per micro-batch (sum the losses first) and engine.step() after each. With "
                "reentrant activation checkpointing, a parameter used both inside and outside "
                "a checkpointed region gets two gradients in one backward: set "
                "zero_optimization.overlap_comm to false, or use use_reentrant=False.")

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.arrived < len(bucket.params):
                return
            self._launch(bucket)

    def _launch_all(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: FlatBucket) -> None:
        bucket.write_flags()
        pre = self.reduce.pre_factor()
        if pre != 1.0:
            bucket.grads.mul_(pre)
        wire = bucket.buffer
        if self.reduce.comm_dtype is not None and self.reduce.comm_dtype != wire.dtype:
            wire = wire.to(self.reduce.comm_dtype)
        work = comm.all_reduce(wire, "sum", async_op=True)
        bucket.launched = True
        self._next += 1
        self._pending.append((bucket, work, wire))

    def end_backward(self, accumulation_steps: int) -> None:
        """Sends what is left, waits for every bucket and turns sums into averages.

        Idempotent within a step: the engine calls it when backward ends and again in step().
        """
        if self._reduced:
            return
        self._launch_all()
        post = self.reduce.post_factor(accumulation_steps)
        for bucket, work, wire in self._pending:
            work.wait()
            if wire is not bucket.buffer:
                bucket.buffer.copy_(wire)
            if post != 1.0:
                bucket.grads.mul_(post)
            self._drop_globally_unused(bucket)
        self._pending.clear()
        self._reduced = True

    @staticmethod
    def _drop_globally_unused(bucket: FlatBucket) -> None:
        if all(bucket.used):
            return  # this rank used them all, so every summed flag is non-zero: no sync needed
        for p, used in zip(bucket.params, (bucket.flags > 0).tolist()):
            if not used:
                p.grad = None

    # -- step ---------------------------------------------------------------------------------

    def optimizer_grads(self, accumulation_steps: int) -> List[torch.Tensor]:
        """Finishes the reduction and gives the optimizer its gradients (fp32)."""
        self.end_backward(accumulation_steps)
        return self.view.load_grads([p.grad for p in self.params])

    def global_norm(self, grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """L2 norm over all gradients. They are replicated after the all-reduce, so the
        local norm is the global one and no collective is needed."""
        return local_norm(grads, device)

    def after_step(self) -> None:
        """Every rank updated its full replica: only 16-bit copies need refreshing."""
        self.view.copy_masters_to_params()

    def zero_grads(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._pending.clear()
        self._next = 0
        self._reduced = False
        self.view.release_grads()

    def state_tensors(self) -> List[torch.Tensor]:
        """Gradient storage this strategy owns (for memory accounting)."""
        return [bucket.buffer for bucket in self.buckets]

    def master_tensors(self) -> List[torch.Tensor]:
        return list(self.view.masters)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
