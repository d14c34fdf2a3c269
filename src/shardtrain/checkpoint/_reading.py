"""Reading a checkpoint: finding the tag, meta.json, and byte ranges of the rank files.

A rank that needs elements ``[lo, hi)`` of a tensor reads exactly the slices of the rank files
that overlap them (``safe_open(...).get_slice(...)``), so loading on another world size or
stage reads no more than it keeps. Every file is checked against the size and CRC32 that
meta.json records (:meth:`Reader.verify`), and every piece against the dtype and shape
meta.json gives it, so a truncated or corrupted file is reported by name instead of loaded.

A reader that needs a few tensors whole, one at a time (an export of the weights), streams
them with :meth:`Reader.stream` instead: each piece is checked against the checksum its
file's header recorded for that tensor, so verifying the weights never reads the optimizer
states.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import zlib
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open

from ..log import logger
from ._agreement import Problem, as_plain_errors, corrupted, missing
from ._format import (FORMAT, FORMAT_VERSION, LATEST, META, REPLACED, ST_DTYPES, TMP, dtype_from,
                      dtype_name, rank_file, tensor_bytes)
from ._integrity import (check_header, check_layout, check_range, header_crc32s, header_ranges,
                         manifest_digests)
from ._paths import RANK_FILE, check_tag, inside, read_latest, regular_file

__all__ = ["Reader", "resolve", "tag_dir_of", "read_json", "read_meta", "module_key",
           "entry_for"]


def resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag directory to load; None when ``tag`` is None and there is no ``latest``. The
    tag must be a plain name and its directory must resolve inside ``load_dir``."""
    if not os.path.isdir(load_dir):
        raise Problem(FileNotFoundError, f"checkpoint directory {load_dir!r} does not exist; "
                                         "check the path.")
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    check_tag(str(tag), f"checkpoint {load_dir}")
    path = os.path.join(load_dir, str(tag))
    if os.path.isdir(path):
        return _inside_dir(path, load_dir)
    for entry in sorted(os.listdir(load_dir)):
        candidate = os.path.join(load_dir, entry)
        if entry.startswith(f"{tag}{REPLACED}") and os.path.isfile(os.path.join(candidate, META)):
            logger.warning("checkpoint %s: using %s, left by a re-save that was interrupted",
                           path, entry)
            return _inside_dir(candidate, load_dir)
    tags = sorted(e for e in os.listdir(load_dir) if TMP not in e and REPLACED not in e
                  and os.path.isfile(os.path.join(load_dir, e, META)))
    raise Problem(FileNotFoundError, f"checkpoint tag {str(tag)!r} not found in {load_dir!r} "
                                     f"(tags there: {tags or 'none'}).")


