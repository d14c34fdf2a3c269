"""Writes safetensors files straight from the tensors' memory.

The format is an 8-byte header length, a JSON header, then each tensor's bytes. The library's
``safetensors.torch.save`` first copies every tensor into one bytes object, a second copy of
everything the rank saves; writing the same bytes from views of the tensors makes none. The
files are read back by the safetensors library itself.

A rank file also records, in its header, a checksum of each tensor's bytes, so that a reader
that needs a few tensors (an export of the weights) checks those without reading the
optimizer states beside them. A save already streams every byte through ``zlib.crc32`` for
the file's CRC32, which meta.json records; the per-tensor checksums come from that same pass.
The running CRC32 of the data section is recorded at each tensor's start and end: ``[before,
after]``, with ``zlib.crc32(tensor_bytes, before) == after``, so a tensor checks alone, as
strongly as by its own CRC32 (the start value changes the result, not which errors show). The
header comes first in the file but these are known only once the data has gone by: they are
written as fixed-width hex, so the header goes in first with placeholders, the data after it
(each tensor's CRC32 computed right after its bytes are written, while they are still in the
CPU's caches, as before), and the checksums last, over their placeholders. The file's CRC32
is that of the header continued by the data's, one :func:`shardtrain.files.crc32_combine`.
The header itself is :func:`shardtrain.files.header_bytes`, which the export's shard
writer and the full-weights writer share.
"""
from __future__ import annotations

import json
import zlib
from typing import Dict, List, Optional

import torch

from ..files import Layout, crc32_combine, header_bytes, synced_file, tensor_bytes, write_synced

__all__ = ["write_safetensors"]

def write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None,
                      checksums: Optional[str] = None) -> Dict[str, int]:
    """Writes ``tensors`` (fsync'ed) in the safetensors format; returns the file's
    ``{"bytes", "crc32"}``. With ``checksums``, the header's metadata also holds, under that
    key, each tensor's ``[before, after]`` running CRC32 of the data section, 8 hex digits
    each (JSON). Not atomic by itself: callers write to a temporary name."""
    names = sorted(tensors)
    layout = [(name, tensors[name].dtype, tensors[name].shape) for name in names]
    views = [tensor_bytes(tensors[name]) for name in names]
    if not checksums:
        return write_synced(path, header_bytes(layout, metadata), *views)
    return _write_checksummed(path, layout, views, dict(metadata or {}), checksums)


def _write_checksummed(path: str, layout: Layout, views: List[memoryview],
                       metadata: Dict[str, str], key: str) -> Dict[str, int]:
    """The header with placeholder checksums, the data, then the checksums over their
    placeholders (the same width: the header's size and layout do not change)."""
    names = [name for name, _, _ in layout]
    zeros = _hex(names, [0] * (len(names) + 1))
    head = header_bytes(layout, dict(metadata, **{key: zeros}))
    placeholder = _escaped(zeros)
    at = head.index(f"{json.dumps(key)}:\"".encode()) + len(json.dumps(key)) + 2
    assert head[at: at + len(placeholder)] == placeholder, "the value follows its key"
    running = [0]  # the data section's CRC32 before the first tensor, then after each
    with synced_file(path) as f:
        f.write(head)
        for view in views:
            f.write(view)
            running.append(zlib.crc32(view, running[-1]))  # the bytes are still in the caches
        checksums = _escaped(_hex(names, running))
        assert len(checksums) == len(placeholder), "fixed-width checksums keep the header's size"
        f.seek(at)
        f.write(checksums)
    head = head[:at] + checksums + head[at + len(checksums):]
    size = sum(view.nbytes for view in views)
    return {"bytes": len(head) + size,
            "crc32": crc32_combine(zlib.crc32(head), running[-1], size)}


def _escaped(value: str) -> bytes:
    """``value`` as it appears inside the header's JSON (a string, escaped)."""
    return json.dumps(value)[1:-1].encode()


def _hex(names: List[str], running: List[int]) -> str:
    """``{name: [before, after]}`` in fixed-width hex: tensor i spans running[i:i + 2]."""
    return json.dumps({name: [f"{running[i]:08x}", f"{running[i + 1]:08x}"]
                       for i, name in enumerate(names)}, separators=(",", ":"))
