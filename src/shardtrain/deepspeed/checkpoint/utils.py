"""``deepspeed.checkpoint.utils``: copying tensors so that ``torch.save`` writes only their own elements."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device = _CPU) -> Any:
    """A copy of ``item`` (tensors in nested lists, tuples and dicts) with each tensor cloned
    onto ``device``, so that ``torch.save`` writes each tensor's own elements, not the whole
    storage a view points into."""
    if isinstance(item, torch.Tensor):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
