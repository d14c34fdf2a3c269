"""What the ranks know about their collectives: the trail each keeps, the divergence check
that compares them while the group works, and the report every rank that can still speak
gives when one fails (the roll call and trail exchange of :mod:`shardtrain._failure`)."""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import sys
import tempfile
import threading
import time
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _failure, _trail
from . import _process
from ._groups import WORLD, Group, _handle
from ._process import (all_gather_flat, flight_recorder_prefix, get_backend, get_rank,
                       get_world_size, is_initialized, logger)

_failures = 0  # collectives that failed in this process: the group is broken after one
_ROLL_CALL_SECONDS = 5.0  # how long the survivors of a failed collective wait for each other
_TRAIL_LENGTH_ENV = "SHARDTRAIN_TRAIL_LENGTH"  # collectives each rank remembers; 0: none
_TRAIL_DIR_ENV = "SHARDTRAIN_TRAIL_DIR"
_CHECK_ENV = "SHARDTRAIN_DIVERGENCE_CHECK"  # "off", "step" or "collective"; wins over config
CHECK_MODES = ("off", "step", "collective")


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within the timeout: the message names this
    rank, the collective, where training was (:func:`set_position`), the first collective at
    which the ranks' trails differ, and the ranks of the group that did not answer the
    survivors' roll call through the rendezvous store."""


class DivergenceError(CollectiveError):
    """The ranks issued different collectives (found by :func:`check_agreement` or the
    per-collective check while the group still worked): the message names the first one."""


_position: Optional[Callable[[], str]] = None
_label = ""  # the module a ZeRO-3 gather fetches (labelled())


def set_position(describe: Optional[Callable[[], str]],
                 replacing: Optional[Callable[[], str]] = None) -> None:
    """``describe()`` says where this rank is (``"step 3, micro-step 2, backward"``) when a
    collective fails; the engine sets it. With ``replacing``, only if that is the one set
    (an engine released after a newer one was built leaves the newer one's)."""
    global _position
    if replacing is None or _position is replacing:
        _position = describe


@contextlib.contextmanager
def labelled(name: str) -> Iterator[None]:
    """Collectives issued inside the block carry ``name`` in the trail (the module whose
    parameters a ZeRO-3 gather fetches), so that a rank that skipped it is named with it.

    Example:
        >>> with comm.labelled("blocks.1"):
        ...     comm.all_gather(out, mine)
    """
    global _label
    outer, _label = _label, name
    try:
        yield
    finally:
        _label = outer


def mark(event: str, label: str, group: Optional["Group"] = None) -> None:
    """Records in the trail a point that every rank of ``group`` passes in the same order,
    though no collective (ZeRO-3 marks the forward of each module: its gathers are matched
    by order, and a rank that skips a module is named with it).

    Example:
        >>> comm.mark("forward", "blocks.1", zero_group)
    """
    g = WORLD if group is None else group
    if _trail_off or g.solo:
        return
    t = _trail_now if _trail_now is not None else trail()
    if t is not None:
        t.record(g.name, g.pg_name() + _trail.ORDER, g.spans(), event, 0, "", label,
                 _position() if _position is not None else "")


class CollectiveTiming:
    """What times collectives (:func:`time_collectives`): :meth:`start` when one is issued
    returns a mark, :meth:`stop` when it has completed (an asynchronous one: when its
    ``wait()`` returns) gets it back."""

    def start(self, op: str) -> Optional[float]:
        """A mark for ``op`` (None: this operation is not timed)."""
        raise NotImplementedError

    def stop(self, op: str, tensor: torch.Tensor, group: Optional["Group"], mark: float) -> None:
        raise NotImplementedError


_timing: Optional[CollectiveTiming] = None
_pending: Dict[int, Tuple[str, torch.Tensor, Optional["Group"], float]] = {}


def time_collectives(timing: Optional[CollectiveTiming]) -> None:
    """Times every collective with a tensor from now on through ``timing`` (None: stop)."""
    global _timing
    _timing = timing
    _pending.clear()


def _completed(handle) -> None:
    """An asynchronous collective's ``wait()`` returned: its timing stops."""
    issued = _pending.pop(id(handle), None)
    if issued is not None and _timing is not None:
        _timing.stop(*issued)


def _guarded(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
             call: Callable[[], object], timed: bool = True):
    """``call()``; a failure of torch's collective becomes a :class:`CollectiveError` that
    says who and where. With :func:`time_collectives` on, a collective with a tensor is timed
    (``timed=False``: ``call`` waits for one already issued)."""
    global _in_collective
    _in_collective += 1
    timing = _timing if timed and tensor is not None else None
    mark = timing.start(op) if timing is not None else None
    try:
        result = call()
        if mark is not None:
            if result is None:  # done: synchronous
                timing.stop(op, tensor, group, mark)
            else:  # issued: stops at its wait()
                _pending[id(result)] = (op, tensor, group, mark)
        return result
    except RuntimeError as err:  # torch's DistBackendError and gloo's timeouts included
        if isinstance(err, CollectiveError):
            raise
        error = CollectiveError(_explain(op, group, tensor, err))
        _end_if_stopped(str(error))
        raise error from err
    finally:
        _in_collective -= 1
        if not _in_collective:
            _end_if_stopped(None)


