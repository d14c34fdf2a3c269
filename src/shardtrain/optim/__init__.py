"""Optimizers and learning-rate schedulers built from DeepSpeed-style config blocks.

This module turns the ``optimizer`` and ``scheduler`` blocks of a DeepSpeed config
(``{"type": ..., "params": {...}}``) into plain PyTorch objects:

* :func:`build_optimizer` maps the DeepSpeed optimizer names (``adam``, ``adamw``,
  ``adagrad``; case-insensitive) onto ``torch.optim`` classes with DeepSpeed's
  defaults, and falls back to ``torch.optim.<type>`` for any other name.
* :class:`WarmupLR`, :class:`WarmupDecayLR`, :class:`WarmupCosineLR`,
  :class:`OneCycle` and :class:`LRRangeTest` reproduce DeepSpeed's schedule
  formulas. They count ``last_batch_iteration`` from -1, write the construction
  learning rate into the optimizer immediately and keep only
  ``{"last_batch_iteration": t}`` in their state dict.
* :func:`build_scheduler` builds one of those five by name, or any
  ``torch.optim.lr_scheduler`` class.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = build_optimizer({"type": "Adam", "params": {"lr": 0.01}}, model.parameters())
    >>> sched = build_scheduler(
    ...     {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}, opt)
    >>> opt.param_groups[0]["lr"]
    0.0
"""
from __future__ import annotations

import difflib
import inspect
import logging
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch_sched

logger = logging.getLogger("shardtrain")

__all__ = [
    "DS_OPTIMIZER_NAMES",
    "DS_SCHEDULER_NAMES",
    "build_optimizer",
    "build_scheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]

#: Optimizer names matched case-insensitively (as DeepSpeed does).
DS_OPTIMIZER_NAMES: Tuple[str, ...] = ("adam", "adamw", "lamb", "lion", "adagrad")
#: Names DeepSpeed lower-cases but that shardtrain does not provide.
_UNAVAILABLE_OPTIMIZERS: Tuple[str, ...] = ("lamb", "lion", "muon", "muadam", "muadamw", "musgd")
#: Scheduler names of this module (case-sensitive).
DS_SCHEDULER_NAMES: Tuple[str, ...] = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

_DS_ADAM_DEFAULTS: Dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ADAM_EXTRA_KEYS: Tuple[str, ...] = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none")
_WARMUP_TYPES: Tuple[str, ...] = ("log", "linear")
_ONECYCLE_BETA2 = 0.99

ParamsLike = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]


# --------------------------------------------------------------------------- helpers
def _split_spec(spec: Mapping[str, Any], kind: str) -> Tuple[str, Dict[str, Any]]:
    """Return ``(type, copy of params)`` from a config block, validating its shape."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"The {kind} config must be a mapping, got {type(spec).__name__}")
    name = spec.get("type")
    if name is None:
        raise ValueError(f"The {kind} config needs a 'type' key")
    if not isinstance(name, str):
        raise TypeError(f"The {kind} 'type' must be a string, got {type(name).__name__}: {name!r}")
    params = spec.get("params")
    params = {} if params is None else params
    if not isinstance(params, Mapping):
        raise TypeError(f"The {kind} 'params' must be a mapping, got {type(params).__name__}")
    return name, dict(params)


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A case-insensitive " Did you mean 'X'?" suffix, or an empty string."""
    by_lower: Dict[str, str] = {}
    for cand in candidates:
        by_lower.setdefault(cand.lower(), cand)
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return f" Did you mean '{by_lower[close[0]]}'?" if close else ""


def _keyword_names(target: Any, skip: Set[str]) -> Tuple[Optional[Set[str]], Set[str]]:
    """(accepted keyword names or None when ``**kwargs`` is taken, required names)."""
    accepted: Set[str] = set()
    required: Set[str] = set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    var_kw = False
    for pname, param in inspect.signature(target).parameters.items():
        var_kw = var_kw or param.kind is inspect.Parameter.VAR_KEYWORD
        if pname in skip or param.kind not in kinds:
            continue
        accepted.add(pname)
        if param.default is inspect.Parameter.empty:
            required.add(pname)
    return (None if var_kw else accepted), required


def _check_kwargs(target: Any, kwargs: Mapping[str, Any], skip: Set[str], label: str,
                  extra: Iterable[str] = ()) -> None:
    """Raise ValueError for unknown or missing keyword arguments of ``target``."""
    accepted, required = _keyword_names(target, skip)
    if accepted is not None:
        allowed = accepted | set(extra)
        bad = sorted(k for k in kwargs if k not in allowed)
        if bad:
            raise ValueError(f"{label} got unknown parameter(s) {bad}; accepted keys are {sorted(allowed)}")
    missing = sorted(required - set(kwargs))
    if missing:
        raise ValueError(f"{label} needs the parameter(s) {missing} in its 'params' block")


