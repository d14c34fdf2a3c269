"""Logging that only the chosen ranks print.

Example:
    >>> shardtrain.log_dist("loaded 3 shards", ranks=[0])       # printed by rank 0 only
    >>> shardtrain.log_dist_once("slow path taken", ranks=[-1])  # every rank, once per process
"""
from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional, Set, Tuple

from . import comm

__all__ = ["logger", "log_dist", "log_dist_once"]

logger = logging.getLogger("shardtrain")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[shardtrain] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

_seen: Set[Tuple[str, Tuple[int, ...]]] = set()


def _selected(ranks: Optional[Iterable[int]]) -> bool:
    if ranks is None:
        return True
    ranks = list(ranks)
    return -1 in ranks or comm.get_rank() in ranks


def log_dist(message: str, ranks: Optional[Iterable[int]] = (0,), level: int = logging.INFO) -> None:
    """Logs ``message`` on the listed ranks only (``None`` or ``[-1]``: every rank).

    Args:
        message: the text; the rank is prefixed when more than one process runs.
        ranks: global ranks that print.
        level: a ``logging`` level.
    """
    if not _selected(ranks):
        return
    prefix = f"[rank {comm.get_rank()}] " if comm.get_world_size() > 1 else ""
    logger.log(level, prefix + message)


def log_dist_once(message: str, ranks: Optional[Iterable[int]] = (0,),
                  level: int = logging.WARNING) -> None:
    """Like :func:`log_dist`, but a given message is printed once per process."""
    key = (message, tuple(ranks) if ranks is not None else (-1,))
    if key in _seen:
        return
    _seen.add(key)
    log_dist(message, ranks, level)
