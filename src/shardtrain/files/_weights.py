"""A flat state dict as one weights file: safetensors for ``*.safetensors``, else
``torch.save``, written atomically (:func:`~._atomic.atomic_path`)."""
from __future__ import annotations

from typing import Dict

import torch

from ._atomic import atomic_path

__all__ = ["write_weights"]


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
