"""A checkpoint that verifies itself: meta.json checked against the rank files' headers.

The rank files are checked against the sizes and CRC32s meta.json lists; meta.json itself is
checked against what every rank file recorded when it was written, in its safetensors header
(``__metadata__``):

* ``shardtrain.manifest``: a SHA-256 of each field of meta.json but ``files`` (canonical
  JSON), computed by rank 0 before any file was written and given to every rank. An edit of
  meta.json changes a field's digest; fixing the digests means editing a rank file, which
  changes its CRC32, which meta.json's ``files`` records: no single edit passes, and the
  error names the field;
* ``shardtrain.rank``, ``shardtrain.world_size``: who wrote the file, in which world;
* ``shardtrain.ranges``: for each tensor, the ``[lo, hi)`` of the flattened parameter it holds,
  checked against the piece meta.json says the file holds before the piece is read;
* ``shardtrain.crc32``: each tensor's checksum, the running CRC32 of the data section before
  and after its bytes (written by :func:`._safetensors_writer.write_safetensors`, in the pass
  that computes the file's CRC32).
  A load checks whole files against meta.json; a reader that needs only some tensors (an
  export of the weights) checks each tensor it reads against this instead, so it never reads
  the optimizer states to verify the weights.

meta.json's own layout is checked first (:func:`check_layout`): element counts against
shapes, and every piece against the even sharding the save uses, so a swapped or resized
piece is named before anything is read or allocated.

This detects corruption and edits; it is not a signature: whoever rewrites every file
consistently makes a new checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..layout import shard_range
from ._agreement import Problem, corrupted
from ._paths import RANK_FILE

__all__ = ["manifest_digests", "header_metadata", "check_header", "header_ranges",
           "header_crc32s", "check_range", "check_layout", "HEADER_MANIFEST", "HEADER_CRC32"]

HEADER_FORMAT = "shardtrain.format"
HEADER_RANK = "shardtrain.rank"
HEADER_WORLD = "shardtrain.world_size"
HEADER_RANGES = "shardtrain.ranges"
HEADER_MANIFEST = "shardtrain.manifest"
HEADER_CRC32 = "shardtrain.crc32"


def manifest_digests(meta: Mapping[str, Any]) -> Dict[str, str]:
    """SHA-256 of each field of meta.json but ``files`` (which lists the rank files' CRCs)."""
    return {key: hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":"))
                                .encode()).hexdigest()
            for key, value in meta.items() if key != "files"}


def header_metadata(rank: int, world: int, ranges: Dict[str, List[int]],
                    digests: Dict[str, str]) -> Dict[str, str]:
    """What a rank file's safetensors header records about the save."""
    return {HEADER_FORMAT: "1", HEADER_RANK: str(rank), HEADER_WORLD: str(world),
            HEADER_RANGES: json.dumps(ranges, separators=(",", ":")),
            HEADER_MANIFEST: json.dumps(digests, sort_keys=True, separators=(",", ":"))}


def check_header(path: str, meta_path: str, header: Optional[Dict[str, str]],
                 meta: Mapping[str, Any], rank: int, digests: Dict[str, str]) -> None:
    """The header of rank ``rank``'s file against meta.json (every field but ``files``), whose
    :func:`manifest_digests` are ``digests``."""
    if not header or HEADER_MANIFEST not in header:
        raise corrupted(path, "its header has no shardtrain metadata")
    if header.get(HEADER_RANK) != str(rank):
        raise corrupted(path, f"written by rank {header.get(HEADER_RANK)}, not rank {rank}")
    if header.get(HEADER_WORLD) != str(meta["world_size"]):
        raise corrupted(meta_path, f"field 'world_size' is {meta['world_size']!r} but {path} "
                                   f"was written in a world of {header.get(HEADER_WORLD)} ranks")
    try:
        saved = json.loads(header[HEADER_MANIFEST])
    except ValueError:
        raise corrupted(path, "its shardtrain.manifest is not JSON") from None
    for field in sorted(set(saved) | set(digests)):
        if saved.get(field) != digests.get(field):
            raise corrupted(meta_path, f"field {field!r} differs from what {path} recorded at "
                                       "the save: meta.json was edited or damaged after it")


def header_ranges(header: Optional[Dict[str, str]]) -> Optional[Dict[str, List[int]]]:
    """The ``[lo, hi)`` a rank file's header records for each tensor (None: format 1)."""
    return json.loads(header[HEADER_RANGES]) if header and HEADER_RANGES in header else None


