"""Value types every config block shares, and how a value is shown back to the user.

JSON configs write sizes as 5e8, so an integer field takes an integral float; booleans are never
numbers and numbers are never booleans (pydantic's lax mode would allow both). A coercer raises
ValueError with a short expectation ("expected an integer"); the error formatter (``_errors``)
adds the dotted key, the value as the user wrote it (:func:`_show`) and the default.
"""

import json
import math
from typing import Any, Dict, Optional, Union

import torch
from pydantic import BeforeValidator, PlainSerializer
from typing_extensions import Annotated


def _int_value(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, not true/false")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError("expected an integer")


def _every_value(value: Any) -> Optional[int]:
    """``steps_per_print``: a positive count, or infinity (as Accelerate writes it) or null
    for never; infinity is stored as null."""
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return None
    return None if value is None else _int_value(value)


def _float_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return float(value)


def _bool_value(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def _str_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _dtype_value(value: Any) -> Optional[torch.dtype]:
    if value is None or value in _DTYPE_NAMES:
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        name = name[len("torch."):] if name.startswith("torch.") else name
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError("expected a dtype name such as 'fp32', 'fp16', 'bf16' (also 'float32', 'half', "
                     "'bfloat16', 'torch.bfloat16')")


def _dtype_name(value: Optional[torch.dtype]) -> Optional[str]:
    return None if value is None else _DTYPE_NAMES[value]


_Int = Annotated[int, BeforeValidator(_int_value)]
_Float = Annotated[float, BeforeValidator(_float_value)]
_Bool = Annotated[bool, BeforeValidator(_bool_value)]
_Str = Annotated[str, BeforeValidator(_str_value)]
_Dtype = Annotated[Optional[torch.dtype], BeforeValidator(_dtype_value), PlainSerializer(_dtype_name)]
_Block = Dict[str, Any]  # an object whose sub-keys shardtrain does not model (all such blocks are planned)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _dotted(path: str, key: Union[str, int]) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    """Render a value as the user would write it in JSON."""
    if isinstance(value, torch.dtype):
        return json.dumps(_DTYPE_NAMES.get(value, str(value)))
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
