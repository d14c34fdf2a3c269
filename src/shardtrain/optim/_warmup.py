"""The warmup schedules: :class:`WarmupLR` (warm up, then hold), :class:`WarmupDecayLR` (then a
linear decay to 0) and :class:`WarmupCosineLR` (then a cosine decay, as a ratio of each group's
lr).

The formulas, including the log-shaped warmup by default and the floor of two warmup steps, are
DeepSpeed's, so a config tuned under DeepSpeed follows the same curve here.
"""
from __future__ import annotations

import logging
import math
from typing import Any, List, Optional, Sequence, Union

from ._schedule import (
    _check_positive_int,
    _check_warmup_type,
    _group_lrs,
    _per_group,
    _StepSchedule,
    _warmup_fraction,
)

logger = logging.getLogger("shardtrain")

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]


class WarmupLR(_StepSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``warmup_max_lr=None`` uses each group's current lr. Construction sets the lr to the minimum.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        >>> s = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
        >>> s.step(); s.step(); round(opt.param_groups[0]["lr"], 6)
        0.001
    """

    def __init__(self, optimizer: Any, warmup_min_lr: Union[float, Sequence[float]] = 0.0,
                 warmup_max_lr: Optional[Union[float, Sequence[float]]] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        groups = self.optimizer.param_groups
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        max_lr = _group_lrs(self.optimizer) if warmup_max_lr is None else warmup_max_lr
        self.max_lrs = _per_group(max_lr, groups, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self._start()

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lr_at(self, t: int) -> List[float]:
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR` followed by a linear decay to 0 at ``total_num_steps``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> s = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=10)
        >>> s.step(11); round(opt.param_groups[0]["lr"], 6)
        0.009
    """

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: Union[float, Sequence[float]] = 0.0,
                 warmup_max_lr: Union[float, Sequence[float]] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupDecayLR: total_num_steps %s is smaller than warmup_num_steps %s",
                           total_num_steps, self.warmup_num_steps)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return super()._gamma(t)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - t) / span)


class WarmupCosineLR(_StepSchedule):
    """Scale each group's construction lr by a warmup ratio, then a cosine decay to ``cos_min_ratio``.

    Construction sets the lr to 0.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
        >>> s = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=10)
        >>> s.step(19); round(opt.param_groups[0]["lr"], 9)
        1e-06
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = _group_lrs(self.optimizer)
        if total_num_steps < self.warmup_num_steps:
            logger.warning("WarmupCosineLR: total_num_steps %s is smaller than warmup_num_steps %s",
                           total_num_steps, self.warmup_num_steps)
        self._start()

    def _ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            frac = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """The multiplier applied to the base lrs at the current iteration."""
        return self._ratio(self.last_batch_iteration)

    def _lr_at(self, t: int) -> List[float]:
        ratio = self._ratio(t)
        return [base * ratio for base in self.base_lrs]
