"""pydantic's validation errors rewritten as one :class:`ConfigError` in shardtrain's voice.

A user never sees pydantic's text or its URLs: each problem becomes one line that names the
dotted key, shows the value as JSON, says what was expected and, where there is one, which
default removing the key gives. A ConfigError raised inside a validator passes through as is.
"""

from typing import Any, Dict, List, Optional, Tuple

from pydantic import ValidationError

from ._model import ConfigError, _submodel
from ._root import ShardConfig
from ._table import _jsonable_default
from ._values import _dotted, _show


def _config_error(error: ValidationError) -> ConfigError:
    messages: List[str] = []
    for item in error.errors():
        cause = (item.get("ctx") or {}).get("error")
        message = str(cause) if isinstance(cause, ConfigError) else _describe(item)
        if message not in messages:
            messages.append(message)
    if len(messages) == 1:
        return ConfigError(messages[0])
    return ConfigError(f"{len(messages)} problems in the config:\n" + "\n".join(f"- {m}" for m in messages))


def _describe(item: Dict[str, Any]) -> str:
    path = ""
    for part in item["loc"]:
        path = _dotted(path, part)
    kind, text = item["type"], item["msg"]
    if kind == "missing":
        return f"{path} is required; add it to the config."
    if kind == "extra_forbidden":
        return f"Unknown config key {path!r}; fix the spelling or remove it (see docs/config.md)."
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path} must be a JSON object ({{...}}); got {_show(item['input'])}."
    if text.startswith("Value error, "):
        text = text[len("Value error, "):]
    elif kind == "literal_error":
        text = "expected " + text[len("Input should be "):]
    else:
        text = text[0].lower() + text[1:]
    default = _default_for_loc(item["loc"])
    hint = f" Fix the value, or remove the key to use the default ({default})." if default else " Fix the value."
    return f"{path}: {text}; got {_show(item['input'])}.{hint}"


def _default_for_loc(loc: Tuple[Any, ...]) -> Optional[str]:
    model: Any = ShardConfig
    field = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model._input_keys():
            return None
        field = model.model_fields[model._input_keys()[part]]
        model = _submodel(field.annotation)
    if field is None or field.is_required():
        return None
    return _show(_jsonable_default(field))
