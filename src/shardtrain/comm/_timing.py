"""Timing collectives: :func:`time_collectives` hands every collective with a tensor to a
:class:`CollectiveTiming` (telemetry's communication timer is one), started when it is
issued and stopped when it has completed: at once for a synchronous one, at its ``wait()``
for an asynchronous one. :mod:`._report` starts and stops it around each call."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

if TYPE_CHECKING:
    from ._groups import Group


class CollectiveTiming:
    """What times collectives (:func:`time_collectives`): :meth:`start` when one is issued
    returns a mark, :meth:`stop` when it has completed (an asynchronous one: when its
    ``wait()`` returns) gets it back."""

    def start(self, op: str) -> Optional[float]:
        """A mark for ``op`` (None: this operation is not timed)."""
        raise NotImplementedError

    def stop(self, op: str, tensor: torch.Tensor, group: Optional["Group"], mark: float) -> None:
        raise NotImplementedError


class _Timed:
    """The timing in use, and the asynchronous collectives issued but not yet waited for
    (by ``id`` of torch's handle)."""

    def __init__(self) -> None:
        self.timing: Optional[CollectiveTiming] = None
        self.pending: Dict[int, Tuple[str, torch.Tensor, Optional["Group"], float]] = {}


STATE = _Timed()


def time_collectives(timing: Optional[CollectiveTiming]) -> None:
    """Times every collective with a tensor from now on through ``timing`` (None: stop)."""
    STATE.timing = timing
    STATE.pending.clear()


def completed(handle) -> None:
    """An asynchronous collective's ``wait()`` returned: its timing stops."""
    issued = STATE.pending.pop(id(handle), None)
    if issued is not None and STATE.timing is not None:
        STATE.timing.stop(*issued)
