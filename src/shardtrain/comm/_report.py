"""What a failed collective reports: every collective runs through :func:`guarded`, which
turns torch's failure into a :class:`CollectiveError` naming this rank, the collective,
where training was, the first collective at which the ranks' trails differ and the ranks
that did not answer the survivors' roll call through the rendezvous store
(:mod:`._roll_call`).

:func:`guarded` is also where a collective is timed (:mod:`._timing`) and where SIGTERM
waits for it (:mod:`._sigterm`).
"""
from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import _process, _sigterm, _trail, _tracing
from ._process import default_store, flight_recorder_prefix, get_backend, get_rank, get_world_size
from ._roll_call import Findings, inquire
from ._timing import STATE as _TIMED

if TYPE_CHECKING:
    from ._groups import Group

_ROLL_CALL_SECONDS = 5.0  # how long the survivors of a failed collective wait for each other


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within the timeout: the message names this
    rank, the collective, where training was (:func:`set_position`), the first collective at
    which the ranks' trails differ, and the ranks of the group that did not answer the
    survivors' roll call through the rendezvous store."""


class _Failures:
    """Collectives that failed in this process: the group is broken after one."""

    def __init__(self) -> None:
        self.count = 0


FAILURES = _Failures()


def guarded(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
            call: Callable[[], object], timed: bool = True, peer: Optional[int] = None):
    """``call()``; a failure of torch's collective becomes a :class:`CollectiveError` that
    says who and where. With :func:`time_collectives` on, a collective with a tensor is timed
    (``timed=False``: ``call`` waits for one already issued). ``peer``: the other rank of a
    point-to-point send or receive (the roll call asks it alone)."""
    _sigterm.enter()
    timing = _TIMED.timing if timed and tensor is not None else None
    mark = timing.start(op) if timing is not None else None
    try:
        result = call()
        if mark is not None:
            if result is None:  # done: synchronous
                timing.stop(op, tensor, group, mark)
            else:  # issued: stops at its wait()
                _TIMED.pending[id(result)] = (op, tensor, group, mark)
        return result
    except RuntimeError as err:  # torch's DistBackendError and gloo's timeouts included
        if isinstance(err, CollectiveError):
            raise
        error = CollectiveError(_explain(op, group, tensor, err, peer))
        _sigterm.end_if_stopped(str(error))
        raise error from err
    finally:
        _sigterm.leave()


def _explain(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
             err: BaseException, peer: Optional[int] = None) -> str:
    FAILURES.count += 1
    _process.broken = True
    me = get_rank()
    ranks = group.ranks() if group is not None else list(range(get_world_size()))
    what = op if tensor is None else (f"{op} of {tensor.numel():,} "
                                      f"{_tracing.dtype_name(tensor.dtype)} elements")
    position = _tracing.STATE.position
    where = position() if position is not None else "outside a training step"
    name = group.name if group is not None else "world"
    cause = " ".join(str(err).split())[:300]
    if peer is not None:  # point to point: the other rank is the one to ask about
        ranks = sorted({me, peer})
        way = "from" if op == "recv" else "to"
        head = f"rank {me}: {what} {way} rank {peer} failed at {where}: {cause}"
    else:
        head = (f"rank {me}: {what} over the {name} group (ranks {_trail.spans(ranks)}) failed "
                f"at {where}: {cause}")
    found = inquire(_short_store(), FAILURES.count, ranks, me, _tracing.own_entries(),
                    _ROLL_CALL_SECONDS)
    lines = [head]
    diff = _trail.first_difference(found.trails, order=found.trails.get(me))
    if diff is not None:
        lines.append(diff.explain(found.ended))
    lines.append(_who_is_gone(found, diff is not None))
    if get_backend() == "nccl":
        lines.append(f"NCCL's flight recorder writes each rank's last collectives to "
                     f"{flight_recorder_prefix()}<rank> when its watchdog times one out; "
                     f"compare them with: python -m torch.distributed.flight_recorder.fr_trace "
                     f"{os.path.dirname(flight_recorder_prefix())} --prefix "
                     f"{os.path.basename(flight_recorder_prefix())}")
    return "\n".join([lines[0]] + ["  " + line.replace("\n", "\n  ") for line in lines[1:]])


def _who_is_gone(found: Findings, differ: bool) -> str:
    if found.missing is None:
        return ("The rendezvous store, which rank 0 hosts, does not answer: rank 0 ended or "
                "its node cannot be reached; its output says why.")
    ended = sorted(found.ended)
    silent = [r for r in found.missing if r not in found.ended]
    parts = []
    if ended:
        parts.append(f"Rank(s) {_trail.spans(ended)} ended (their process is gone); their "
                     "output says why.")
    if silent:
        parts.append(f"Rank(s) {_trail.spans(silent)} did not answer within "
                     f"{_ROLL_CALL_SECONDS:.0f} s: ended, or stuck before this collective (in "
                     "a different branch, a data loader, I/O); their output says where.")
    if not parts and differ:
        parts.append("Every rank of the group answered: the difference above is the cause.")
    elif not parts:
        parts.append("Every rank of the group answered: they issued different collectives, "
                     "the network between them failed, or torch refused the call itself (see "
                     "the cause).")
    return " ".join(parts)


def _short_store():
    """The rendezvous store with a short timeout, after a failure (a dead host must not
    stall the report; the broken group needs no rendezvous any more)."""
    store = default_store()
    if store is not None:
        store.set_timeout(datetime.timedelta(seconds=_ROLL_CALL_SECONDS))
    return store


def _forget_trail() -> None:
    # Every rank got here (destroy's barrier): no peer will need this trail. A rank that
    # ends without destroy() leaves its file for a waiting peer (and shardtrain trails).
    _tracing.close_trail(remove=not FAILURES.count)


_process.after_destroy(_forget_trail)
