"""Saving: stage on every rank, write every rank's files, then publish, atomically.

1. Every rank stages its part (:mod:`._staging`), where anything that can refuse does;
   rank 0 creates ``<tag>.tmp-<id>/`` (the id is gathered from rank 0, which also makes this a
   barrier; stale ``<tag>.tmp-*`` from killed saves of the tag are removed).
2. Every rank writes its files there, each fsync'ed, and reports their sizes and CRC32s
   (its safetensors header records the CRC32 of each tensor too).
3. Rank 0 writes meta.json, renames the directory to ``<tag>`` (a re-save first moves the old
   one aside as ``<tag>.replaced-<id>``), then replaces ``latest``. A last gather tells every
   rank that the save is complete.

A partial directory never carries the tag's name, so a save killed at any point leaves the
previous checkpoint and ``latest`` loadable; the test hook
``SHARDTRAIN_CHECKPOINT_FAULT=<point>@<rank>`` kills that rank at one of those points to show
it. A rank that fails without being killed makes every rank raise, and rank 0 removes the
temporary directory.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .. import comm
from ..state import TrainingParts
from ..files import atomic_path, fsync_dir, write_synced
from ..errors import CheckpointTagError
from ..log import logger
from . import _background as background
from . import _engine_state as engine_state
from ._agreement import Problem, agree, capture
from ._format import LATEST, META, REPLACED, TMP, rank_file
from ._integrity import HEADER_CRC32, header_metadata, manifest_digests
from ._paths import is_plain_tag
from ._safetensors_writer import write_safetensors
from ._staging import Staged, stage_rank


__all__ = ["save_checkpoint"]

FAULT_ENV = "SHARDTRAIN_CHECKPOINT_FAULT"  # test hook: "<point>@<rank>" kills that rank there

Files = Dict[str, Dict[str, int]]  # file name -> {"bytes", "crc32"}


def save_checkpoint(engine: Any, save_dir: str, tag: Optional[str] = None,
                    client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Saves the engine's full training state to ``<save_dir>/<tag>/``; call it on all ranks.

    ``engine`` is read through ``engine.training_parts()`` only. See
    :meth:`shardtrain.Engine.save_checkpoint` for the arguments.
    """
    background.wait_for_checkpoint()  # one save at a time; a failed one raises here
    parts: TrainingParts = engine.training_parts()
    if not save_dir:
        raise ValueError("save_checkpoint: save_dir is empty; give the directory to save into.")
    engine_state.check_stage(parts, "save_checkpoint")
    save_dir = os.fspath(save_dir)
    tag = _agreed_tag(parts, tag)
    in_background = engine_state.async_save(parts)
    staged, token, digests = _stage(parts, save_dir, tag, client_state or {},
                                    exclude_frozen_parameters, copy=in_background)
    job = (save_dir, tag, token, staged, digests, save_latest)
    if in_background:  # training goes on from here; the files follow
        background.start(_write_and_publish, *job, comm.side_group())
    else:
        _write_and_publish(*job)
    return True


def _write_and_publish(save_dir: str, tag: str, token: str, staged: Staged,
                       digests: Dict[str, str], save_latest: bool,
                       group: Optional[comm.SideGroup] = None) -> None:
    """Phases 2 and 3, over ``group`` (the side group when this runs in the background)."""
    tmp = os.path.join(save_dir, f"{tag}{TMP}{token}")
    with _removed_on_failure(tmp if comm.get_rank() == 0 else None):
        files = _write(tmp, staged, digests, group)
        _publish_everywhere(save_dir, tag, token, staged, files, save_latest, group)


def _agreed_tag(parts: TrainingParts, tag: Optional[str]) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine_state.global_steps(parts)}"
    tags = comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        mode = engine_state.tag_validation(parts)
        message = (f"save_checkpoint: ranks passed different tags {sorted(set(tags))}; rank 0's "
                   f"{tags[0]!r} is used. Pass the same tag on every rank.")
        if mode == "Fail":
            raise CheckpointTagError(message + " (checkpoint.tag_validation is Fail)")
        if mode == "Warn":
            logger.warning(message)
    tag = tags[0]
    if not is_plain_tag(tag):
        raise ValueError(f"save_checkpoint: tag {tag!r} cannot name a checkpoint directory "
                         f"(no '/', not 'latest', no '{TMP}' or '{REPLACED}'); choose another.")
    return tag


# -- the three phases, each ended by an agreement of every rank --------------------------------

def _stage(parts: TrainingParts, save_dir: str, tag: str, client_state: Dict[str, Any],
           exclude_frozen: bool, copy: bool = False) -> Tuple[Staged, str, Dict[str, str]]:
    """Everything that can refuse happens here, before any file is written. Rank 0 makes
    the temporary directory and the digests of meta.json's fields, which every rank records
    in its file; the agreement is the barrier after which the directory exists."""
    box: List[Optional[Problem]] = [None]
    staged, sent = None, None
    with capture(box):
        staged = stage_rank(parts, client_state, exclude_frozen, copy)
        if comm.get_rank() == 0:
            staged.meta = json.loads(json.dumps(dict(staged.meta, tag=tag)))  # as read back
            sent = (_prepare_dirs(save_dir, tag), manifest_digests(staged.meta))
    token, digests = agree(box[0], sent)[0]
    return staged, token, digests


