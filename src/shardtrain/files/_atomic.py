"""Durable, atomic file writes: the one helper every writer of the package uses.

A reader (a resuming job, an autotuning parent, ``from_pretrained``) must never see half a
file, and a crash must never leave one under the final name. So a file is written under a
temporary name beside its destination, flushed and fsync'ed, then renamed over it
(``os.replace`` is atomic on POSIX and Windows); the directory is fsync'ed so that the rename
itself survives a power cut. :func:`write_json` is the JSON files the autotuner and its runs
hand each other (trial configs, model info, metrics, the best config), written so.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
import zlib
from typing import Any, BinaryIO, Dict, Iterator, Union

__all__ = ["atomic_path", "synced_file", "write_synced", "fsync_dir", "temporary_name", "write_json"]

Blob = Union[bytes, bytearray, memoryview]


def temporary_name(path: str) -> str:
    """A name beside ``path`` that no other writer (process or thread) picks."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def atomic_path(path: "Union[str, os.PathLike[str]]") -> Iterator[str]:
    """Yields a temporary path to write; on success it is fsync'ed and renamed to ``path``,
    on failure removed. The parent directory is created if needed.

    Example:
        >>> with atomic_path("out/model.safetensors") as tmp:
        ...     safetensors.torch.save_file(tensors, tmp)
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = temporary_name(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # whoever wrote it may not have synced it
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


@contextlib.contextmanager
def synced_file(path: str) -> Iterator[BinaryIO]:
    """Yields ``path`` opened for writing (truncated); flushed and fsync'ed when the block
    ends without an error. Not atomic by itself: callers write into a temporary name or
    directory first."""
    with open(path, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_synced(path: str, *blobs: Blob) -> Dict[str, int]:
    """Writes the buffers one after the other and fsyncs; returns ``{"bytes", "crc32"}``.

    Not atomic by itself: callers write into a temporary name or directory first.
    """
    crc, size = 0, 0
    with synced_file(path) as f:
        for blob in blobs:
            f.write(blob)
            crc, size = zlib.crc32(blob, crc), size + len(blob)
    return {"bytes": size, "crc32": crc}


def fsync_dir(path: str) -> None:
    """Makes renames and new entries in ``path`` durable (a no-op where a directory cannot
    be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, data: Dict[str, Any]) -> None:
    """Writes ``data`` atomically (a reader never sees half a file)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
