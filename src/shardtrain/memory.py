"""Counting the bytes of model states a rank holds, and the peak memory of a block.

Tensors that share storage (a gradient that is a view into a flat bucket, a parameter
tied to another) are counted once, in the first category that names them.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, Optional

import torch

from . import accelerator
from ._fileio import atomic_path

__all__ = ["count_bytes", "zero_formula_bytes", "write_weights", "peak_memory"]


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


@contextlib.contextmanager
def peak_memory() -> Iterator[Dict[str, Optional[int]]]:
    """Measures how far the block raised this process's memory above its level at the start:
    ``host``, the peak resident memory (Linux: the kernel's high-water mark, reset at the
    start; None where it cannot be read), and ``device``, CUDA's peak of allocated bytes (0
    without CUDA). The dict is filled when the block ends.

    Example:
        >>> with peak_memory() as peak:
        ...     engine.save_16bit_model("out", "model.safetensors")
        >>> peak["host"], peak["device"]
    """
    result: Dict[str, Optional[int]] = {}
    host_start = _reset_resident_peak()
    device_start = accelerator.memory_stats().get("allocated", 0)
    accelerator.reset_peak_memory()
    yield result
    peak = _resident("VmHWM")
    result["host"] = None if host_start is None or peak is None else max(peak - host_start, 0)
    result["device"] = max(accelerator.memory_stats().get("peak", device_start) - device_start, 0)


def _resident(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_resident_peak() -> Optional[int]:
    """Resets the high-water mark to the current resident memory; returns that."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _resident("VmRSS")


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
