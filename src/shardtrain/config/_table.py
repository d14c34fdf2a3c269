"""The key table: one row per accepted (or explicitly refused) key, read from the models.

The table is generated, never written by hand, so the documentation cannot drift from what the
loader accepts: ``docs/config.md`` holds :func:`_table_markdown`'s output and a test keeps the
two in step. Defaults and types come from the model fields; the status and the notes come from
the status tables, so that moving a feature out of "planned" updates its row too.
"""

import json
import typing
from typing import Any, Dict, List, Literal, Optional, Union

import torch
from pydantic import BaseModel
from typing_extensions import Annotated

from ._batch import _BATCH_KEYS
from ._model import _strip, _submodel
from ._root import ShardConfig
from ._status import NO_EFFECT, PLANNED, REMOVED_KEYS
from ._values import _DTYPE_NAMES, _dotted

__all__ = ["config_table"]

_STATUS_HONOURED = "honoured"
_STATUS_NO_EFFECT = "accepted (no effect: see notes)"
_STATUS_PLANNED = "planned (refused unless default)"
_STATUS_REMOVED = "removed (refused)"

#: Rows whose generated cells need a word more (a legacy form, a case-insensitive choice).
_SPECIAL_ROWS: Dict[str, Dict[str, str]] = {
    "zero_optimization": {"type": "object | bool", "notes": "ZeRO; the legacy `true`/`false` means stage 1/0"},
    "checkpoint.tag_validation": {"type": '"Warn" | "Ignore" | "Fail"'},
    "allgather_size": {"type": "int", "default": "500000000",
                       "notes": "read only with the legacy `\"zero_optimization\": true` form (stage 1)"},
    "bfloat16": {"type": "object", "notes": "older name of `bf16`, read only when `bf16` is absent"},
}


def config_table() -> List[Dict[str, str]]:
    """One row per accepted (or explicitly refused) config key, in config order.

    Each row has ``key`` (dotted), ``default`` (as JSON; DeepSpeed 0.19.8's), ``type``, ``status``
    (honoured / accepted with no effect / planned / removed) and ``notes``. ``docs/config.md`` is
    generated from it (``_table_markdown()``) and a test keeps the two in step.

    Example:
        >>> row = next(row for row in config_table() if row["key"] == "zero_optimization.stage")
        >>> row["default"], row["status"]
        ('0', 'honoured')
    """
    rows: List[Dict[str, str]] = []
    _table_rows(ShardConfig, "", rows)
    for key, hint in REMOVED_KEYS.items():
        rows.append({"key": key, "default": "", "type": "any", "status": _STATUS_REMOVED,
                     "notes": hint or "removed from DeepSpeed; no replacement"})
    return rows


def _table_markdown() -> str:
    lines = ["| key | default | type | status | notes |", "|---|---|---|---|---|"]
    for row in config_table():
        cells = [f"`{row['key']}`", f"`{row['default']}`" if row["default"] else "",
                 row["type"].replace("|", "\\|"), row["status"], row["notes"].replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _table_rows(model: Any, prefix: str, rows: List[Dict[str, str]]) -> None:
    """The rows of ``model``'s fields (each followed by its sub-block's), then its deprecated keys."""
    for name, field in model.model_fields.items():
        _field_rows(name, field, prefix, rows)
    for key, target in model.deprecated_keys.items():
        rows.append(_deprecated_row(model, prefix, key, target))


def _field_rows(name: str, field: Any, prefix: str, rows: List[Dict[str, str]]) -> None:
    key = field.alias or name
    dotted = _dotted(prefix, key)
    if dotted in _BATCH_KEYS:
        default = "null (derived)"
    elif field.is_required():
        default = "required"
    else:
        default = json.dumps(_jsonable_default(field))
    notes = PLANNED.get(dotted) or NO_EFFECT.get(dotted) or field.description or ""
    row = {"key": dotted, "default": default, "type": _type_name(field.annotation),
           "status": _status(dotted), "notes": notes}
    rows.append({**row, **_SPECIAL_ROWS.get(dotted, {})})
    if field.alias and field.alias != name:
        rows.append({"key": _dotted(prefix, name), "default": default, "type": _type_name(field.annotation),
                     "status": _status(dotted), "notes": f"same as `{dotted}`"})
    sub = _submodel(field.annotation)
    if sub is not None:
        _table_rows(sub, dotted, rows)


def _deprecated_row(model: Any, prefix: str, key: str, target: Optional[str]) -> Dict[str, str]:
    dotted = _dotted(prefix, key)
    replacement = f"`{_dotted(prefix, model.model_fields[target].alias or target)}`" if target else "nothing"
    row = {"key": dotted, "default": "", "type": "as replacement" if target else "bool",
           "status": _STATUS_HONOURED, "notes": f"deprecated: feeds {replacement}; logs a warning"}
    return {**row, **_SPECIAL_ROWS.get(dotted, {})}


def _status(dotted: str) -> str:
    if dotted in REMOVED_KEYS:
        return _STATUS_REMOVED
    if dotted in PLANNED:
        return _STATUS_PLANNED
    if dotted in NO_EFFECT:
        return _STATUS_NO_EFFECT
    return _STATUS_HONOURED


def _type_name(annotation: Any) -> str:
    """The type as the table shows it: JSON's names, ``| null`` when null is accepted."""
    nullable = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is Union and type(None) in typing.get_args(annotation):
            nullable = True
            annotation = _strip(annotation)
        else:
            break
    name = _base_type_name(annotation)
    return f"{name} | null" if nullable else name


def _base_type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if annotation is torch.dtype:
        return "dtype string"
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in typing.get_args(annotation))
    if origin is Union:
        return "\"auto\" | list[str]"
    if origin in (list, List):
        return f"list[{_type_name(typing.get_args(annotation)[0])}]"
    if origin in (dict, Dict) or _submodel(annotation) is not None:
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _jsonable_default(field: Any) -> Any:
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return {}
    if isinstance(default, torch.dtype):
        return _DTYPE_NAMES[default]
    return default
