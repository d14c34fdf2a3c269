"""This rank's trail of collectives: every collective and mark written into it as it is
issued, with where training was (:func:`set_position`) and the module a ZeRO-3 gather
fetches (:func:`labelled`).

The trail itself (a ring of records in a memory-mapped file, and how trails are compared)
is :mod:`._trail`; here is the one this process keeps: made at its first collective, its
file announced through the rendezvous store so that a survivor on this machine can read it
if this process dies (:mod:`._roll_call`), and forgotten after :func:`destroy`.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional

import torch

from . import _sigterm, _trail
from ._groups import WORLD, Group
from ._process import default_store, get_rank, get_world_size, is_initialized, logger
from ._roll_call import announce_trail, process_gone

TRAIL_LENGTH_ENV = "SHARDTRAIN_TRAIL_LENGTH"  # collectives each rank remembers; 0: none
_TRAIL_DIR_ENV = "SHARDTRAIN_TRAIL_DIR"
_STALE_TRAIL_S = 24 * 3600  # a trail a dead process left is kept a day (shardtrain trails)


class _Tracing:
    """What the next record goes into and says."""

    def __init__(self) -> None:
        self.trail: Optional[_trail.Trail] = None
        # SHARDTRAIN_TRAIL_LENGTH=0, a world of one, or keep_trail(False): nothing is written
        self.off = False
        self.position: Optional[Callable[[], str]] = None  # where training is (set_position)
        self.label = ""  # the module a ZeRO-3 gather fetches (labelled())

    def where(self) -> str:
        return self.position() if self.position is not None else ""


STATE = _Tracing()


def set_position(describe: Optional[Callable[[], str]],
                 replacing: Optional[Callable[[], str]] = None) -> None:
    """``describe()`` says where this rank is (``"step 3, micro-step 2, backward"``) when a
    collective fails; the engine sets it. With ``replacing``, only if that is the one set
    (an engine released after a newer one was built leaves the newer one's)."""
    if replacing is None or STATE.position is replacing:
        STATE.position = describe


@contextlib.contextmanager
def labelled(name: str) -> Iterator[None]:
    """Collectives issued inside the block carry ``name`` in the trail (the module whose
    parameters a ZeRO-3 gather fetches), so that a rank that skipped it is named with it.

    Example:
        >>> with comm.labelled("blocks.1"):
        ...     comm.all_gather(out, mine)
    """
    outer, STATE.label = STATE.label, name
    try:
        yield
    finally:
        STATE.label = outer


def mark(event: str, label: str, group: Optional["Group"] = None) -> None:
    """Records in the trail a point that every rank of ``group`` passes in the same order,
    though no collective (ZeRO-3 marks the forward of each module: its gathers are matched
    by order, and a rank that skips a module is named with it).

    Example:
        >>> comm.mark("forward", "blocks.1", zero_group)
    """
    g = WORLD if group is None else group
    if STATE.off or g.solo:
        return
    t = STATE.trail if STATE.trail is not None else trail()
    if t is not None:
        t.record(g.name, g.pg_name() + _trail.ORDER, g.spans(), event, 0, "", label, STATE.where())


def record(op: str, tensor: Optional[torch.Tensor], group: Optional["Group"]) -> Optional["Group"]:
    """Writes the collective into the trail; returns its group, or None when nothing was
    written (a group of one rank, the side group, no trail)."""
    g = WORLD if group is None else group
    if g.solo or g.name == "side":  # the side group's calls come from other threads
        return None
    t = STATE.trail if STATE.trail is not None else trail()
    if t is None:
        return None
    ranks = g.spans()
    if "," not in ranks and "-" not in ranks:
        return None  # a group of one rank
    t.record(g.name, g.pg_name(), ranks, op, 0 if tensor is None else tensor.numel(),
             "" if tensor is None else dtype_name(tensor.dtype), STATE.label, STATE.where())
    return g


def trail() -> Optional[_trail.Trail]:
    """This rank's :class:`~shardtrain.comm._trail.Trail` of collectives (None in a world of
    one or with ``SHARDTRAIN_TRAIL_LENGTH=0``); made at the first collective."""
    if STATE.trail is not None or STATE.off:
        return STATE.trail
    if not is_initialized():
        return None
    slots = int(os.environ.get(TRAIL_LENGTH_ENV, "1024"))
    if get_world_size() == 1 or slots <= 0:
        STATE.off = True
        return None
    folder = trail_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_trails(folder)
        path = os.path.join(folder, f"rank{get_rank()}-pid{os.getpid()}.trail")
        STATE.trail = _trail.Trail(slots, path)
        store = default_store()  # its timeout stays: later groups rendezvous through it
        if store is not None:
            announce_trail(store, get_rank(), path)
    except OSError as err:  # a read-only or full temp dir: keep the trail in memory
        logger.debug("trail file: %s; the trail stays in memory", err)
        STATE.trail = _trail.Trail(slots)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun (shardtrain run)
        _sigterm.install()
    return STATE.trail


def trail_dir() -> str:
    """Where the ranks of this machine keep their trail files (``rank<R>-pid<P>.trail``):
    ``$SHARDTRAIN_TRAIL_DIR``, else a folder of this user's in the temporary directory."""
    return os.environ.get(_TRAIL_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"shardtrain-trails-{os.getuid() if hasattr(os, 'getuid') else 0}")


def keep_trail(on: bool) -> None:
    """Turns this process's collective trail on (the default) or off. Off, a failed
    collective names no differing collective and the divergence check has nothing to
    compare; every rank must switch at the same point (the positions count from there)."""
    STATE.off = not on


def _remove_stale_trails(folder: str) -> None:
    """Trail files that processes which ended without removing theirs (killed, aborted)
    left more than a day ago."""
    old = time.time() - _STALE_TRAIL_S
    for name in os.listdir(folder):
        match = re.fullmatch(r"rank\d+-pid(\d+)\.trail", name)
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if match and os.path.getmtime(path) < old and process_gone(int(match.group(1))):
                os.remove(path)


def close_trail(remove: bool) -> None:
    """Closes this rank's trail (its file removed with ``remove``); the next collective
    starts a new one."""
    if STATE.trail is not None:
        STATE.trail.close(remove=remove)
    STATE.trail, STATE.off = None, False


def own_entries() -> List[_trail.Entry]:
    """The records this rank's trail still holds, oldest first."""
    return STATE.trail.entries() if STATE.trail is not None else []


_DTYPES: Dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32`` (cached: it is asked at every collective)."""
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).replace("torch.", "")
    return name