# torchrun stops the other workers with SIGTERM as soon as one fails; a survivor blocked in
# a collective with the dead one would end before saying what it was doing. While a
# collective runs (or its failure is being explained), SIGTERM therefore waits: afterwards the
# report is printed and the process ends by the same signal. Anywhere else it ends the
# process at once, as before.
_in_collective = 0
_stop_pending = False


def _install_stop_handler() -> None:
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script's own handler stays
    signal.signal(signal.SIGTERM, _on_stop)


def _on_stop(signum, frame) -> None:
    global _stop_pending
    if _in_collective:
        _stop_pending = True
        return
    _end(signum)


def _end_if_stopped(report: Optional[str]) -> None:
    if _stop_pending:
        if report:
            sys.stderr.write(report + "\n")
            sys.stderr.flush()
        _end(signal.SIGTERM)


def _end(signum: int) -> None:
    global _stop_pending
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # a collective of autograd's device thread: the handler decides in the main thread
        _stop_pending = False
    os.kill(os.getpid(), signum)


def _explain(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
             err: BaseException) -> str:
    global _failures
    _failures += 1
    _process.broken = True
    me = get_rank()
    ranks = group.ranks() if group is not None else list(range(get_world_size()))
    what = op if tensor is None else (f"{op} of {tensor.numel():,} {_dtype_name(tensor.dtype)} "
                                      f"elements")
    where = _position() if _position is not None else "outside a training step"
    name = group.name if group is not None else "world"
    cause = " ".join(str(err).split())[:300]
    head = (f"rank {me}: {what} over the {name} group (ranks {_trail.spans(ranks)}) failed at "
            f"{where}: {cause}")
    found = _failure.inquire(_short_store(), _failures, ranks, me, _own_entries(), _ROLL_CALL_SECONDS)
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


def _who_is_gone(found: "_failure.Findings", differ: bool) -> str:
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


def _default_store():
    """The rendezvous store; None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as err:
        logger.debug("no rendezvous store: %s", err)
        return None


def _short_store():
    """The rendezvous store with a short timeout, after a failure (a dead host must not
    stall the report; the broken group needs no rendezvous any more)."""
    store = _default_store()
    if store is not None:
        store.set_timeout(datetime.timedelta(seconds=_ROLL_CALL_SECONDS))
    return store


# -- the collective trail ------------------------------------------------------------------

_trail_now: Optional[_trail.Trail] = None
_trail_off = False  # SHARDTRAIN_TRAIL_LENGTH=0, a world of one, or the file could not be made
_check = "off"


def trail() -> Optional[_trail.Trail]:
    """This rank's :class:`~shardtrain._trail.Trail` of collectives (None in a world of one
    or with ``SHARDTRAIN_TRAIL_LENGTH=0``); made at the first collective."""
    global _trail_now, _trail_off
    if _trail_now is not None or _trail_off:
        return _trail_now
    if not is_initialized():
        return None
    slots = int(os.environ.get(_TRAIL_LENGTH_ENV, "1024"))
    if get_world_size() == 1 or slots <= 0:
        _trail_off = True
        return None
    folder = trail_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_trails(folder)
        path = os.path.join(folder, f"rank{get_rank()}-pid{os.getpid()}.trail")
        _trail_now = _trail.Trail(slots, path)
        store = _default_store()  # its timeout stays: later groups rendezvous through it
        if store is not None:
            _failure.announce_trail(store, get_rank(), path)
    except OSError as err:  # a read-only or full temp dir: keep the trail in memory
        logger.debug("trail file: %s; the trail stays in memory", err)
        _trail_now = _trail.Trail(slots)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun (shardtrain run)
        _install_stop_handler()
    return _trail_now


def trail_dir() -> str:
    """Where the ranks of this machine keep their trail files (``rank<R>-pid<P>.trail``):
    ``$SHARDTRAIN_TRAIL_DIR``, else a folder of this user's in the temporary directory."""
    return os.environ.get(_TRAIL_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"shardtrain-trails-{os.getuid() if hasattr(os, 'getuid') else 0}")


def keep_trail(on: bool) -> None:
    """Turns this process's collective trail on (the default) or off. Off, a failed
    collective names no differing collective and the divergence check has nothing to
    compare; every rank must switch at the same point (the positions count from there)."""
    global _trail_off
    _trail_off = not on


_STALE_TRAIL_S = 24 * 3600  # a trail a dead process left is kept a day (shardtrain trails)


