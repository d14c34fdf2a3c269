"""The safetensors format at the byte level, for the writers that stream it.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes. The library's own writer
needs every tensor at once; a writer that knows the names, dtypes and shapes beforehand can
write the header first and the tensors as they arrive (a rank's checkpoint file, an export
shard, the full weights gathered module by module), with these two pieces.
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

__all__ = ["ST_DTYPES", "ST_NAMES", "Layout", "header_bytes", "tensor_bytes"]

# safetensors' dtype codes
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
             "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}

Layout = Sequence[Tuple[str, torch.dtype, Sequence[int]]]  # (name, dtype, shape), file order


def header_bytes(layout: Layout, metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file whose tensors follow in
    ``layout``'s order, back to back."""
    header: Dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in layout:
        size = math.prod(int(d) for d in shape) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(head)) + head


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes safetensors stores for ``t``: little-endian (every platform torch supports
    is), C order; a view of the tensor's memory when it is a contiguous CPU tensor."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
