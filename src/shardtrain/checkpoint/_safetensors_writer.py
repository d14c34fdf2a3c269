"""Writes safetensors files straight from the tensors' memory.

The format is an 8-byte header length, a JSON header, then each tensor's bytes. The library's
``safetensors.torch.save`` first copies every tensor into one bytes object, a second copy of
everything the rank saves; writing the same bytes from views of the tensors makes none. The
files are read back by the safetensors library itself.

A rank file also records, in its header, the CRC32 of each tensor's bytes, so that a reader
that needs a few tensors (an export of the weights) checks those without reading the
optimizer states beside them. The header comes before the data, so the checksums are computed
first, in the one pass over the data that the file's own CRC32 (which meta.json records)
needs anyway: that one is combined from the header's and the tensors' CRC32s
(:func:`shardtrain._crc32.crc32_combine`) instead of streaming every byte a second time.
:func:`header_bytes` is shared with the export's shard writer, which streams its tensors
after the header instead of holding them.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._fileio import write_synced
from ._format import ST_NAMES, tensor_bytes

__all__ = ["write_safetensors", "header_bytes"]

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


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None,
                      checksums: Optional[str] = None) -> Dict[str, int]:
    """Writes ``tensors`` (fsync'ed) in the safetensors format; returns the file's
    ``{"bytes", "crc32"}``. With ``checksums``, the header's metadata also holds, under that
    key, the CRC32 of each tensor's bytes (JSON ``{name: crc32}``). Not atomic by itself:
    callers write to a temporary name."""
    names = sorted(tensors)
    views = [tensor_bytes(tensors[name]) for name in names]
    crcs: List[Optional[int]] = [None] * len(views)
    if checksums:
        crcs = [zlib.crc32(view) for view in views]  # the only pass over the data
        metadata = dict(metadata or {}, **{checksums: json.dumps(
            dict(zip(names, crcs)), separators=(",", ":"))})
    head = header_bytes([(n, tensors[n].dtype, tensors[n].shape) for n in names], metadata)
    return write_synced(path, head, *views, crc32s=[None, *crcs])