def _remove_stale_trails(folder: str) -> None:
    """Trail files that processes which ended without removing theirs (killed, aborted)
    left more than a day ago."""
    old = time.time() - _STALE_TRAIL_S
    for name in os.listdir(folder):
        match = re.fullmatch(r"rank\d+-pid(\d+)\.trail", name)
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if match and os.path.getmtime(path) < old and _failure.process_gone(int(match.group(1))):
                os.remove(path)


def _close_trail(remove: bool) -> None:
    global _trail_now, _trail_off
    if _trail_now is not None:
        _trail_now.close(remove=remove)
    _trail_now, _trail_off = None, False


def _own_entries() -> List[_trail.Entry]:
    return _trail_now.entries() if _trail_now is not None else []


_DTYPES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).replace("torch.", "")
    return name


def _trace(op: str, tensor: Optional[torch.Tensor], group: Optional["Group"]) -> None:
    """Writes the collective into the trail (and checks it in the per-collective mode)."""
    g = WORLD if group is None else group
    if g.solo or g.name == "side":  # the side group's calls come from other threads
        return
    t = _trail_now if _trail_now is not None else trail()
    if t is None:
        return
    ranks = g.spans()
    if "," not in ranks and "-" not in ranks:
        return  # a group of one rank
    t.record(g.name, g.pg_name(), ranks, op, 0 if tensor is None else tensor.numel(),
             "" if tensor is None else _dtype_name(tensor.dtype), _label,
             _position() if _position is not None else "")
    if _check == "collective":
        _check_group(g, f"before {op} over the {g.name} group")


# -- the divergence check ----------------------------------------------------------------

def set_check(mode: str) -> None:
    """How the ranks compare their collectives while the group works: ``"off"``; ``"step"``
    (:func:`check_agreement` at each optimizer step: one small all-gather); ``"collective"``
    (before every collective, over its group: for debugging, it doubles the collectives).
    ``$SHARDTRAIN_DIVERGENCE_CHECK`` wins over ``mode``."""
    global _check
    mode = os.environ.get(_CHECK_ENV) or mode
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check {mode!r} is not one of {', '.join(CHECK_MODES)} "
                         f"(from {_CHECK_ENV} or diagnostics.divergence_check).")
    _check = mode


def check_mode() -> str:
    return _check


_MAX_GROUPS = 16  # rows per rank in the step check: more groups than a mesh ever makes


def check_agreement(where: str = "at the end of a step") -> None:
    """Compares every rank's count and checksum of the collectives it issued over each group
    (one all-gather of a small tensor over the world); raises :class:`DivergenceError` on
    every rank, naming the first differing collective, when they disagree."""
    t = trail()
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


def _check_group(group: "Group", where: str) -> None:
    table = _gather_rows(torch.tensor(_group_fingerprint(group), dtype=torch.int64), group)
    if (table != table[0]).any():
        _raise_divergence(group, where)


def _group_fingerprint(group: "Group") -> List[int]:
    """Count and checksum of this rank's collectives over ``group``'s process group, and of
    its marks (:func:`mark`)."""
    prints = _trail_now.fingerprints() if _trail_now is not None else {}
    pg, ranks = group.pg_name(), group.spans()
    return [*prints.get((pg, ranks), (0, 0)), *prints.get((pg + _trail.ORDER, ranks), (0, 0))]


def _gather_rows(mine: torch.Tensor, group: "Group") -> torch.Tensor:
    """Every rank's ``mine`` (not traced: the check is not part of the program compared)."""
    from .. import accelerator  # local import: accelerator does not depend on comm
    dev = accelerator.device() if get_backend() == "nccl" else torch.device("cpu")
    flat = mine.to(dev).reshape(-1)
    out = torch.empty(group.size() * flat.numel(), dtype=flat.dtype, device=dev)
    _guarded("divergence check", group, flat,
             lambda: all_gather_flat(out, flat, group=_handle(group)))
    return out.view((group.size(),) + tuple(mine.shape)).cpu()


def _raise_divergence(group: "Group", where: str) -> None:
    size = get_world_size(group)
    trails: List = [None] * size
    _guarded("divergence check", group, None, lambda: dist.all_gather_object(
        trails, (get_rank(), _trail.encode(_own_entries())), group=_handle(group)))
    by_rank = {rank: _trail.decode(text) for rank, text in trails}
    diff = _trail.first_difference(by_rank, order=by_rank.get(get_rank()))
    detail = diff.explain() if diff is not None else (
        "Their counts or checksums differ, but the differing collective is older than the "
        f"trails hold (raise {_TRAIL_LENGTH_ENV}).")
    raise DivergenceError(f"rank {get_rank()}: the ranks of the {group.name} group (ranks "
                          f"{group.spans()}) issued different collectives, found by the check "
                          f"{where}:\n  " + detail.replace("\n", "\n  "))




def _forget_trail() -> None:
    # Every rank got here (destroy's barrier): no peer will need this trail. A rank that
    # ends without destroy() leaves its file for a waiting peer (and shardtrain trails).
    _close_trail(remove=not _failures)


_process.after_destroy(_forget_trail)
