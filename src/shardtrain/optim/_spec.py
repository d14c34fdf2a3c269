"""Reading a ``{"type": ..., "params": {...}}`` block, and checking its ``params`` against the
class that will receive them.

Both factories build a class chosen by name with keyword arguments from JSON, so both fail the
same way on a mistake: before anything is built, with the unknown or missing keyword names and
the accepted ones (or a "did you mean" for the type), instead of a bare ``TypeError`` from deep
inside the constructor.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Dict, Iterable, Mapping, Optional, Set, Tuple

import torch


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_values(target: Any, kwargs: Mapping[str, Any], label: str) -> None:
    """Raise ValueError for a value of the wrong kind where ``target``'s default tells the
    kind: a number (``lr``, ``eps``, ``weight_decay``...) or a tuple of numbers (``betas``),
    instead of the comparison or indexing error the constructor would raise."""
    for pname, param in inspect.signature(target).parameters.items():
        if pname not in kwargs:
            continue
        default, value = param.default, kwargs[pname]
        if _is_number(default) and not (_is_number(value) or isinstance(value, torch.Tensor)):
            raise ValueError(f"{label}: params.{pname} is {value!r}, not a number; give a "
                             f"number such as {default!r}.")
        if isinstance(default, tuple) and default and all(map(_is_number, default)) and not (
                isinstance(value, (list, tuple)) and len(value) == len(default)
                and all(map(_is_number, value))):
            raise ValueError(f"{label}: params.{pname} is {value!r}; it takes {len(default)} "
                             f"numbers, such as {list(default)}.")

