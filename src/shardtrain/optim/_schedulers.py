"""The scheduler factory: a DeepSpeed ``scheduler`` block to one of this package's schedules, or
to any ``torch.optim.lr_scheduler`` class.

DeepSpeed's schedule names are case-sensitive, as in DeepSpeed; a name that is neither one of
them nor a torch scheduler fails with both lists and a "did you mean". A torch scheduler gets
the torch optimizer itself, unwrapped, because torch checks the type.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from torch.optim import lr_scheduler as _torch_sched

from ._cyclic import LRRangeTest, OneCycle
from ._schedule import _unwrap_optimizer
from ._spec import _check_kwargs, _did_you_mean, _split_spec
from ._warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["DS_SCHEDULER_NAMES", "build_scheduler"]

#: Scheduler names of this package (case-sensitive).
DS_SCHEDULER_NAMES: Tuple[str, ...] = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

_OUR_SCHEDULERS: Dict[str, type] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _torch_scheduler_classes() -> Dict[str, type]:
    """Public scheduler classes of ``torch.optim.lr_scheduler`` (not the base classes)."""
    bases = {"LRScheduler", "_LRScheduler"}
    found = {}
    for attr in dir(_torch_sched):
        obj = getattr(_torch_sched, attr)
        if attr.startswith("_") or attr in bases or not isinstance(obj, type):
            continue
        if issubclass(obj, (_torch_sched.LRScheduler, _torch_sched.ReduceLROnPlateau)):
            found[attr] = obj
    return found


def build_scheduler(spec: Mapping[str, Any], optimizer: Any) -> Any:
    """Build an lr scheduler from a DeepSpeed ``scheduler`` config block.

    ``type`` is one of :data:`DS_SCHEDULER_NAMES` (case-sensitive) or a
    ``torch.optim.lr_scheduler`` class name; ``params`` are its keyword arguments.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> build_scheduler({"type": "StepLR", "params": {"step_size": 2}}, opt).__class__.__name__
        'StepLR'
    """
    name, kwargs = _split_spec(spec, "scheduler")
    if name in _OUR_SCHEDULERS:
        cls = _OUR_SCHEDULERS[name]
    else:
        torch_classes = _torch_scheduler_classes()
        if name not in torch_classes:
            hint = _did_you_mean(name, list(_OUR_SCHEDULERS) + sorted(torch_classes))
            raise ValueError(
                f"'{name}' is not a known LR scheduler. Use one of {list(DS_SCHEDULER_NAMES)} or a "
                f"torch.optim.lr_scheduler class: {sorted(torch_classes)}.{hint}")
        cls = torch_classes[name]
        optimizer = _unwrap_optimizer(optimizer)
    _check_kwargs(cls, kwargs, {"optimizer"}, f"Scheduler '{name}'")
    return cls(optimizer, **kwargs)
