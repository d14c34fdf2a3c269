"""Loading: the forms a config arrives in, read into :class:`ShardConfig`.

JSON is only a loader into the typed models. A config is a dict, the path of a JSON file (read
as hjson when it is not plain JSON, as DeepSpeed does), or url-safe base64 JSON (as DeepSpeed's
launcher passes it). Repeated keys are an error in every form, because JSON would silently keep
the last one.
"""

import base64
import binascii
import copy
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from pydantic import ValidationError

from ._errors import _config_error
from ._model import ConfigError
from ._root import ShardConfig
from ._values import _show

__all__ = ["load_config", "read_config_file"]


def load_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]", ShardConfig], world_size: int,
                data_parallel_world_size: Optional[int] = None) -> ShardConfig:
    """Load, validate and resolve a training config.

    Args:
        config: one of
            - a dict (used as is; it is not modified),
            - a path (``str`` or ``Path``) to a JSON file; repeated keys are an error,
            - a url-safe base64 string of JSON (as DeepSpeed's launcher passes configs),
            - a :class:`ShardConfig`, which is re-resolved from its ``raw`` input.
        world_size: the number of ranks. The batch arithmetic counts the data-parallel ones: the
            world divided by ``tensor_parallel.autotp_size`` and ``sequence_parallel_size``.
        data_parallel_world_size: the data-parallel ranks when the caller built its own groups
            (a DeepSpeed ``mpu``); replaces that division.

    Returns:
        The validated :class:`ShardConfig`, with the batch triple resolved.

    Raises:
        ConfigError: for any mistake in the config; the message names the key and says what to do.
        TypeError: when ``config`` is none of the accepted forms.

    Example:
        >>> load_config({"train_batch_size": 32}, world_size=2).train_micro_batch_size_per_gpu
        16
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    raw = _read(config)
    try:
        return ShardConfig.model_validate(raw, context={"world_size": world_size,
                                                        "data_parallel_world_size": data_parallel_world_size})
    except ValidationError as error:
        raise _config_error(error) from None


def _read(config: Any) -> Dict[str, Any]:
    if isinstance(config, ShardConfig):
        return config.raw
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, os.PathLike):
        return read_config_file(config)
    if isinstance(config, str):
        if not config.strip():
            raise ConfigError("config is an empty string; give the path of a JSON file, or a dict.")
        if os.path.exists(config):
            return read_config_file(config)
        decoded = _decode_base64(config)
        if decoded is not None:
            return decoded
        raise ConfigError(f"Config file not found: {config!r} (looked for {os.path.abspath(config)!r}). A string "
                          "config must be the path of an existing JSON file or url-safe base64-encoded JSON.")
    raise TypeError(f"config must be a dict, a path (str or Path) to a JSON file, or a url-safe base64 string of JSON; "
                    f"got {type(config).__name__}.")


def read_config_file(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """The settings a config file holds, as a dict, without validating them.

    The file is read as :func:`load_config` reads it: JSON, or hjson when it is not plain JSON
    (as DeepSpeed does). Tools that need a few keys of a config whose batch arithmetic they
    cannot resolve (``shardtrain estimate``) read it here, so every command refuses the same
    files with the same words.

    Args:
        path: the config file.

    Returns:
        The JSON object the file holds.

    Raises:
        ConfigError: the file is missing, a directory, unreadable, empty, not JSON or hjson,
            repeats a key, or holds something other than a JSON object; the message names the
            path and says what a config looks like.

    Example:
        >>> read_config_file("ds_config.json")["zero_optimization"]
        {'stage': 2}
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(str(file) for file in path.glob("*.json"))[:3]
        raise ConfigError(f"Config path {str(path)!r} is a directory; give the config file in it"
                          + (f", e.g. {' or '.join(found)}." if found else "."))
    if not path.is_file():
        raise ConfigError(f"Config file not found: {str(path)!r} (looked for {str(path.absolute())!r}).")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Cannot read config file {str(path)!r}: {error}") from None
    if not text.strip():
        raise ConfigError(f"Config file {str(path)!r} is empty. {_MINIMAL}")
    try:
        data = _parse_json(text)
    except json.JSONDecodeError as error:
        data = _parse_hjson(text, path, error)
        if data == {}:  # hjson reads a file of comments alone as {}
            raise ConfigError(f"Config file {str(path)!r} holds no settings, only comments. "
                              f"{_MINIMAL}") from None
    except ConfigError as error:
        raise ConfigError(f"Config file {str(path)!r}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} holds {_json_kind(data)}, not a JSON object "
                          f"of settings. {_MINIMAL}")
    return data


# What an empty or wrong-shaped file's message shows: the smallest config initialize() accepts
# with no optimizer of the script's own.
_MINIMAL = ('A minimal config: {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", '
            '"params": {"lr": 0.001}}}; docs/config.md lists every key.')


def _json_kind(data: Any) -> str:
    """What a parsed file holds, in JSON's words (hjson reads bare text as a string)."""
    if isinstance(data, list):
        return f"a JSON array ({_show(data)})"
    if isinstance(data, str):
        return f"the text {_show(data)}"
    if data is None:
        return "null"
    return f"the {'boolean' if isinstance(data, bool) else 'number'} {_show(data)}"


def _decode_base64(text: str) -> Optional[Dict[str, Any]]:
    """The JSON object encoded in ``text``, or None when ``text`` is not base64 JSON at all."""
    try:
        payload = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        data = _parse_json(payload.decode("utf-8"))
    except ConfigError:
        raise  # valid base64 JSON with a mistake in it (duplicate keys)
    except (binascii.Error, ValueError):
        return None  # not base64, not UTF-8 or not JSON
    return data if isinstance(data, dict) else None


def _parse_hjson(text: str, path: Path, json_error: json.JSONDecodeError) -> Any:
    """DeepSpeed reads config files as hjson: comments, trailing commas, unquoted keys."""
    import hjson  # a dependency; imported only for files that are not plain JSON

    try:
        return _parse_json(text, loads=hjson.loads)
    except ConfigError as error:
        raise ConfigError(f"Config file {str(path)!r}: {error}") from None
    except hjson.HjsonDecodeError as error:
        raise ConfigError(f"Config file {str(path)!r} is neither JSON nor hjson: as JSON, "
                          f"{json_error.msg} at line {json_error.lineno}, column {json_error.colno}; "
                          f"as hjson, {error.msg} at line {error.lineno}, column {error.colno}.") from None


def _parse_json(text: str, loads: Callable[..., Any] = json.loads) -> Any:
    duplicates: List[str] = []

    def pairs_to_dict(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        result: Dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                duplicates.append(key)
            result[key] = value
        return result

    data = loads(text, object_pairs_hook=pairs_to_dict)
    if duplicates:
        raise ConfigError(f"Duplicate keys in the config: {sorted(set(duplicates))}. JSON keeps only the last one; "
                          "remove the others.")
    return data
