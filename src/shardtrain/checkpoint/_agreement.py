"""Errors every rank agrees on.

A save or a load is a few phases, each ended by a collective. A rank that fails inside a phase
must still reach that collective, or every other rank would wait in it for ever; so a phase
runs under :func:`capture`, which keeps the failure instead of raising it, and ends in
:func:`agree`, which gathers every rank's outcome and raises the first failure on every rank,
naming the rank that found it. A save writes no file before every rank has staged (and so
checked) its part; a load changes nothing in the engine before every rank has read and
checked what it will apply.

A failure travels between ranks as a :class:`Problem`: the name of an exception type and a
message. Without a process group (consolidation), :func:`as_plain_errors` raises it as the
plain exception it stands for.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, TypeVar

from safetensors import SafetensorError

from .. import comm
from ..log import logger

__all__ = ["ERRORS", "Problem", "problem_of", "capture", "agree", "as_plain_errors",
           "corrupted", "missing"]

T = TypeVar("T")

ERRORS: Dict[str, type] = {
    "ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
    "FileNotFoundError": FileNotFoundError, "NotImplementedError": NotImplementedError,
    "OSError": OSError, "RuntimeError": RuntimeError}


class Problem(Exception):
    """A failure found by one rank; :func:`agree` raises it on every rank."""

    def __init__(self, kind: type, message: str):
        super().__init__(message)
        self.kind, self.message = kind.__name__, message


def problem_of(error: Exception) -> Problem:
    """The :class:`Problem` an exception stands for: its type when it is one of
    :data:`ERRORS`, else OSError or RuntimeError with the type's name in the message."""
    if isinstance(error, Problem):
        return error
    if isinstance(error, SafetensorError):
        return Problem(ValueError, f"safetensors: {error}")
    if isinstance(error, KeyError) and error.args:
        return Problem(KeyError, str(error.args[0]))  # str(KeyError) would add quotes
    for kind in ERRORS.values():  # the most specific known type (FileNotFoundError first)
        if type(error) is kind:
            return Problem(kind, str(error))
    kind = OSError if isinstance(error, OSError) else RuntimeError
    return Problem(kind, f"{type(error).__name__}: {error}")


@contextlib.contextmanager
def capture(box: List[Optional[Problem]]) -> Iterator[None]:
    """Stores a phase's failure in ``box`` instead of raising it, so that the rank still
    joins the collective (:func:`agree`) where every rank learns of it. Any exception is
    caught: one that escaped on one rank would leave the others waiting in that collective."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised on every rank by agree
        if not isinstance(error, (Problem, SafetensorError, OSError, ValueError, TypeError,
                                  KeyError, NotImplementedError)):
            logger.error("checkpoint: unexpected failure on rank %d", comm.get_rank(),
                         exc_info=True)
        box[0] = problem_of(error)


def agree(problem: Optional[Problem], payload: Any = None,
          group: Optional[comm.SideGroup] = None) -> List[Any]:
    """Gathers every rank's outcome of a phase; raises the first rank's problem on all ranks.

    Every phase of a save or load ends here: a rank that fails still joins this collective,
    so no rank is left waiting in a collective the failing one never reaches.
    """
    sent = (problem.kind, problem.message) if problem is not None else None
    gathered = comm.all_gather_object((sent, payload), group)
    failures = [(rank, err) for rank, (err, _) in enumerate(gathered) if err is not None]
    if failures:
        rank, (kind, message) = failures[0]
        others = f" (and {len(failures) - 1} more rank(s) failed)" if len(failures) > 1 else ""
        where = f" [rank {rank}]" if len(gathered) > 1 else ""
        raise ERRORS.get(kind, OSError)(f"{message}{where}{others}")
    return [p for _, p in gathered]


def as_plain_errors(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a single process: a :class:`Problem` is raised as its plain type."""
    try:
        return fn(*args)
    except Problem as problem:
        raise ERRORS[problem.kind](problem.message) from None


def corrupted(path: str, why: str) -> Problem:
    return Problem(ValueError, f"{path} is truncated or corrupted ({why}); re-save it or load "
                               "another tag.")


def missing(path: str) -> Problem:
    return Problem(FileNotFoundError, f"{path} is missing: the checkpoint is incomplete; "
                                      "re-save it or load another tag.")
