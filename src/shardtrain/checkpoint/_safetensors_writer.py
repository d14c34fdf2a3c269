"""Writes safetensors files straight from the tensors' memory.

The format is an 8-byte header length, a JSON header, then each tensor's bytes. The library's
``safetensors.torch.save`` first copies every tensor into one bytes object, a second copy of
everything the rank saves; writing the same bytes from views of the tensors makes none. The
files are read back by the safetensors library itself.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Dict, Optional

import torch

from .._fileio import write_synced
from ._format import ST_NAMES

__all__ = ["write_safetensors"]


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Writes ``tensors`` (fsync'ed) in the safetensors format; returns the file's
    ``{"bytes", "crc32"}``. Not atomic by itself: callers write to a temporary name."""
    names = sorted(tensors)
    header: Dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    views = [_raw_bytes(tensors[name]) for name in names]
    return write_synced(path, struct.pack("<Q", len(head)), head, *views)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # Little-endian bytes, as the format wants (every platform torch supports is).
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
