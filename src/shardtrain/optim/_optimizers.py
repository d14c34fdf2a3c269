"""The optimizer factory: a DeepSpeed ``optimizer`` block to a ``torch.optim`` optimizer.

DeepSpeed's own names (``adam``, ``adamw``, ``adagrad``; any case) map onto torch classes with
DeepSpeed's defaults, so a config trains with the hyperparameters it was tuned with; any other
name is a ``torch.optim`` class, matched exactly. ``muon`` builds :class:`MuonWithAuxAdam`
(Muon for 2-D weights, AdamW for the rest; see :mod:`._muon`). The optimizers DeepSpeed ships
as kernels (``lamb``, ``lion``, ...) are refused by name, with the alternatives, rather than
replaced by something that steps differently.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch.optim import Optimizer

from ._muon import MUON_KEYS, MuonWithAuxAdam, split_param_groups
from ._spec import _check_kwargs, _check_values, _did_you_mean, _split_spec

__all__ = ["DS_OPTIMIZER_NAMES", "build_optimizer"]

#: Optimizer names matched case-insensitively (as DeepSpeed does).
DS_OPTIMIZER_NAMES: Tuple[str, ...] = ("adam", "adamw", "lamb", "lion", "adagrad", "muon")
#: Names DeepSpeed lower-cases but that shardtrain does not provide.
_UNAVAILABLE_OPTIMIZERS: Tuple[str, ...] = ("lamb", "lion", "muadam", "muadamw", "musgd")

_DS_ADAM_DEFAULTS: Dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ADAM_EXTRA_KEYS: Tuple[str, ...] = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none")

ParamsLike = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]


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
    _check_values(cls, kwargs, f"Optimizer '{label}' ({cls.__name__})")
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


def _build_muon(kwargs: Dict[str, Any], params: List[Any],
                param_names: Optional[Mapping[int, str]]) -> Optimizer:
    """muon: DeepSpeed's split of the parameters into Muon and AdamW halves, checked keys."""
    unknown = sorted(set(kwargs) - set(MUON_KEYS))
    if unknown:
        raise ValueError(f"Optimizer 'muon': unknown parameter(s) {unknown}; it takes "
                         f"{list(MUON_KEYS)}.{_did_you_mean(unknown[0], MUON_KEYS)}")
    if kwargs.pop("per_head_muon", False):
        raise NotImplementedError("Optimizer 'muon': per_head_muon=true (orthogonalising each "
                                  "attention head separately) is not supported; remove it to "
                                  "orthogonalise each whole weight")
    _check_muon_values(kwargs)
    adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    groups = split_param_groups(params, param_names or {}, kwargs)
    return MuonWithAuxAdam(groups, adam_w_mode=adam_w_mode)


def _check_muon_values(kwargs: Mapping[str, Any]) -> None:
    """Each value of a Muon block in its range, or a ValueError naming it."""
    for key in ("lr", "muon_lr", "adam_lr", "weight_decay", "eps"):
        if key in kwargs and not (_is_real(kwargs[key]) and kwargs[key] >= 0):
            raise ValueError(f"Optimizer 'muon': {key}={kwargs[key]!r} must be a number >= 0")
    if "momentum" in kwargs and not (_is_real(kwargs["momentum"]) and 0 <= kwargs["momentum"] < 1):
        raise ValueError(f"Optimizer 'muon': momentum={kwargs['momentum']!r} must be a number "
                         "in [0, 1), e.g. 0.95")
    betas = kwargs.get("betas", (0.9, 0.95))
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2
            and all(_is_real(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"Optimizer 'muon': betas={betas!r} must be two numbers in [0, 1), "
                         "e.g. [0.9, 0.95]")
    if kwargs.get("ns_method", "gram") not in ("gram", "standard"):
        raise ValueError(f"Optimizer 'muon': ns_method={kwargs['ns_method']!r} must be 'gram' "
                         "or 'standard'")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def build_optimizer(spec: Mapping[str, Any], params: ParamsLike,
                    param_names: Optional[Mapping[int, str]] = None) -> Optimizer:
    """Build a torch optimizer from a DeepSpeed ``optimizer`` config block.

    ``adam``/``adamw`` (any case) give ``torch.optim.AdamW`` (decoupled weight decay) unless
    ``adam_w_mode`` is false for ``adam``, which gives ``torch.optim.Adam``; DeepSpeed's defaults
    (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0) apply unless ``torch_adam`` is true.
    ``adagrad`` gives ``torch.optim.Adagrad``; ``muon`` gives :class:`MuonWithAuxAdam`, which
    splits the parameters by shape and by ``param_names`` (``id(param)`` to its name in the
    model: ``embed``/``lm_head`` go to AdamW); any other name is ``torch.optim.<type>``.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> build_optimizer({"type": "SGD", "params": {"lr": 0.1}}, [w]).__class__.__name__
        'SGD'
    """
    name, kwargs = _split_spec(spec, "optimizer")
    name = _checked_name(name, kwargs)
    # no parameter at all (a pipeline stage holding only a tied weight's copy): one empty
    # group, so the optimizer exists, steps nothing and saves an empty state
    groups = _prepare_params(params) or [{"params": []}]
    if name in ("adam", "adamw"):
        return _build_adam(name, kwargs, groups)
    if name == "muon":
        return _build_muon(kwargs, groups, param_names)
    if name == "adagrad":
        return _instantiate(torch.optim.Adagrad, name, groups, kwargs)
    torch_classes = _torch_optimizer_classes()
    if name not in torch_classes:
        raise _unknown_optimizer(name, torch_classes)
    return _instantiate(torch_classes[name], name, groups, kwargs)


def _checked_name(name: str, kwargs: Dict[str, Any]) -> str:
    """The name to build by (DeepSpeed's names lower-cased), once the block asks for nothing refused."""
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
    return name
