"""Reading a checkpoint: finding the tag, meta.json, and byte ranges of the rank files.

A rank that needs elements ``[lo, hi)`` of a tensor reads exactly the slices of the rank files
that overlap them (``safe_open(...).get_slice(...)``), so loading on another world size or
stage reads no more than it keeps. Every file is checked against the size and CRC32 that
meta.json records (:meth:`Reader.verify`), and every piece against the dtype and shape
meta.json gives it, so a truncated or corrupted file is reported by name instead of loaded.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import zlib
from typing import Any, Dict, Optional

import torch
from safetensors import SafetensorError, safe_open

from ..log import logger
from ._agreement import Problem, corrupted, missing
from ._format import (FORMAT, FORMAT_VERSION, LATEST, META, REPLACED, ST_DTYPES, TMP,
                      dtype_from, dtype_name, rank_file)

__all__ = ["Reader", "resolve", "read_json", "read_meta", "module_key", "entry_for"]


def resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag directory to load; None when ``tag`` is None and there is no ``latest``."""
    if not os.path.isdir(load_dir):
        raise Problem(FileNotFoundError, f"checkpoint directory {load_dir!r} does not exist; "
                                         "check the path.")
    if tag is None:
        tag = _latest(load_dir)
        if tag is None:
            return None
    path = os.path.join(load_dir, str(tag))
    if os.path.isdir(path):
        return path
    for entry in sorted(os.listdir(load_dir)):
        if entry.startswith(f"{tag}{REPLACED}") and \
                os.path.isfile(os.path.join(load_dir, entry, META)):
            logger.warning("checkpoint %s: using %s, left by a re-save that was interrupted",
                           path, entry)
            return os.path.join(load_dir, entry)
    tags = sorted(e for e in os.listdir(load_dir) if TMP not in e and REPLACED not in e
                  and os.path.isfile(os.path.join(load_dir, e, META)))
    raise Problem(FileNotFoundError, f"checkpoint tag {str(tag)!r} not found in {load_dir!r} "
                                     f"(tags there: {tags or 'none'}).")


def _latest(load_dir: str) -> Optional[str]:
    """The tag that ``latest`` names; None when there is no ``latest``."""
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest, "rb") as f:
        tag = f.read().decode("utf-8", errors="replace").strip()
    if not tag or "/" in tag or os.sep in tag:
        raise Problem(ValueError, f"{latest} holds {tag!r}, not a tag name; pass tag= to "
                                  "name the checkpoint.")
    return tag


def read_json(path: str, info: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """A JSON object from ``path``, checked against its size and CRC32 when ``info`` has them."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise missing(path) from None
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
    if not os.path.isfile(path):
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
    """Reads byte ranges of the rank files, checking each file against meta.json."""

    def __init__(self, tag_dir: str, meta: Dict[str, Any], stack: contextlib.ExitStack):
        self.dir, self.meta, self.stack = tag_dir, meta, stack
        self.handles: Dict[int, Any] = {}
        self.keys: Dict[int, set] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def info(self, name: str) -> Dict[str, int]:
        info = self.meta["files"].get(name)
        if not isinstance(info, dict) or not {"bytes", "crc32"} <= set(info):
            raise corrupted(self.path(META), f"no size and CRC32 for {name}")
        return info

    def verify(self, name: str) -> None:
        """Checks a whole file's size and CRC32 (streamed)."""
        path, info = self.path(name), self.info(name)
        try:
            size = os.path.getsize(path)
            if size != info["bytes"]:
                raise corrupted(path, f"{size} bytes, meta.json says {info['bytes']}")
            crc = _file_crc32(path) if size else 0
        except FileNotFoundError:
            raise missing(path) from None
        if crc != info["crc32"]:
            raise corrupted(path, "its CRC32 does not match meta.json's")

    def handle(self, rank: int):
        if rank not in self.handles:
            name = rank_file(rank, "safetensors")
            path, info = self.path(name), self.info(name)
            if not os.path.isfile(path):
                raise missing(path)
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
        """Elements [lo, hi) of ``key``'s flattened tensor, from the files that hold them."""
        dtype = dtype or dtype_from(entry["dtype"], f"meta.json entry {key!r}")
        overlaps = [(rank, plo, phi, max(lo, plo), min(hi, phi))
                    for rank, plo, phi in entry["pieces"] if max(lo, plo) < min(hi, phi)]
        if sum(b - a for *_, a, b in overlaps) != hi - lo:
            raise corrupted(self.path(META), f"the pieces of {key!r} do not cover [{lo}, {hi})")
        if len(overlaps) == 1:  # one file holds it all: no assembly copy
            rank, plo, phi, a, b = overlaps[0]
            return self._piece(rank, key, phi - plo, dtype)[a - plo: b - plo]
        out = torch.empty(hi - lo, dtype=dtype)
        for rank, plo, phi, a, b in overlaps:
            out[a - lo: b - lo] = self._piece(rank, key, phi - plo, dtype)[a - plo: b - plo]
        return out

    def _piece(self, rank: int, key: str, numel: int, dtype: torch.dtype):
        f = self.handle(rank)
        path = self.path(rank_file(rank, "safetensors"))
        if key not in self.tensor_names(rank):
            raise corrupted(path, f"no tensor {key!r}")
        piece = f.get_slice(key)
        if piece.get_shape() != [numel] or ST_DTYPES.get(piece.get_dtype()) != dtype:
            raise corrupted(path, f"{key!r} is {piece.get_dtype()}{piece.get_shape()}, "
                                  f"meta.json says {dtype_name(dtype)}[{numel}]")
        return piece
