"""Dotted top-level keys (``"zero_optimization.reduce_bucket_size": 1024``) read as the nested
keys they name.

TRL's ``prepare_deepspeed`` writes three ZeRO keys this way into the config of the reference,
reward and teacher models it wraps (Accelerate's fill-in names, put at the top level).
DeepSpeed ignores such keys silently; their writers mean the nested key, so shardtrain reads them
as that key. A dotted key that names no key stays an error, and one that disagrees with the same
key given nested is an error naming both (a nested ``"auto"`` is no value: the dotted key fills
it). A fractional value of an integer key is read as its integer part: TRL writes
``0.9 * hidden * hidden`` for ``stage3_prefetch_bucket_size`` where Transformers and Accelerate
write ``int(0.9 * hidden * hidden)``.
"""

import math
from typing import Any, Dict, List, Optional

from ._model import ConfigError, _strip, _submodel, _unknown_key_message
from ._values import _is_auto, _show

__all__ = ["dotted_keys", "unfold_dotted"]


def dotted_keys(data: Dict[str, Any]) -> List[str]:
    """The dotted top-level keys of a config as given, in order."""
    return [key for key in data if isinstance(key, str) and "." in key]


def unfold_dotted(root: type, data: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` with each dotted top-level key moved into the nested block it names.

    Raises:
        ConfigError: a dotted key names no key, passes through a value that is not a block,
            or disagrees with the same key given nested.
    """
    dotted = dotted_keys(data)
    if not dotted:
        return data
    out = {key: value for key, value in data.items() if key not in dotted}
    for key in dotted:
        _place(root, out, key, data[key])
    return out


def _place(root: type, out: Dict[str, Any], key: str, value: Any) -> None:
    model, block, path = root, out, ""
    *blocks, last = key.split(".")
    for part in blocks:
        field, path = _field(model, part, path, key), f"{path}.{part}" if path else part
        sub = _submodel(model.model_fields[field].annotation)
        if sub is None:
            raise ConfigError(f"The top-level key {key!r} names a key inside {path}, which is not a block of "
                              f"named keys; write {path} out as the config's nested form instead.")
        name = _given_name(model, block, field) or part
        inner = block.get(name)
        if inner is None or _is_auto(inner):
            inner = {}
        elif not isinstance(inner, dict):
            raise ConfigError(f"The top-level key {key!r} names a key inside {path}, but {path} is "
                              f"{_show(inner)}; write {path} as an object to hold it.")
        block[name] = inner = dict(inner)
        model, block = sub, inner
    field = _field(model, last, path, key)
    value = _as_field_value(model, field, value)
    name = _given_name(model, block, field)
    if name is not None and not _is_auto(block[name]):
        if not _same(block[name], value):
            nested = f"{path}.{name}"
            raise ConfigError(f"The top-level key {key!r} is {_show(value)} but {nested} is {_show(block[name])}: "
                              f"both set the same key; keep one of them. (TRL's prepare_deepspeed adds this key for "
                              f"the reference, reward and teacher models at ZeRO-3: set {nested} to \"auto\" or "
                              f"remove it to let the dotted value apply.)")
        return
    if name is not None:
        del block[name]  # "auto": the dotted key gives the value
    block[last] = value


def _field(model: type, part: str, path: str, key: str) -> str:
    """The field ``part`` sets in ``model``; an error naming the dotted key when none."""
    accepted = model._input_keys()
    if part not in accepted:
        where = f"{path}.{part}" if path else part
        raise ConfigError(f"{_unknown_key_message(where, part, list(accepted))} (It comes from the top-level key "
                          f"{key!r}, read as the nested key it names.)")
    return accepted[part]


def _given_name(model: type, block: Dict[str, Any], field: str) -> Optional[str]:
    """The name under which ``block`` already gives ``field`` (its own name or an alias)."""
    accepted = model._input_keys()
    return next((name for name in block if accepted.get(name) == field), None)


def _as_field_value(model: type, field: str, value: Any) -> Any:
    annotation = model.model_fields[field].annotation
    if (_strip(annotation) is int and isinstance(value, float) and math.isfinite(value)
            and not value.is_integer()):
        return math.floor(value)
    return value


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)

