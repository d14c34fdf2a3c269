"""Counting the bytes of model states a rank holds.

Tensors that share storage (a gradient that is a view into a flat bucket, a parameter
tied to another) are counted once, in the first category that names them.
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch

from ._fileio import atomic_path

__all__ = ["count_bytes", "zero_formula_bytes", "write_weights"]


def count_bytes(groups: Dict[str, Iterable[torch.Tensor]]) -> Dict[str, int]:
    """Bytes per category of distinct storages, plus ``total``.

    Example:
        >>> count_bytes({"params": [w], "grads": [w.grad]})["total"]
    """
    seen = set()
    out: Dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[name] = total
    out["total"] = sum(out.values())
    return out


def zero_formula_bytes(num_params: int, world_size: int, stage: int, param_bytes: int = 4,
                       grad_bytes: int = 4, optimizer_bytes: int = 8) -> int:
    """Model-state bytes per rank that the ZeRO paper's formula predicts.

    ``optimizer_bytes`` is K: fp32 Adam alone is 8 (two moments); with 16-bit parameters
    the fp32 master copy adds 4, so K = 12.
    """
    p, g, k, n = param_bytes * num_params, grad_bytes * num_params, optimizer_bytes * num_params, world_size
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def write_weights(state: Dict[str, torch.Tensor], path: str) -> None:
    """Writes a flat state dict atomically: safetensors for ``*.safetensors``, else
    ``torch.save``. A temporary file is renamed into place, so a crash leaves no half file."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    with atomic_path(path) as tmp:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file
            save_file(_untie(tensors), tmp)
        else:
            torch.save(tensors, tmp)


def _untie(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights): give each its own."""
    seen = set()
    out = {}
    for k, v in tensors.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        out[k] = v.clone() if key in seen else v
        seen.add(key)
    return out
