"""The divergence check: the ranks compare their collectives while the group still works.

Ranks that issue different collectives do not always hang: two all-reduces of the same size
from different places meet each other and training goes on, wrong. Each rank's trail keeps a
count and a checksum of its calls per group (:meth:`~._trail.Trail.fingerprints`); the check
gathers them (one small all-gather) and, when they disagree, every rank raises
:class:`DivergenceError` naming the first differing collective. ``"step"`` checks at each
optimizer step (:func:`check_agreement`), ``"collective"`` before every collective over its
group (:func:`check_group`, called by :mod:`._ops`).
"""
from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING, Dict, List, Tuple

import torch
import torch.distributed as dist

from . import _trail, _tracing
from ._groups import WORLD, _handle
from ._process import all_gather_flat, get_backend, get_rank, get_world_size
from ._report import CollectiveError, guarded

if TYPE_CHECKING:
    from ._groups import Group

_CHECK_ENV = "SHARDTRAIN_DIVERGENCE_CHECK"  # "off", "step" or "collective"; wins over config
CHECK_MODES = ("off", "step", "collective")
_MAX_GROUPS = 16  # rows per rank in the step check: more groups than a mesh ever makes


class DivergenceError(CollectiveError):
    """The ranks issued different collectives (found by :func:`check_agreement` or the
    per-collective check while the group still worked): the message names the first one."""


class _Check:
    """How the ranks compare their collectives now (:func:`set_check`)."""

    def __init__(self) -> None:
        self.mode = "off"


STATE = _Check()


def set_check(mode: str) -> None:
    """How the ranks compare their collectives while the group works: ``"off"``; ``"step"``
    (:func:`check_agreement` at each optimizer step: one small all-gather); ``"collective"``
    (before every collective, over its group: for debugging, it doubles the collectives).
    ``$SHARDTRAIN_DIVERGENCE_CHECK`` wins over ``mode``."""
    mode = os.environ.get(_CHECK_ENV) or mode
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check {mode!r} is not one of {', '.join(CHECK_MODES)} "
                         f"(from {_CHECK_ENV} or diagnostics.divergence_check).")
    STATE.mode = mode


def check_mode() -> str:
    return STATE.mode


def check_agreement(where: str = "at the end of a step") -> None:
    """Compares every rank's count and checksum of the collectives it issued over each group
    (one all-gather of a small tensor over the world); raises :class:`DivergenceError` on
    every rank, naming the first differing collective, when they disagree."""
    t = _tracing.trail()
    if t is None:
        return
    rows = sorted((zlib.crc32(f"{pg}|{ranks}".encode()), count, crc)
                  for (pg, ranks), (count, crc) in t.fingerprints().items())[:_MAX_GROUPS]
    mine = torch.zeros(_MAX_GROUPS, 3, dtype=torch.int64)
    if rows:
        mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
    table = _gather_rows(mine, WORLD)
    agreed: Dict[int, Tuple[int, int]] = {}
    for key, count, crc in table.view(-1, 3).tolist():
        if key and agreed.setdefault(key, (count, crc)) != (count, crc):
            _raise_divergence(WORLD, where)


def check_group(group: "Group", where: str) -> None:
    """The per-collective check: the ranks of ``group`` compare their calls over it."""
    table = _gather_rows(torch.tensor(_group_fingerprint(group), dtype=torch.int64), group)
    if (table != table[0]).any():
        _raise_divergence(group, where)


def _group_fingerprint(group: "Group") -> List[int]:
    """Count and checksum of this rank's collectives over ``group``'s process group, and of
    its marks (:func:`mark`)."""
    t = _tracing.STATE.trail
    prints = t.fingerprints() if t is not None else {}
    pg, ranks = group.pg_name(), group.spans()
    return [*prints.get((pg, ranks), (0, 0)), *prints.get((pg + _trail.ORDER, ranks), (0, 0))]


def _gather_rows(mine: torch.Tensor, group: "Group") -> torch.Tensor:
    """Every rank's ``mine`` (not traced: the check is not part of the program compared)."""
    from .. import accelerator  # local import: accelerator does not depend on comm
    dev = accelerator.device() if get_backend() == "nccl" else torch.device("cpu")
    flat = mine.to(dev).reshape(-1)
    out = torch.empty(group.size() * flat.numel(), dtype=flat.dtype, device=dev)
    guarded("divergence check", group, flat,
            lambda: all_gather_flat(out, flat, group=_handle(group)))
    return out.view((group.size(),) + tuple(mine.shape)).cpu()


def _raise_divergence(group: "Group", where: str) -> None:
    size = get_world_size(group)
    trails: List = [None] * size
    guarded("divergence check", group, None, lambda: dist.all_gather_object(
        trails, (get_rank(), _trail.encode(_tracing.own_entries())), group=_handle(group)))
    by_rank = {rank: _trail.decode(text) for rank, text in trails}
    diff = _trail.first_difference(by_rank, order=by_rank.get(get_rank()))
    detail = diff.explain() if diff is not None else (
        "Their counts or checksums differ, but the differing collective is older than the "
        f"trails hold (raise {_tracing.TRAIL_LENGTH_ENV}).")
    raise DivergenceError(f"rank {get_rank()}: the ranks of the {group.name} group (ranks "
                          f"{group.spans()}) issued different collectives, found by the check "
                          f"{where}:\n  " + detail.replace("\n", "\n  "))
