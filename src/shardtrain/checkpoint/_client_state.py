"""``client_state``: the user's own values, saved beside the training state.

A value goes where it comes back exactly as it was: top-level tensors to the rank's
safetensors file, values that JSON holds as they are to the rank's JSON file, and the rest (a
trainer's whole state: nested tensors, sets, ``OrderedDict``s, ...) to ``torch.save``. That
last part is pickled before anything is written, so a value that cannot be pickled fails the
save on every rank before the disk is touched, and it is read back through torch's restricted
unpickler (``torch.load(weights_only=True)``), which builds containers, numbers, strings,
tensors and the types registered with ``torch.serialization.add_safe_globals``, and refuses
any other type by name instead of running its code.
"""
from __future__ import annotations

import io
import pickle
import re
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ._agreement import Problem, corrupted
from ._format import encode_dict

__all__ = ["RESERVED_KEYS", "split_client_state", "pickle_objects", "unpickle_objects"]

RESERVED_KEYS = ("checkpoint_parallel_dimensions",)  # as DeepSpeed

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def split_client_state(client_state: Dict[str, Any]
                       ) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[Any, Any]]:
    """(JSON part, top-level tensors, everything else): a key whose value JSON cannot hold
    (a trainer's whole state) goes to the pickled part, whole."""
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}.")
    for key in RESERVED_KEYS:
        if key in client_state:
            raise KeyError(f"client_state key {key!r} is reserved by the checkpoint format; "
                           "rename it.")
    tensors = {k: v for k, v in client_state.items()
               if isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() > 0}
    as_json: Dict[str, Any] = {}
    objects: Dict[Any, Any] = {}
    for key, value in client_state.items():
        if key in tensors:
            continue
        if isinstance(key, str) and _is_plain(value):
            as_json.update(encode_dict({key: value}, "client_state"))
        else:
            objects[key] = value
    return as_json, tensors, objects


def _is_plain(value: Any) -> bool:
    """Whether JSON gives ``value`` back as it is: exact containers (an ``OrderedDict``, a
    ``torch.Size`` or a named tuple would come back as a plain dict or tuple), string keys,
    numbers, strings, 0-d tensors."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, np.generic):
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and k not in ("__tuple__", "__tensor__") and _is_plain(v)
                   for k, v in value.items())
    return False


def pickle_objects(objects: Dict[Any, Any]) -> Optional[bytes]:
    """``torch.save`` of the client values JSON cannot hold, made before any write, so a
    value that cannot be pickled fails the save before the disk is touched."""
    if not objects:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(objects, buffer)
    except Exception as error:  # pickle raises many kinds (TypeError, AttributeError, ...)
        raise TypeError(f"client_state cannot be saved: {type(error).__name__}: {error}. "
                        f"Keys {sorted(map(str, objects))} hold values JSON cannot store, so "
                        f"they are pickled, and this one cannot be.") from None
    return buffer.getvalue()


def unpickle_objects(path: str, data: bytes) -> Dict[Any, Any]:
    """The pickled part of a client_state, through torch's restricted unpickler."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = _GLOBAL.search(str(error))
        name = found.group(1) if found else "an object of a type it does not know"
        raise Problem(ValueError, (
            f"{path}: client_state holds {name}, which the checkpoint loader refuses: "
            f"unpickling an arbitrary type can run code. If you trust this checkpoint, allow "
            f"the type before loading: torch.serialization.add_safe_globals([{name}]).")) from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise corrupted(path, f"its client_state cannot be read: {error}") from None
