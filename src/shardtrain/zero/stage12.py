"""ZeRO stages 1 and 2: optimizer states (stage 1) and gradients too (stage 2) sharded.

Every parameter is cut evenly across ranks (``_shards``); the optimizer holds only this
rank's slice of each (fp32 master copies in 16-bit modes), so its states take 1/N of the
memory. After the step each rank's updated slices are all-gathered back into the full
parameters, in buckets of ``allgather_bucket_size`` elements.

* Stage 1 keeps full gradients while they accumulate (views into flat buckets, as stage 0);
  at the accumulation boundary each bucket is reduce-scattered, so each rank receives the
  averaged gradient of its own slices only.
* Stage 2 reduce-scatters every micro-step's gradients as soon as a bucket is ready and
  frees them at once: no rank keeps a full gradient for longer than its bucket. Each
  micro-step's reduced slice accumulates into the rank's gradient shard.

The true global gradient norm is the square root of the sum of every rank's squared
slice norms; it is all-reduced once per step, so clipping and fp16 overflow decisions agree
on every rank.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .. import comm
from ._buckets import FlatBucket, local_norm, split_into_buckets
from ._optview import OptimizerView
from ._shards import ShardLayout, full_numel, shard_range
from .stage0 import DataParallel, ReduceSettings


class ZeroStage1(DataParallel):
    """Stage 1: sharded optimizer states; gradients reduce-scattered at the boundary.

    Args (beyond :class:`DataParallel`'s):
        gather_numel: ``allgather_bucket_size``, in elements.
        world, rank: the data-parallel group.
        use_reduce_scatter: False all-reduces buckets instead (``reduce_scatter: false``).
        offload, pin_memory: optimizer states and fp32 masters in (pinned) host memory, the
            optimizer stepping there (``offload_optimizer: {device: cpu}``).
    """

    stage = 1

    def __init__(self, params: List[torch.nn.Parameter], bucket_numel: int, overlap: bool,
                 reduce: ReduceSettings, should_reduce: Callable[[], bool],
                 gather_numel: int, world: int, rank: int, use_reduce_scatter: bool = True,
                 offload: bool = False, pin_memory: bool = False):
        self.world, self.rank = world, rank
        self.use_reduce_scatter = use_reduce_scatter
        self.offload, self.pin_memory = offload, pin_memory
        self.slices = [shard_range(full_numel(p), world, rank) for p in params]
        self._global_flags: dict = {}
        super().__init__(params, bucket_numel, overlap, reduce, should_reduce)
        self.layouts = {id(b): ShardLayout([full_numel(p) for p in b.params], world, rank,
                                           extra=len(b.params)) for b in self.buckets}
        self.gather_groups = [(group, ShardLayout([full_numel(p) for p in group], world, rank))
                              for group in split_into_buckets(params, gather_numel)]

    def _build_view(self) -> OptimizerView:
        return OptimizerView(self.params, self.slices, offload=self.offload,
                             pin_memory=self.pin_memory)

    # -- the reduce-scatter -------------------------------------------------------------------

    def _comm_dtype(self, like: torch.Tensor) -> torch.dtype:
        return self.reduce.comm_dtype or like.dtype

    def _scatter_input(self, bucket, flats: List[Optional[torch.Tensor]],
                       flags: List[bool]) -> torch.Tensor:
        """Packs gradients rank-major, with this rank's used-flags repeated in every row so
        that each rank receives the sum of all ranks' flags."""
        layout = self.layouts[id(bucket)]
        dtype = self._comm_dtype(bucket.params[0])
        rows = torch.empty(self.world, layout.row, dtype=dtype, device=bucket.params[0].device)
        layout.pack(flats, rows)
        rows[:, layout.params_width:] = _flag_tensor(flags, dtype, rows.device)
        pre = self.reduce.pre_factor()
        if pre != 1.0:
            rows.mul_(pre)
        return rows

    def _send(self, bucket, rows: torch.Tensor) -> None:
        if self.use_reduce_scatter:
            out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
            work = comm.reduce_scatter(out, rows.view(-1), async_op=True)
        else:  # reduce_scatter: false sums every row everywhere (twice the traffic)
            out = rows[self.rank]
            work = comm.all_reduce(rows, async_op=True)
        bucket.launched = True
        self._next += 1
        self._pending.append((bucket, work, out, rows))  # rows must live until the wait

    def _launch(self, bucket: FlatBucket) -> None:
        flats = [view.view(-1) for view in bucket.views]
        self._send(bucket, self._scatter_input(bucket, flats, bucket.used))

    def end_backward(self, accumulation_steps: int) -> None:
        if self._reduced:
            return
        self._launch_all()
        post = self.reduce.post_factor(accumulation_steps)
        for bucket, work, out, _ in self._pending:
            work.wait()
            if post != 1.0:
                out[: self.layouts[id(bucket)].params_width].mul_(post)
            self._keep_own_slices(bucket, out)
        self._pending.clear()
        self._reduced = True

    def _keep_own_slices(self, bucket: FlatBucket, out: torch.Tensor) -> None:
        """Writes the reduced slices into the flat bucket at this rank's positions; the rest
        of the bucket is stale, so the module's ``.grad`` is cleared (DeepSpeed does too)."""
        layout = self.layouts[id(bucket)]
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            lo, hi = layout.slices[i]
            if hi > lo:
                view.view(-1)[lo:hi].copy_(layout.own(out, i))
            p.grad = None
        # A copy of the summed flags only: a view would keep the whole reduce-scatter output
        # (a shard-sized gradient) alive until the step ends, beyond the ZeRO-1 formula.
        self._global_flags[id(bucket)] = (out[layout.params_width:].clone(), all(bucket.used))

    def _reduced_slices(self) -> List[Optional[torch.Tensor]]:
        grads = []
        for bucket in self.buckets:
            layout = self.layouts[id(bucket)]
            unused = self._globally_unused(bucket)
            for i, view in enumerate(bucket.views):
                lo, hi = layout.slices[i]
                grads.append(None if i in unused else view.view(-1)[lo:hi])
        return self._in_param_order(grads)

    def _globally_unused(self, bucket) -> set:
        flags, all_used = self._global_flags.get(id(bucket), (None, True))
        if all_used or flags is None:
            return set()  # this rank used each of them: every summed flag is non-zero
        return {i for i, used in enumerate((flags > 0).tolist()) if not used}

    def _in_param_order(self, per_bucket: List[Optional[torch.Tensor]]) -> List:
        by_id = {}
        k = 0
        for bucket in self.buckets:
            for p in bucket.params:
                by_id[id(p)] = per_bucket[k]
                k += 1
        return [by_id[id(p)] for p in self.params]

    # -- the step ----------------------------------------------------------------------------

    def optimizer_grads(self, accumulation_steps: int) -> List[torch.Tensor]:
        self.end_backward(accumulation_steps)
        return self.view.load_grads(self._reduced_slices())

    def global_norm(self, grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Every rank holds distinct slices: the squared norms add up across ranks."""
        squared = local_norm(grads, device).square().reshape(1).to(device)
        comm.all_reduce(squared)  # offloaded gradients sit in host memory: reduce on device
        return squared.sqrt()[0]

    def after_step(self) -> None:
        """Copies updated masters into this rank's slices, then all-gathers every slice."""
        self.view.copy_masters_to_params()
        pending = []
        for group, layout in self.gather_groups:
            p0 = group[0]
            mine = torch.empty(layout.row, dtype=p0.dtype, device=p0.device)
            for i, p in enumerate(group):
                lo, hi = layout.slices[i]
                if hi > lo:
                    layout.own(mine, i).copy_(p.data.view(-1)[lo:hi])
            gathered = torch.empty(self.world, layout.row, dtype=p0.dtype, device=p0.device)
            pending.append((group, layout, gathered,
                            comm.all_gather(gathered.view(-1), mine, async_op=True), mine))
        with torch.no_grad():
            for group, layout, gathered, work, _ in pending:
                work.wait()
                layout.unpack(gathered, [p.data.view(-1) for p in group])

    def zero_grads(self) -> None:
        super().zero_grads()
        self._global_flags.clear()


class ZeroStage2(ZeroStage1):
    """Stage 2: gradients reduce-scattered every micro-step into per-rank shards."""

    stage = 2
    supports_no_sync = False
    keeps_full_grads = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # One accumulator row per bucket: this rank's gradient slices, then summed flags.
        self.shards = {id(b): torch.zeros(self.layouts[id(b)].row, dtype=b.params[0].dtype,
                                          device=b.params[0].device) for b in self.buckets}
        self._used_everywhere = {id(b): True for b in self.buckets}
        self._micro_reduced = False
        self.zero_grads()

    def reduces_in_backward(self) -> bool:
        return True  # every micro-step's gradients are reduced (no_sync is refused)

    def begin_forward(self) -> None:
        super().begin_forward()
        for bucket in self.buckets:
            bucket.launched = False
            bucket.used = [False] * len(bucket.params)
        self._next = 0
        self._micro_reduced = False

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket, index = self._where[id(param)]
        if bucket.launched:
            self._check_not_reduced(bucket)
        bucket.used[index] = True
        bucket.arrived += 1
        if self.overlap:
            self._launch_ready()

    def _launch(self, bucket: FlatBucket) -> None:
        flats = [p.grad.view(-1) if used and p.grad is not None else None
                 for p, used in zip(bucket.params, bucket.used)]
        rows = self._scatter_input(bucket, flats, bucket.used)
        for p in bucket.params:
            p.grad = None  # packed: the full gradient is not needed any more
        if not all(bucket.used):
            self._used_everywhere[id(bucket)] = False
        self._send(bucket, rows)

    def end_backward(self, accumulation_steps: int) -> None:
        """Waits for this micro-step's buckets and adds them into the gradient shards."""
        if self._micro_reduced:
            return
        self._launch_all()
        for bucket, work, out, _ in self._pending:
            work.wait()
            shard = self.shards[id(bucket)]
            shard.add_(out if out.dtype == shard.dtype else out.to(shard.dtype))
        self._pending.clear()
        self._micro_reduced = True

    def optimizer_grads(self, accumulation_steps: int) -> List[torch.Tensor]:
        self.end_backward(accumulation_steps)
        post = self.reduce.post_factor(accumulation_steps)
        grads = []
        for bucket in self.buckets:
            layout, shard = self.layouts[id(bucket)], self.shards[id(bucket)]
            if post != 1.0:
                shard[: layout.params_width].mul_(post)
            self._global_flags[id(bucket)] = (shard[layout.params_width:],
                                              self._used_everywhere[id(bucket)])
            unused = self._globally_unused(bucket)
            grads.extend(None if i in unused else layout.own(shard, i)
                         for i in range(len(bucket.params)))
        return self.view.load_grads(self._in_param_order(grads))

    def zero_grads(self) -> None:
        if not hasattr(self, "shards"):
            return  # called by the base constructor before the shards exist
        for shard in self.shards.values():
            shard.zero_()
        for key in self._used_everywhere:
            self._used_everywhere[key] = True
        for p in self.params:
            p.grad = None
        for bucket in self.buckets:
            bucket.launched = False
            bucket.used = [False] * len(bucket.params)
        self._pending.clear()
        self._next = 0
        self._micro_reduced = False
        self._global_flags.clear()
        self.view.release_grads()

    def state_tensors(self) -> List[torch.Tensor]:
        return list(self.shards.values())


def _flag_tensor(flags: List[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if all(flags):
        return torch.ones(len(flags), dtype=dtype, device=device)
    host = torch.tensor(flags, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
