"""What every schedule of this package shares: the iteration counter, stepping, the state dict,
and the helpers that turn config values into one learning rate per param group.

DeepSpeed's schedules are not ``torch.optim.lr_scheduler`` classes and this base keeps their
contract, which checkpoints and client code rely on: the counter starts at -1, construction
from scratch writes the first learning rate into the optimizer at once, ``step(t)`` may jump to
any iteration, and the state dict is only ``{"last_batch_iteration": t}`` (every other value is
recomputed from the config). A schedule is a function of ``t``: a subclass gives
``_lr_at(t)`` and the base writes it.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

logger = logging.getLogger("shardtrain")

_WARMUP_TYPES: Tuple[str, ...] = ("log", "linear")


def _unwrap_optimizer(optimizer: Any) -> Optimizer:
    """Return the torch Optimizer itself, or the one a wrapper keeps in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch Optimizer nor wraps one in '.optimizer'")


def _per_group(value: Any, groups: Sequence[Mapping[str, Any]], name: str) -> List[float]:
    """Expand a scalar to one value per param group, or check a list's length."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {len(groups)} param groups")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def _check_positive_int(value: Any, name: str) -> None:
    """Raise ValueError unless ``value`` is an int > 0 (bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be an int > 0, got {value!r}")


def _check_warmup_type(warmup_type: str) -> str:
    """Return ``warmup_type``, or "log" with a warning when it is unknown."""
    if warmup_type in _WARMUP_TYPES:
        return warmup_type
    logger.warning("Unknown warmup_type %r (expected 'log' or 'linear'); using 'log'", warmup_type)
    return "log"


def _warmup_fraction(t: int, warmup_steps: int, warmup_type: str) -> float:
    """Warmup progress in [0, 1) for 0 <= t < warmup_steps."""
    if warmup_type == "linear":
        return t / warmup_steps
    return math.log(t + 1) / math.log(warmup_steps)


def _write_lr(group: Dict[str, Any], value: float) -> None:
    """Set a group's lr; a tensor lr is filled in place."""
    if isinstance(group.get("lr"), torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def _group_lrs(optimizer: Optimizer) -> List[float]:
    """Current lr of every param group as floats."""
    return [float(g["lr"]) for g in optimizer.param_groups]


class _StepSchedule:
    """Shared machinery: the iteration counter, stepping and the state dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1) -> None:
        self.optimizer = _unwrap_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _group_lrs(self.optimizer)

    def _lr_at(self, t: int) -> List[float]:
        raise NotImplementedError

    def _start(self) -> None:
        """Write the construction-time values when starting from scratch."""
        if self.last_batch_iteration == -1:
            self._apply(-1)

    def _apply(self, t: int) -> None:
        lrs = self._lr_at(t)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _write_lr(group, lr)
        self._last_lr = lrs

    def get_lr(self) -> List[float]:
        """Learning rates for the current iteration (initial values, with a warning, before any step)."""
        if self.last_batch_iteration < 0:
            logger.warning("%s.get_lr() called before the first step(); returning the initial values",
                           type(self).__name__)
        return self._lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> List[float]:
        """The learning rates most recently written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance to ``last_batch_iteration`` (default: current + 1) and write the new lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(last_batch_iteration)

    def state_dict(self) -> Dict[str, int]:
        """Only the iteration counter: ``{"last_batch_iteration": t}``."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the iteration counter; the next ``step()`` continues the schedule."""
        self.last_batch_iteration = state_dict["last_batch_iteration"]