def _unwrap_optimizer(optimizer: Any) -> Optimizer:
    """Return the torch Optimizer itself, or the one a wrapper keeps in ``.optimizer``."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch Optimizer nor wraps one in '.optimizer'")


# --------------------------------------------------------------------------- optimizers
def _torch_optimizer_classes() -> Dict[str, type]:
    """Optimizer classes exported by ``torch.optim`` (not the base class)."""
    found = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if isinstance(obj, type) and issubclass(obj, Optimizer) and obj is not Optimizer:
            found[attr] = obj
    return found


def _group_has_params(group: Mapping[str, Any]) -> bool:
    """True when a param-group dict holds at least one parameter."""
    params = group.get("params", [])
    if isinstance(params, torch.Tensor):
        return True
    return len(list(params)) > 0


def _prepare_params(params: ParamsLike) -> List[Any]:
    """Materialise ``params``; param-group dicts without parameters are dropped."""
    items = list(params)
    if not items or not all(isinstance(item, Mapping) for item in items):
        return items
    kept = []
    for group in items:
        group = dict(group)
        if not isinstance(group.get("params", []), torch.Tensor):
            group["params"] = list(group.get("params", []))
        if _group_has_params(group):
            kept.append(group)
    return kept


def _instantiate(cls: type, label: str, params: List[Any], kwargs: Dict[str, Any],
                 extra: Iterable[str] = ()) -> Optimizer:
    """Check keyword names against ``cls`` and build it."""
    _check_kwargs(cls, kwargs, {"params"}, f"Optimizer '{label}' ({cls.__name__})", extra)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def _build_adam(name: str, kwargs: Dict[str, Any], params: List[Any]) -> Optimizer:
    """adam/adamw: decoupled decay unless ``adam_w_mode`` is false for "adam"."""
    adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
    torch_adam = bool(kwargs.pop("torch_adam", False))
    cls = torch.optim.AdamW if (name == "adamw" or adam_w_mode) else torch.optim.Adam
    if not kwargs.pop("bias_correction", True):
        raise ValueError(f"Optimizer '{name}': bias_correction=False is not supported (Adam always corrects bias)")
    kwargs.pop("set_grad_none", None)
    if not torch_adam:
        if kwargs.get("amsgrad"):
            raise ValueError(f"Optimizer '{name}': amsgrad=True is not supported; set torch_adam: true to use it")
        for key, value in _DS_ADAM_DEFAULTS.items():
            kwargs.setdefault(key, value)
    return _instantiate(cls, name, params, kwargs, _ADAM_EXTRA_KEYS)


def _unknown_optimizer(name: str, torch_classes: Mapping[str, type]) -> ValueError:
    """The error for an optimizer name that is neither DeepSpeed's nor torch's."""
    ours = [n for n in DS_OPTIMIZER_NAMES if n not in _UNAVAILABLE_OPTIMIZERS]
    theirs = sorted(n for n in torch_classes if n.lower() not in _UNAVAILABLE_OPTIMIZERS)
    hint = _did_you_mean(name, ours + theirs)
    return ValueError(
        f"'{name}' is not a supported optimizer. Use one of {ours} (any case) or a torch.optim class "
        f"name (case-sensitive): {theirs}.{hint}")


def build_optimizer(spec: Mapping[str, Any], params: ParamsLike) -> Optimizer:
    """Build a torch optimizer from a DeepSpeed ``optimizer`` config block.

    ``adam``/``adamw`` (any case) give ``torch.optim.AdamW`` (decoupled weight decay) unless
    ``adam_w_mode`` is false for ``adam``, which gives ``torch.optim.Adam``; DeepSpeed's defaults
    (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0) apply unless ``torch_adam`` is true.
    ``adagrad`` gives ``torch.optim.Adagrad``; any other name is ``torch.optim.<type>``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> build_optimizer({"type": "SGD", "params": {"lr": 0.1}}, [w]).__class__.__name__
        'SGD'
    """
    name, kwargs = _split_spec(spec, "optimizer")
    max_grad_norm = kwargs.pop("max_grad_norm", None)
    if max_grad_norm is not None and max_grad_norm > 0:
        raise ValueError(f"Optimizer '{name}': 'max_grad_norm' is not an optimizer parameter; "
                         "use the top-level 'gradient_clipping' config key instead")
    lowered = name.lower()
    if lowered in DS_OPTIMIZER_NAMES or lowered in _UNAVAILABLE_OPTIMIZERS:
        name = lowered
    if name in _UNAVAILABLE_OPTIMIZERS:
        raise NotImplementedError(
            f"Optimizer '{name}' is not available in shardtrain; use type 'AdamW' or pass a client "
            "optimizer (initialize(optimizer=...)) instead")
    groups = _prepare_params(params)
    if name in ("adam", "adamw"):
        return _build_adam(name, kwargs, groups)
    if name == "adagrad":
        return _instantiate(torch.optim.Adagrad, name, groups, kwargs)
    torch_classes = _torch_optimizer_classes()
    if name not in torch_classes:
        raise _unknown_optimizer(name, torch_classes)
    return _instantiate(torch_classes[name], name, groups, kwargs)


# --------------------------------------------------------------------------- schedulers
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
            s = self._scale(t)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        factor = self._decay_factor(t, self.decay_mom_rate)
        return [hi * factor for hi in self.max_moms]

    def _apply(self, t: int) -> None:
        super()._apply(t)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self._mom_at(t)):
                group["betas"] = (beta1, _ONECYCLE_BETA2)

    def get_mom(self) -> Optional[List[Tuple[float, float]]]:
        """Current ``betas`` of every group, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]


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


# --------------------------------------------------------------------------- scheduler factory
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
