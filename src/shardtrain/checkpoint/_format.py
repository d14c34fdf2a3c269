"""The names and values of the checkpoint format, shared by the writers and the readers.

File and directory names, the version, the dtype names of meta.json and of safetensors
headers, and how values that are not tensors become JSON. JSON keeps a checkpoint free of
pickle: reading one can never run code. Dtype names from a file resolve to ``torch.dtype``
objects and to nothing else, and the JSON encoding tags what plain JSON would lose (tuples,
0-d tensors) so that it comes back as it was.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import torch

from ..files import ST_DTYPES, ST_NAMES, tensor_bytes
from ._agreement import Problem

__all__ = ["FORMAT_VERSION", "FORMAT", "META", "LATEST", "TMP", "REPLACED", "Piece",
           "ST_DTYPES", "ST_NAMES", "rank_file", "dtype_name", "dtype_from", "tensor_bytes",
           "encode", "encode_dict", "decode"]

FORMAT_VERSION = 2  # 2: rank files record the digests of meta.json's fields and their ranges
FORMAT = "shardtrain-checkpoint"
META = "meta.json"
LATEST = "latest"
TMP = ".tmp-"            # <tag>.tmp-<id>: a save in progress (never named by ``latest``)
REPLACED = ".replaced-"  # <tag>.replaced-<id>: the old <tag> while a re-save swaps it

Piece = Tuple[int, int, int]  # (rank, lo, hi): rank file ``rank`` holds elements [lo, hi)



def rank_file(rank: int, ext: str) -> str:
    return f"rank{rank:05d}.{ext}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):  # never resolve anything but a dtype from a file
        raise Problem(ValueError, f"{where} names an unknown dtype {name!r}: the checkpoint is "
                                  "corrupted or from a newer shardtrain.")
    return dtype


def encode(value: Any, what: str) -> Any:
    """Plain JSON for ``value``; tuples and 0-d tensors are tagged so they come back as such."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return {"__tensor__": value.item(), "dtype": dtype_name(value.dtype)}
        raise TypeError(f"{what} is a tensor of shape {list(value.shape)} inside a structure: "
                        "only top-level client_state tensors are stored (in safetensors); "
                        "move it to its own key.")
    if isinstance(value, (list, tuple)):
        items = [encode(v, f"{what}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return encode_dict(value, what)
    raise TypeError(f"{what} is of type {type(value).__name__}: checkpoints store JSON values and "
                    "tensors only (never pickle); convert it to numbers, strings, lists or "
                    "dicts, or leave it out.")


def encode_dict(value: Dict[Any, Any], what: str) -> Dict[str, Any]:
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or key in ("__tuple__", "__tensor__"):
            raise TypeError(f"{what} has the key {key!r}: checkpoint JSON needs string keys "
                            "(other than __tuple__/__tensor__).")
        out[key] = encode(item, f"{what}[{key!r}]")
    return out


def decode(value: Any) -> Any:
    """The value :func:`encode` made JSON of."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=dtype_from(value["dtype"], "a value"))
    return {k: decode(v) for k, v in value.items()}