def header_crc32s(path: str, header: Optional[Dict[str, str]]
                  ) -> Optional[Dict[str, Tuple[int, int]]]:
    """Each tensor's ``(before, after)`` running CRC32 of its file's data section, as the
    header records it (None: saved before they were recorded); the tensor's bytes are intact
    when ``zlib.crc32(bytes, before) == after`` (see :mod:`._safetensors_writer`)."""
    if not header or HEADER_CRC32 not in header:
        return None
    try:
        recorded = json.loads(header[HEADER_CRC32])
        return {name: (int(before, 16), int(after, 16))
                for name, (before, after) in recorded.items()}
    except (ValueError, TypeError, AttributeError):
        raise corrupted(path, f"its {HEADER_CRC32} is not an object of [before, after] "
                              "hex checksums") from None


def check_range(path: str, ranges: Optional[Dict[str, List[int]]], key: str, lo: int,
                hi: int) -> None:
    """meta.json says ``path`` holds elements ``[lo, hi)`` of ``key``: so must its header's
    ``ranges`` (:func:`header_ranges`)."""
    if ranges is None:
        return  # a format-1 file: no ranges recorded
    if ranges.get(key) != [lo, hi]:
        raise corrupted(path, f"it holds elements {ranges.get(key)} of {key!r}, meta.json says "
                              f"[{lo}, {hi})")


def check_layout(meta: Mapping[str, Any], meta_path: str) -> None:
    """meta.json's claims that need no file: element counts match shapes, every piece is where
    the even sharding of the saving world puts it, and ``files`` names rank files only."""
    world = meta["world_size"]
    if not isinstance(world, int) or world < 1:
        raise corrupted(meta_path, f"field 'world_size' is {world!r}")
    _check_files(meta_path, meta["files"], world)
    stages = _check_stages(meta_path, meta.get("stages"), world)
    for field in ("params", "buffers"):
        if not isinstance(meta[field], dict):
            raise corrupted(meta_path, f"field {field!r} is not an object")
        for name, entry in meta[field].items():
            _check_entry(meta_path, f"{field}[{name!r}]", entry, world, stages)


def _check_stages(meta_path: str, stages: Any, world: int) -> Optional[List[List[int]]]:
    """A pipeline-parallel save's stages: lists of global ranks that together are the world."""
    if stages is None:
        return None
    if not isinstance(stages, list) or not all(
            isinstance(s, list) and s and all(isinstance(r, int) for r in s) for s in stages) \
            or sorted(r for s in stages for r in s) != list(range(world)):
        raise corrupted(meta_path, f"field 'stages' is {stages!r}, not the world's ranks split "
                                   "into pipeline stages")
    return stages


def _check_entry(meta_path: str, where: str, entry: Any, world: int,
                 stages: Optional[List[List[int]]] = None) -> None:
    if not isinstance(entry, dict):
        raise corrupted(meta_path, f"{where} is not an object")
    shape, numel = entry.get("shape"), entry.get("numel")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) \
            or not isinstance(numel, int) or numel != math.prod(shape):
        raise corrupted(meta_path, f"{where} has shape {shape!r} and numel {numel!r}, which "
                                   "do not agree")
    ranks = list(range(world))
    if stages is not None:  # the ranks of its pipeline stage wrote it
        stage = entry.get("stage")
        if not isinstance(stage, int) or not 0 <= stage < len(stages):
            raise corrupted(meta_path, f"{where}.stage is {stage!r}, not one of the "
                                       f"{len(stages)} pipeline stages")
        ranks = stages[stage]
    if entry.get("trainable"):
        expected = [[r, *shard_range(numel, len(ranks), i)] for i, r in enumerate(ranks)]
        expected = [p for p in expected if p[2] > p[1]]
    else:
        expected = [[ranks[0], 0, numel]] if numel else []
    if entry.get("pieces") != expected:
        raise corrupted(meta_path, f"{where}.pieces is {entry.get('pieces')!r}, but a save on "
                                   f"{world} rank(s) puts it at {expected}")


def _check_files(meta_path: str, files: Any, world: int) -> None:
    if not isinstance(files, dict):
        raise corrupted(meta_path, "field 'files' is not an object")
    ranks = set()
    for name in files:
        match = RANK_FILE.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            raise Problem(ValueError, f"{meta_path}: field 'files' names {name!r}, which is not "
                                      "a rank file name; the checkpoint is damaged or was not "
                                      "written by shardtrain.")
        ranks.add(int(match.group(1)))
    if ranks != set(range(world)):
        raise corrupted(meta_path, f"field 'world_size' is {world} but field 'files' lists the "
                                   f"files of rank(s) {sorted(ranks)}")
    for rank in range(world):
        for ext in ("safetensors", "json"):
            if f"rank{rank:05d}.{ext}" not in files:
                raise corrupted(meta_path, f"field 'files' does not list rank{rank:05d}.{ext}")
