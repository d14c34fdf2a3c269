"""The SIGTERM hold: a survivor blocked in a collective says what it was doing before it ends.

torchrun stops the other workers with SIGTERM as soon as one fails; a survivor blocked in a
collective with the dead one would end before saying what it was doing. While a collective
runs (or its failure is being explained: between :func:`enter` and :func:`leave`), SIGTERM
therefore waits: afterwards the report is printed and the process ends by the same signal.
Anywhere else it ends the process at once, as before. Only under torchrun, and only where
the script installed no handler of its own (:func:`install`).

No ``torch.distributed`` here: :mod:`._report` holds the signal around each collective.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional


class _Hold:
    """Whether SIGTERM waits now, and whether one came while it did."""

    def __init__(self) -> None:
        self.depth = 0         # collectives running (nested: a divergence check inside one)
        self.pending = False   # a SIGTERM came while depth > 0


_HOLD = _Hold()


def install() -> None:
    """SIGTERM waits for the running collective from now on (in the main thread, when the
    script has no handler of its own)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script's own handler stays
    signal.signal(signal.SIGTERM, _on_stop)


def enter() -> None:
    """A collective starts: SIGTERM waits until the matching :func:`leave`."""
    _HOLD.depth += 1


def leave() -> None:
    """A collective is over; the last one out ends the process if SIGTERM came meanwhile."""
    _HOLD.depth -= 1
    if not _HOLD.depth:
        end_if_stopped(None)


def end_if_stopped(report: Optional[str]) -> None:
    """Ends the process by SIGTERM if one came while it waited, after writing ``report``."""
    if _HOLD.pending:
        if report:
            sys.stderr.write(report + "\n")
            sys.stderr.flush()
        _end(signal.SIGTERM)


def _on_stop(signum, frame) -> None:
    if _HOLD.depth:
        _HOLD.pending = True
        return
    _end(signum)


def _end(signum: int) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # a collective of autograd's device thread: the handler decides in the main thread
        _HOLD.pending = False
    os.kill(os.getpid(), signum)
