"""Flat gradient buckets shared by the ZeRO strategies.

A bucket is one flat buffer holding the gradients of several parameters, in the order
backward tends to produce them (the reverse of registration order), plus one "used" flag
per parameter. Collectives move whole buckets, never one parameter at a time.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ._shards import full_numel


def split_into_buckets(params: Sequence[torch.nn.Parameter], bucket_numel: int
                       ) -> List[List[torch.nn.Parameter]]:
    """Groups parameters (same dtype and device per bucket) in reverse order, each group
    holding at most ``bucket_numel`` elements unless a single parameter is larger."""
    buckets: List[List[torch.nn.Parameter]] = []
    current: List[torch.nn.Parameter] = []
    size = 0
    for p in reversed(list(params)):
        numel = full_numel(p)
        compatible = not current or (p.dtype == current[0].dtype
                                     and p.device == current[0].device)
        if current and (size + numel > bucket_numel or not compatible):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += numel
    if current:
        buckets.append(current)
    return buckets


class FlatBucket:
    """Gradients of ``params`` as views into one flat buffer, then one flag per parameter.

    The flags travel in the same collective as the gradients: after a sum, a flag of zero
    means no rank produced a gradient for that parameter, so it keeps ``grad=None`` and the
    optimizer leaves it alone, exactly as single-process training would.

    With ``flat=False`` the bucket only tracks readiness (stage 2 keeps no full gradients).
    With a ``dtype`` other than the parameters' (fp32 accumulation of 16-bit gradients), the
    views cannot be ``.grad``: the bucket is not ``attached`` and each backward's gradient is
    added into it.
    """

    def __init__(self, params: List[torch.nn.Parameter], flat: bool = True,
                 dtype: Optional[torch.dtype] = None):
        self.params = params
        self.numel = sum(full_numel(p) for p in params)
        self.views: List[torch.Tensor] = []
        self.buffer = self.grads = self.flags = None
        self.attached = dtype in (None, params[0].dtype)
        if flat:
            self.buffer = torch.zeros(self.numel + len(params), dtype=dtype or params[0].dtype,
                                      device=params[0].device)
            self.grads = self.buffer[: self.numel]
            self.flags = self.buffer[self.numel:]
            offset = 0
            for p in params:
                self.views.append(self.buffer[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        self.used = [False] * len(params)   # produced a gradient since the last step
        self.arrived = 0                    # gradients arrived in the current backward
        self.launched = False

    def reset(self) -> None:
        """Zeroes the buffer and re-attaches every view as its parameter's gradient."""
        self.buffer.zero_()
        for p, view in zip(self.params, self.views):
            p.grad = view if self.attached else None
        self.used = [False] * len(self.params)
        self.arrived = 0
        self.launched = False

    def write_flags(self) -> None:
        # No blocking host-to-device copy here: a pageable copy would stall the host until
        # the device drained its queue, once per step. The common case is a fill.
        if all(self.used):
            self.flags.fill_(1)
            return
        host = torch.tensor(self.used, dtype=self.buffer.dtype, pin_memory=self.buffer.is_cuda)
        self.flags.copy_(host, non_blocking=True)


def local_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of a list of tensors, computed as ``torch.nn.utils.clip_grad_norm_`` does
    (per-tensor norms, then the norm of those), so clipping matches it to the last bit."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm(list(grads), 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