def tag_dir_of(checkpoint_dir: str, tag: Optional[str]) -> str:
    """The tag directory a one-process reader (consolidation, export) reads:
    ``checkpoint_dir`` itself when it is one, else ``tag`` (or the one ``latest`` names) in
    it. Raises plain exceptions (no process group)."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, META)):
        return checkpoint_dir  # a tag directory itself
    tag_dir = as_plain_errors(resolve, checkpoint_dir, tag)
    if tag_dir is None:
        raise FileNotFoundError(f"{os.path.join(checkpoint_dir, LATEST)} is missing: pass tag= "
                                "to choose the checkpoint to consolidate.")
    return tag_dir


def _inside_dir(path: str, root: str) -> str:
    if not inside(path, root):
        raise Problem(ValueError, f"{path} resolves to a directory outside {root}: a tag must "
                                  "be a directory inside the checkpoint directory; copy it there "
                                  "instead of linking to it.")
    return path


def read_json(path: str, info: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """A JSON object from ``path`` (a regular file inside its tag directory), checked against
    its size and CRC32 when ``info`` has them."""
    if regular_file(path, os.path.dirname(path)) is None:
        raise missing(path)
    with open(path, "rb") as f:
        blob = f.read()
    if info is not None:
        _check_blob(path, blob, info)
    try:
        value = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupted(path, f"JSON: {error}") from None
    if not isinstance(value, dict):
        raise corrupted(path, "JSON: not an object")
    return value


def _check_blob(path: str, blob: bytes, info: Dict[str, int]) -> None:
    if len(blob) != info["bytes"]:
        raise corrupted(path, f"{len(blob)} bytes, meta.json says {info['bytes']}")
    if zlib.crc32(blob) != info["crc32"]:
        raise corrupted(path, "its CRC32 does not match meta.json's")


def read_meta(tag_dir: str) -> Dict[str, Any]:
    path = os.path.join(tag_dir, META)
    if regular_file(path, tag_dir) is None:
        raise Problem(FileNotFoundError, f"{path} is missing: {tag_dir} is not a complete "
                                         "checkpoint (was its save interrupted?).")
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise corrupted(path, f"format {meta.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > FORMAT_VERSION:
        raise Problem(ValueError, f"{path} has format version {meta.get('version')!r}; this "
                                  f"shardtrain reads up to {FORMAT_VERSION}: upgrade it.")
    missing_keys = [k for k in ("world_size", "params", "buffers", "files", "counters")
                    if k not in meta]
    if missing_keys:
        raise corrupted(path, f"no {missing_keys}")
    check_layout(meta, path)
    return meta


def module_key(entry: Dict[str, Any], name: str, module_dtype: torch.dtype) -> str:
    """The saved copy to restore a module parameter from: the fp32 master when the module
    is fp32 now and the checkpoint has one (the 16-bit copy lost precision)."""
    if entry.get("master") and module_dtype == torch.float32:
        return f"master/{name}"
    return f"param/{name}"


def entry_for(entry: Dict[str, Any], key: str) -> Dict[str, Any]:
    """The meta entry of one saved tensor of a parameter (masters are fp32)."""
    return dict(entry, dtype="float32") if key.startswith("master/") else entry


def _file_crc32(path: str) -> int:
    # Mapped, not read: the checksum streams through the page cache without copies.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return zlib.crc32(mapped)


class Reader:
    """Reads byte ranges of the rank files, checking each file against meta.json.

    Only the file names meta.json's layout allows are opened, and only when they resolve to
    regular files inside the tag directory (:mod:`._paths`).
    """

    def __init__(self, tag_dir: str, meta: Dict[str, Any], stack: contextlib.ExitStack):
        self.dir, self.meta, self.stack = tag_dir, meta, stack
        self.handles: Dict[int, Any] = {}
        self.keys: Dict[int, set] = {}
        self.headers: Dict[int, Optional[Dict[str, str]]] = {}
        self.ranges: Dict[int, Any] = {}
        self.crc32s: Dict[int, Optional[Dict[str, Tuple[int, int]]]] = {}
        self._digests: Optional[Dict[str, str]] = None

    def path(self, name: str) -> str:
        if name != META and RANK_FILE.fullmatch(name) is None:
            raise corrupted(self.path(META), f"{name!r} is not a checkpoint file name")
        return os.path.join(self.dir, name)

    def checked(self, name: str) -> str:
        """The path of ``name``, once it is known to be a regular file inside the tag
        directory (never a link out of it, a FIFO or a device)."""
        path = self.path(name)
        if regular_file(path, self.dir) is None:
            raise missing(path)
        return path

    def info(self, name: str) -> Dict[str, int]:
        info = self.meta["files"].get(name)
        if not isinstance(info, dict) or not {"bytes", "crc32"} <= set(info):
            raise corrupted(self.path(META), f"no size and CRC32 for {name}")
        return info

    def verify(self, name: str) -> None:
        """Checks a whole file's size and CRC32 (streamed); for a rank's safetensors file,
        also meta.json against what its header recorded at the save."""
        path, info = self.checked(name), self.info(name)
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise corrupted(path, f"{size} bytes, meta.json says {info['bytes']}")
        if (_file_crc32(path) if size else 0) != info["crc32"]:
            raise corrupted(path, "its CRC32 does not match meta.json's")
        match = RANK_FILE.fullmatch(name)
        if match and match.group(2) == "safetensors":
            self.check_manifest(int(match.group(1)))

    def check_manifest(self, rank: int) -> None:
        header = self.header(rank)
        if header is None and self.meta.get("version") == 1:
            return  # written before rank files recorded meta.json's digests
        if self._digests is None:
            self._digests = manifest_digests(self.meta)
        check_header(self.path(rank_file(rank, "safetensors")), self.path(META), header,
                     self.meta, rank, self._digests)

    def header(self, rank: int) -> Optional[Dict[str, str]]:
        if rank not in self.headers:
            self.headers[rank] = self.handle(rank).metadata()
        return self.headers[rank]

    def handle(self, rank: int):
        if rank not in self.handles:
            name = rank_file(rank, "safetensors")
            path, info = self.checked(name), self.info(name)
            if os.path.getsize(path) != info["bytes"]:  # cheap: catches truncation first
                raise corrupted(path, f"{os.path.getsize(path)} bytes, meta.json says "
                                      f"{info['bytes']}")
            try:
                self.handles[rank] = self.stack.enter_context(safe_open(path, framework="pt"))
            except SafetensorError as error:
                raise corrupted(path, f"safetensors: {error}") from None
        return self.handles[rank]

    def tensor_names(self, rank: int) -> set:
        if rank not in self.keys:
            self.keys[rank] = set(self.handle(rank).keys())
        return self.keys[rank]

    def read(self, key: str, entry: Dict[str, Any], lo: int, hi: int,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements [lo, hi) of ``key``'s flattened tensor, from the files that hold them.
        Every piece is checked against its file's header before anything is allocated."""
        dtype = dtype or dtype_from(entry["dtype"], f"meta.json entry {key!r}")
        overlaps = [(rank, plo, phi, max(lo, plo), min(hi, phi))
                    for rank, plo, phi in entry["pieces"] if max(lo, plo) < min(hi, phi)]
        if sum(b - a for *_, a, b in overlaps) != hi - lo:
            raise corrupted(self.path(META), f"the pieces of {key!r} do not cover [{lo}, {hi})")
        pieces = [self._piece(rank, key, plo, phi, dtype) for rank, plo, phi, _, _ in overlaps]
        if len(overlaps) == 1:  # one file holds it all: no assembly copy
            _, plo, _, a, b = overlaps[0]
            return pieces[0][a - plo: b - plo]
        out = torch.empty(hi - lo, dtype=dtype)
        for piece, (_, plo, _, a, b) in zip(pieces, overlaps):
            out[a - lo: b - lo] = piece[a - plo: b - plo]
        return out

    def _piece(self, rank: int, key: str, plo: int, phi: int, dtype: torch.dtype):
        f = self.handle(rank)
        path = self.path(rank_file(rank, "safetensors"))
        if key not in self.tensor_names(rank):
            raise corrupted(path, f"no tensor {key!r}")
        piece = f.get_slice(key)
        if piece.get_shape() != [phi - plo] or ST_DTYPES.get(piece.get_dtype()) != dtype:
            raise corrupted(path, f"{key!r} is {piece.get_dtype()}{piece.get_shape()}, "
                                  f"meta.json says {dtype_name(dtype)}[{phi - plo}]")
        if rank not in self.ranges:
            self.ranges[rank] = header_ranges(self.header(rank))
        check_range(path, self.ranges[rank], key, plo, phi)
        return piece

    def stream(self, key: str, entry: Dict[str, Any], chunk_bytes: int) -> Iterator[torch.Tensor]:
        """Every element of ``key``'s flattened tensor, in order, as 1-D chunks of at most
        ``chunk_bytes``: views of the files' mapped memory, nothing copied.

        Each piece is checked against the checksum its file's header recorded for ``key``
        (:meth:`recorded_crc32`) once all of it has gone by, so the chunks of a corrupted
        piece are seen before the error: write them where a failure discards them.
        """
        dtype = dtype_from(entry["dtype"], f"meta.json entry {key!r}")
        step = max(1, chunk_bytes // dtype.itemsize)
        for rank, plo, phi in entry["pieces"]:
            piece = self._piece(rank, key, plo, phi, dtype)
            recorded = self.recorded_crc32(rank, key)
            crc = recorded[0] if recorded else 0
            for a in range(0, phi - plo, step):
                chunk = piece[a: min(a + step, phi - plo)]
                crc = zlib.crc32(tensor_bytes(chunk), crc)
                yield chunk
            if recorded is not None and crc != recorded[1]:
                raise corrupted(self.path(rank_file(rank, "safetensors")),
                                f"tensor {key!r} does not match the CRC32 recorded at the save")

    def recorded_crc32(self, rank: int, key: str) -> Optional[Tuple[int, int]]:
        """The ``(before, after)`` checksum rank ``rank``'s file recorded for ``key``, once
        its header is known to match meta.json. A file saved before per-tensor checksums is
        checked whole instead, once, and gives None."""
        name = rank_file(rank, "safetensors")
        if rank not in self.crc32s:
            self.check_manifest(rank)
            self.crc32s[rank] = header_crc32s(self.path(name), self.header(rank))
            if self.crc32s[rank] is None:
                self.verify(name)
        recorded = self.crc32s[rank]
        if recorded is None:
            return None
        if key not in recorded:
            raise corrupted(self.path(name), f"its header records no CRC32 for {key!r}")
        return recorded[key]
