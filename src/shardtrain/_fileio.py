"""Durable, atomic file writes: the one helper every writer of the package uses.

A reader (a resuming job, an autotuning parent, ``from_pretrained``) must never see half a
file, and a crash must never leave one under the final name. So a file is written under a
temporary name beside its destination, flushed and fsync'ed, then renamed over it
(``os.replace`` is atomic on POSIX and Windows); the directory is fsync'ed so that the rename
itself survives a power cut.
"""
from __future__ import annotations

import contextlib
import os
import uuid
import zlib
from typing import Dict, Iterator, Optional, Sequence, Union

from ._crc32 import crc32_combine

__all__ = ["atomic_path", "write_synced", "fsync_dir", "temporary_name"]

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


def write_synced(path: str, *blobs: Blob,
                 crc32s: Optional[Sequence[Optional[int]]] = None) -> Dict[str, int]:
    """Writes the buffers one after the other and fsyncs; returns ``{"bytes", "crc32"}``.

    ``crc32s``, one entry per buffer, gives the CRC32s the caller has already computed (None
    for the others): those buffers are not read again, the file's CRC32 is combined from
    theirs. Not atomic by itself: callers write into a temporary name or directory first.
    """
    known = list(crc32s) if crc32s is not None else [None] * len(blobs)
    if len(known) != len(blobs):
        raise ValueError(f"write_synced: {len(blobs)} buffers but {len(known)} CRC32s")
    crc, size = 0, 0
    with open(path, "wb") as f:
        for blob, blob_crc in zip(blobs, known):
            f.write(blob)
            nbytes = memoryview(blob).nbytes
            crc = zlib.crc32(blob, crc) if blob_crc is None else crc32_combine(crc, blob_crc,
                                                                                  nbytes)
            size += nbytes
        f.flush()
        os.fsync(f.fileno())
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