def _write(tmp: str, staged: Staged, digests: Dict[str, str],
           group: Optional[comm.SideGroup] = None) -> Files:
    """Every rank writes its files; every rank learns the sizes and CRC32s of all of them."""
    box: List[Optional[Problem]] = [None]
    infos: Files = {}
    with capture(box):
        infos = _write_rank(tmp, staged, digests)
    return {name: info for per_rank in agree(box[0], infos, group)
            for name, info in per_rank.items()}


def _publish_everywhere(save_dir: str, tag: str, token: str, staged: Staged, files: Files,
                        save_latest: bool, group: Optional[comm.SideGroup] = None) -> None:
    """Rank 0 publishes; the last agreement tells every rank that the save is complete."""
    box: List[Optional[Problem]] = [None]
    if comm.get_rank() == 0:
        with capture(box):
            _publish(save_dir, tag, token, staged.meta, files, save_latest)
    agree(box[0], None, group)


@contextlib.contextmanager
def _removed_on_failure(tmp: Optional[str]) -> Iterator[None]:
    """Rank 0 removes the temporary tag directory of a save that failed (one that was
    killed leaves it; the next save of the tag clears it)."""
    try:
        yield
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- the directory and the files -----------------------------------------------------------------

def _prepare_dirs(save_dir: str, tag: str) -> str:
    """Rank 0: the save directory, a fresh temporary tag directory, stale ones cleared."""
    os.makedirs(save_dir, exist_ok=True)
    _recover_replaced(save_dir, tag)
    for entry in os.listdir(save_dir):  # left by saves that were killed
        if entry.startswith(f"{tag}{TMP}"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
        elif entry.startswith(f"{LATEST}{TMP}"):
            os.remove(os.path.join(save_dir, entry))
    token = uuid.uuid4().hex[:12]
    os.mkdir(os.path.join(save_dir, f"{tag}{TMP}{token}"))
    return token


def _recover_replaced(save_dir: str, tag: str) -> None:
    """A re-save killed between its two renames left the old ``<tag>`` as
    ``<tag>.replaced-<id>``: put it back (or drop it if the new ``<tag>`` got in place)."""
    final = os.path.join(save_dir, tag)
    for entry in sorted(os.listdir(save_dir)):
        if not entry.startswith(f"{tag}{REPLACED}"):
            continue
        path = os.path.join(save_dir, entry)
        if os.path.isdir(final):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.rename(path, final)


def _write_rank(tmp: str, staged: Staged, digests: Dict[str, str]) -> Files:
    """Writes this rank's files (fsync'ed); returns their sizes and CRC32s."""
    tensors_name = rank_file(staged.rank, "safetensors")
    header = header_metadata(staged.rank, comm.get_world_size(), staged.ranges, digests)
    infos = {tensors_name: write_safetensors(os.path.join(tmp, tensors_name), staged.tensors,
                                             header, checksums=HEADER_CRC32)}
    _fault("after_file")
    json_name = rank_file(staged.rank, "json")
    infos[json_name] = write_synced(os.path.join(tmp, json_name),
                                    json.dumps(staged.rank_json).encode())
    _fault("after_file")
    if staged.client_objects is not None:
        name = rank_file(staged.rank, "client.pt")
        infos[name] = write_synced(os.path.join(tmp, name), staged.client_objects)
    return infos


def _fault(point: str) -> None:
    """Test hook: ``SHARDTRAIN_CHECKPOINT_FAULT=<point>@<rank>`` kills that rank at ``point``
    (SIGKILL: no clean-up runs), to prove a killed save leaves the previous one loadable."""
    wanted = os.environ.get(FAULT_ENV)
    if wanted and wanted == f"{point}@{comm.get_rank()}":
        os.kill(os.getpid(), signal.SIGKILL)


def _publish(save_dir: str, tag: str, token: str, meta: Dict[str, Any], files: Files,
             save_latest: bool) -> None:
    """Rank 0, once every rank's files are on disk: meta.json, then the rename that makes
    the tag visible, then ``latest``. A kill at any point leaves a loadable checkpoint."""
    tmp = os.path.join(save_dir, f"{tag}{TMP}{token}")
    meta = dict(meta, files=files)  # the tag is in meta already (and in its digests)
    write_synced(os.path.join(tmp, META), json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    _fault("before_rename")
    final = os.path.join(save_dir, tag)
    replaced = os.path.join(save_dir, f"{tag}{REPLACED}{token}")
    if os.path.exists(final):  # a directory cannot be renamed over a non-empty one
        os.rename(final, replaced)
        _fault("between_renames")
    os.rename(tmp, final)
    fsync_dir(save_dir)
    shutil.rmtree(replaced, ignore_errors=True)
    _fault("before_latest")
    if save_latest:
        with atomic_path(os.path.join(save_dir, LATEST)) as latest_tmp:
            write_synced(latest_tmp, tag.encode())  # no newline: DeepSpeed's convention
