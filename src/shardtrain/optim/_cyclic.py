"""Leslie Smith's cyclical schedules: :class:`LRRangeTest` (grow the lr to find the usable range)
and :class:`OneCycle` (one cycle over that range, with momentum cycled inversely).

DeepSpeed's formulas, stair counts and decay included; with momentum cycling, beta1 follows the
cycle and beta2 is pinned to 0.99, as DeepSpeed does.
"""
from __future__ import annotations

import logging
import math
from typing import Any, List, Optional, Sequence, Tuple, Union

from ._schedule import _check_positive_int, _per_group, _StepSchedule

logger = logging.getLogger("shardtrain")

__all__ = ["LRRangeTest", "OneCycle"]

_ONECYCLE_BETA2 = 0.99


class OneCycle(_StepSchedule):
    """One triangular lr cycle (min -> max -> min) with inverse momentum, then lr/momentum decay.

    With ``cycle_momentum`` and an optimizer that has ``betas``, beta1 is cycled and beta2 is set
    to 0.99. Construction sets lr = ``cycle_min_lr`` and betas = (``cycle_min_mom``, 0.99).

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        >>> s = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=4)
        >>> s.step(3); round(opt.param_groups[0]["lr"], 6), opt.param_groups[0]["betas"]
        (0.01, (0.8, 0.99))
    """

    def __init__(self, optimizer: Any, cycle_min_lr: Union[float, Sequence[float]],
                 cycle_max_lr: Union[float, Sequence[float]], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: Union[float, Sequence[float]] = 0.8,
                 cycle_max_mom: Union[float, Sequence[float]] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size,
                         cycle_first_stair_count, cycle_second_stair_count)
        groups = self.optimizer.param_groups
        self.min_lrs = _per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.min_moms = _per_group(cycle_min_mom, groups, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, groups, "cycle_max_mom")
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        self.decay_step_size = decay_step_size
        self.cycle_momentum = bool(cycle_momentum) and "betas" in self.optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            logger.warning("OneCycle: the optimizer has no 'betas'; momentum cycling is disabled")
        self._start()

    def _init_cycle(self, first: float, second: Optional[float], first_stairs: int,
                    second_stairs: Optional[int]) -> None:
        second = first if second is None else second
        if not first > 0:
            raise ValueError(f"cycle_first_step_size must be > 0, got {first!r}")
        if not second >= 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {second!r}")
        self.first_step_size, self.second_step_size = float(first), float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs

    def _scale(self, t: int) -> float:
        """Position in the cycle: 0 at the ends, 1 at the peak."""
        b = t + 1
        in_cycle = b % self.total_size
        rising = in_cycle <= self.first_step_size
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs and stairs > 0:
            if rising:
                pos = in_cycle * stairs / self.first_step_size
            else:
                pos = (self.total_size - in_cycle) * stairs / self.second_step_size
            return math.floor(pos) / stairs
        x = 1.0 + b / self.total_size - math.floor(1.0 + b / self.total_size)
        if x <= self.step_ratio:
            return x / self.step_ratio
        return (x - 1.0) / (self.step_ratio - 1.0)

    def _decay_factor(self, t: int, rate: float) -> float:
        """(1 + rate * d / decay_step_size) after the cycle, 1.0 when decay is off."""
        if self.decay_step_size == 0 or rate == 0:
            return 1.0
        return 1.0 + rate * (t - self.total_size + 1) / self.decay_step_size

    def _lr_at(self, t: int) -> List[float]:
        if t < 0:
            return list(self.min_lrs)
        if t < self.total_size:
            s = self._scale(t)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = self._decay_factor(t, self.decay_lr_rate)
        return [lo / factor for lo in self.min_lrs]

    def _mom_at(self, t: int) -> List[float]:
        if t < 0:
            return list(self.min_moms)
        if t < self.total_size:
            return self._cycle_mom(t)
        factor = self._decay_factor(t, self.decay_mom_rate)
        return [hi * factor for hi in self.max_moms]

    def _cycle_mom(self, t: int) -> List[float]:
        s = self._scale(t)
        return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]

    def _apply(self, t: int) -> None:
        super()._apply(t)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self._mom_at(t)):
                group["betas"] = (beta1, _ONECYCLE_BETA2)

    def get_mom(self) -> Optional[List[Tuple[float, float]]]:
        """Every group's ``betas`` for the iteration the schedule is at, or None when momentum
        is not cycled. As DeepSpeed's, it follows the cycle's formula even before the first
        step (``cycle_max_mom``), while construction wrote ``cycle_min_mom`` into the
        optimizer; from the first step on the two agree."""
        if not self.cycle_momentum:
            return None
        t = self.last_batch_iteration
        moms = self._mom_at(t) if t >= 0 else self._cycle_mom(t)
        return [(m, _ONECYCLE_BETA2) for m in moms]


class LRRangeTest(_StepSchedule):
    """Grow the lr from ``lr_range_test_min_lr`` by ``step_rate`` every ``step_size`` steps.

    lr = min * (1 + rate * (t+1)/size), with floor((t+1)/size) in staircase mode.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> s = LRRangeTest(opt, lr_range_test_min_lr=0.001, lr_range_test_step_size=2)
        >>> s.step(); round(opt.param_groups[0]["lr"], 6)
        0.0015
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Union[float, Sequence[float]] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.min_lrs = _per_group(lr_range_test_min_lr, self.optimizer.param_groups, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        self._start()

    def _lr_at(self, t: int) -> List[float]:
        if t < 0:
            return list(self.min_lrs)
        q = (t + 1) / self.step_size
        if self.staircase:
            q = math.floor(q)
        return [lo * (1.0 + self.step_rate * q) for lo in self.min_lrs]
