"""``deepspeed.runtime.utils``: the helpers scripts and libraries import from here."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...log import logger
from ..accelerator import get_accelerator

__all__ = ["move_to_device", "see_memory_usage", "clip_grad_norm_"]


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


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None):
    """torch's ``clip_grad_norm_`` (one data-parallel group: gradients are already averaged)."""
    if mpu is not None:
        raise NotImplementedError("clip_grad_norm_(mpu=...): model parallelism is not supported.")
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
