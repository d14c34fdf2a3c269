"""The strict base every config block derives from, and the error it raises.

Strictness lives in one class so that every block, at any depth, refuses the same mistakes the
same way before pydantic sees the data: a key DeepSpeed removed, an unknown key (with a "did you
mean" suggestion, or where the key exists elsewhere in the config), an ``"auto"`` placeholder
where shardtrain needs a value, and two names for one setting. A block maps its deprecated keys
onto their replacements in its ``_translate`` hook. Every message names the dotted key, which is
why each block declares its ``config_path``.
"""

import difflib
import logging
import typing
from typing import Any, ClassVar, Dict, FrozenSet, List, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator
from typing_extensions import Annotated

from ._status import REMOVED_KEYS
from ._values import _dotted, _is_auto, _show

# One logger for the whole package, named as users filter it: "shardtrain.config".
logger = logging.getLogger(__package__)

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A mistake in the user's config. The message names the key, shows the value and says what to do."""


class _ConfigModel(BaseModel):
    """Shared strictness: removed keys, unknown keys, "auto" values, deprecated aliases."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    #: Dotted path of this section in the config ("" for the root); used in error messages.
    config_path: ClassVar[str] = ""
    #: DeepSpeed drops "auto" values in its pydantic sections (the default applies). Its other
    #: sections keep "auto" as a value, which then fails; shardtrain says so up front.
    drops_auto: ClassVar[bool] = True
    #: Fields for which "auto" is a legitimate value.
    auto_allowed: ClassVar[FrozenSet[str]] = frozenset()
    #: Deprecated input key -> the field it feeds (None: it feeds nothing and only warns).
    deprecated_keys: ClassVar[Dict[str, Optional[str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports the type error with the key path
        data = cls._unfold(dict(data))
        cls._reject_removed(data)
        cls._reject_unknown(data)
        data = cls._handle_auto(data)
        cls._reject_double_names(data)
        return cls._translate(data)

    @classmethod
    def _unfold(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """Hook for the root, which reads dotted top-level keys as the nested keys they name."""
        return data

    @classmethod
    def _reject_removed(cls, data: Dict[str, Any]) -> None:
        for key in data:
            dotted = _dotted(cls.config_path, key) if isinstance(key, str) else ""
            if dotted in REMOVED_KEYS:
                hint = REMOVED_KEYS[dotted]
                raise ConfigError(
                    f"{dotted} was removed from DeepSpeed and is not supported by shardtrain"
                    f"{'; ' + hint if hint else ''}. Remove the key: its presence alone is an error, "
                    f"whatever its value (got {_show(data[key])}).")

    @classmethod
    def _input_keys(cls) -> Dict[str, str]:
        """Every accepted input key -> the field name it sets."""
        keys: Dict[str, str] = {}
        for name, field in cls.model_fields.items():
            keys[name] = name
            if field.alias:
                keys[field.alias] = name
        for key, target in cls.deprecated_keys.items():
            keys[key] = target or key
        return keys

    @classmethod
    def _reject_unknown(cls, data: Dict[str, Any]) -> None:
        accepted = cls._input_keys()
        problems = []
        for key in data:
            if not isinstance(key, str):
                problems.append(f"{cls.config_path or 'the config'} has a non-string key {key!r}; "
                                "config keys are strings.")
            elif key not in accepted:
                problems.append(_unknown_key_message(_dotted(cls.config_path, key), key, list(accepted)))
        if problems:
            raise ConfigError("\n".join(problems))

    @classmethod
    def _handle_auto(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        autos = [key for key, value in data.items() if _is_auto(value) and key not in cls.auto_allowed]
        if cls.drops_auto:
            for key in autos:
                logger.debug("%s is \"auto\": using its default", _dotted(cls.config_path, key))
                del data[key]
            return data
        if autos:
            raise ConfigError("\n".join(_auto_message(cls, key) for key in autos))
        return data

    @classmethod
    def _reject_double_names(cls, data: Dict[str, Any]) -> None:
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in data and field.alias in data:
                raise ConfigError(
                    f"{_dotted(cls.config_path, field.alias)} and {_dotted(cls.config_path, name)} are two "
                    f"names for the same setting; give only one (got {_show(data[field.alias])} and "
                    f"{_show(data[name])}).")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """Hook for sections that map deprecated keys onto their replacements."""
        return data


def _unknown_key_message(dotted: str, key: str, candidates: List[str]) -> str:
    # The key table walks ShardConfig, which is built on this module: imported when first needed.
    from ._table import config_table

    message = f"Unknown config key {dotted!r}"
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]!r}?"
    else:
        elsewhere = [row["key"] for row in config_table() if row["key"].rsplit(".", 1)[-1] == key][:3]
        message += f"; {key!r} exists as {', '.join(map(repr, elsewhere))}." if elsewhere else "."
    return message + (" shardtrain rejects keys it does not know instead of ignoring them: "
                      "fix the spelling or remove the key (see docs/config.md).")


def _auto_message(model: type, key: str) -> str:
    field = model.model_fields.get(key)
    kind = _kind_of(field.annotation) if field is not None else "an explicit value"
    return (f"{_dotted(model.config_path, key)} is \"auto\", but shardtrain needs {kind} here. \"auto\" is a "
            "placeholder that Hugging Face's DeepSpeed integration fills in before the engine sees the config; "
            "write the value yourself, or remove the key to use the default.")


def _kind_of(annotation: Any) -> str:
    base = _strip(annotation)
    if base in (int, float):
        return "a number"
    if base is bool:
        return "true or false"
    if base is str:
        return "a string"
    return "an explicit value"


def _strip(annotation: Any) -> Any:
    """The base type of an annotation, without Annotated/Optional wrappers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is Union and type(None) in typing.get_args(annotation):
            rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            annotation = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return annotation


def _submodel(annotation: Any) -> Optional[type]:
    base = _strip(annotation)
    return base if isinstance(base, type) and issubclass(base, _ConfigModel) else None
