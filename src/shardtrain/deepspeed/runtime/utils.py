"""``deepspeed.runtime.utils``: the helpers scripts and libraries import from here."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...log import logger
from ...layout import is_tp_split
from .. import comm as dist
from ..accelerator import get_accelerator

__all__ = ["move_to_device", "see_memory_usage", "clip_grad_norm_", "is_model_parallel_parameter"]


def move_to_device(item: Any, device, criterion_func=lambda t: True) -> Any:
    """``item`` (tensors in nested lists, tuples and dicts) with every tensor that passes
    ``criterion_func`` moved to ``device``."""
    def move(x):
        if isinstance(x, torch.Tensor) and criterion_func(x):
            return x.to(device)
        return x
    return pytree.tree_map(move, item)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Logs the device's allocated and reserved memory (only with ``force``, as DeepSpeed)."""
    if not force:
        return
    acc = get_accelerator()
    gib = 2 ** 30
    logger.info("%s | allocated %.2f GiB, max %.2f GiB, reserved %.2f GiB", message,
                acc.memory_allocated() / gib, acc.max_memory_allocated() / gib,
                acc.memory_reserved() / gib)


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` holds one model-parallel rank's slice: split by AutoTP (its layout has a tensor-parallel split) or
    marked ``model_parallel`` / ``tensor_model_parallel`` as Megatron-style layers do."""
    return is_tp_split(p) or bool(getattr(p, "model_parallel", False)
                                  or getattr(p, "tensor_model_parallel", False))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Scales the gradients of ``parameters`` so that their total ``norm_type`` norm is at
    most ``max_norm``; returns the norm before clipping (as torch's ``clip_grad_norm_``).

    With ``mpu`` (``engine.mpu`` or a Megatron-style object), the norm is the whole model's:
    the slices of model-parallel parameters (:func:`is_model_parallel_parameter`) add up over
    ``mpu.get_model_parallel_group()``; the other parameters are the same on each of its
    ranks and count once. Gradients are expected averaged over data-parallel ranks already
    (after ``engine.backward``), so no data-parallel reduction is made.
    """
    if mpu is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    with_grad = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in with_grad]
    p_norm = float(norm_type)
    device = grads[0].device if grads else torch.device(get_accelerator().current_device_name())
    inf = p_norm == math.inf

    def combined(params) -> torch.Tensor:  # max of the norms, or sum of their p-th powers
        norms = [torch.linalg.vector_norm(q.grad.detach().float(), p_norm) for q in params]
        if not norms:
            return torch.zeros((), device=device)
        return torch.stack(norms).max() if inf else torch.stack(norms).pow(p_norm).sum()

    split = [is_model_parallel_parameter(q) for q in with_grad]
    slices = _across(combined([q for q, s in zip(with_grad, split) if s]),
                     dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, mpu)
    shared = combined([q for q, s in zip(with_grad, split) if not s])
    norm = torch.maximum(slices, shared) if inf else (slices + shared).pow(1.0 / p_norm)
    coefficient = float(max_norm) / (norm.item() + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.detach().mul_(coefficient)
    return norm


def _across(value: torch.Tensor, op, mpu) -> torch.Tensor:
    """``value`` reduced with ``op`` over ``mpu``'s model-parallel group (itself when this
    rank is alone in it: a solo group's handle is None, which would mean the world)."""
    group = mpu.get_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return value
    value = value.reshape(1)
    dist.all_reduce(value, op=op, group=group)
    return value[0]
