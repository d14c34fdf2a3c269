"""Consolidation: the full model weights of a checkpoint, in one process, with no group.

Because every rank file holds even pieces of each flattened tensor and meta.json says which,
the full weights of a checkpoint from any world size and stage are the concatenation of those
pieces: one CPU process reads them, without a process group or the model's code. Every file
is CRC-checked first (each is read in full anyway), and the output file is written under a
temporary name and renamed into place.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Optional

import torch

from ..files import atomic_path
from ._agreement import as_plain_errors, corrupted
from ._format import META
from ._reading import Reader, entry_for, module_key, read_meta, tag_dir_of
from ._safetensors_writer import write_safetensors

__all__ = ["consolidate", "full_weights", "DTYPES", "check_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_dtype(dtype: Optional[str]) -> None:
    """``dtype`` is None or one of :data:`DTYPES`' names."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of None, "
                         f"{', '.join(repr(k) for k in DTYPES)}.")


def consolidate(checkpoint_dir: str, out_path: str, tag: Optional[str] = None,
                dtype: Optional[str] = None) -> str:
    """Writes the full model weights of a checkpoint to one safetensors file.

    Runs in one CPU process with no process group, whatever world size saved the
    checkpoint. The file loads with ``model.load_state_dict(safetensors.torch.load_file(out))``
    (tied weights are written under each of their names).

    Args:
        checkpoint_dir: the ``save_dir`` given to ``save_checkpoint`` (or one tag directory).
        out_path: the safetensors file to write (replaced atomically).
        tag: the checkpoint to read; default the one named by ``latest``.
        dtype: None keeps each parameter's saved dtype; "fp32" (from the fp32 masters when the
            model trained in 16 bits), "bf16" or "fp16" casts the floating-point parameters.
            Buffers keep their dtype.

    Returns:
        ``out_path``.

    Raises:
        FileNotFoundError: no such directory or tag, or ``latest`` is missing.
        ValueError: a file is truncated or corrupted, or ``dtype`` is unknown.

    Example:
        >>> consolidate("checkpoints", "model.safetensors", dtype="bf16")
        >>> model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    """
    weights = full_weights(checkpoint_dir, tag, dtype)
    out_path = os.fspath(out_path)
    with atomic_path(out_path) as tmp:
        write_safetensors(tmp, weights, metadata={"format": "pt"})
    return out_path


def full_weights(checkpoint_dir: str, tag: Optional[str] = None, dtype: Optional[str] = None,
                 exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
    """The full model weights of a checkpoint, as a state dict of CPU tensors.

    What :func:`consolidate` writes, without writing it: one CPU process, no process group,
    any world size and stage. Arguments and errors as :func:`consolidate`'s;
    ``exclude_frozen_parameters`` leaves out the parameters that were not trained.

    Example:
        >>> model.load_state_dict(full_weights("checkpoints", dtype="fp32"))
    """
    check_dtype(dtype)
    tag_dir = tag_dir_of(os.fspath(checkpoint_dir), tag)
    meta = as_plain_errors(read_meta, tag_dir)
    weights = as_plain_errors(_read_weights, tag_dir, meta, dtype)
    if exclude_frozen_parameters:
        frozen = {n for n, e in meta["params"].items() if not e.get("trainable")}
        weights = {k: v for k, v in weights.items()
                   if k not in frozen and meta.get("aliases", {}).get(k) not in frozen}
    return weights


def _read_weights(tag_dir: str, meta: Dict[str, Any],
                  dtype: Optional[str]) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer, whole, then every alias of a tied weight."""
    with contextlib.ExitStack() as stack:
        reader = Reader(tag_dir, meta, stack)
        for name in sorted(meta["files"]):
            if name.endswith(".safetensors"):
                reader.verify(name)  # every file is read in full anyway
        try:
            out = _read_tensors(reader, meta, DTYPES.get(dtype) if dtype else None)
        except (KeyError, TypeError, IndexError) as error:
            raise corrupted(reader.path(META), f"unexpected layout: {error!r}") from None
    for alias, target in meta.get("aliases", {}).items():
        if target in out:
            out[alias] = out[target].clone()  # safetensors stores no shared tensors
    return out


def _read_tensors(reader: Reader, meta: Dict[str, Any],
                  want: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for name, entry in meta["params"].items():
        key = module_key(entry, name, want) if want is not None else f"param/{name}"
        full = reader.read(key, entry_for(entry, key), 0, int(entry["numel"]))
        if want is not None and full.is_floating_point():
            full = full.to(want)
        out[name] = full.reshape(entry["shape"])
    for name, entry in meta["buffers"].items():
        out[name] = reader.read(f"buffer/{name}", entry, 0,
                                int(entry["numel"])).reshape(entry["shape"])
    return out
