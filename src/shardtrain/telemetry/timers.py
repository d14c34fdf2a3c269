"""Wall-clock timers for the parts of a step (``wall_clock_breakdown``).

A timer synchronises the device when it starts and stops, so that kernels launched
asynchronously count in the part of the step that launched them. That costs throughput, which
is why the engine's watch builds timers only when timing is asked for.

Example:
    >>> timers = Timers()
    >>> with timers.time("forward"):
    ...     loss = model(x)
    >>> timers.read()          # {"forward": 12.5} in milliseconds, then reset
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator

from .. import accelerator

__all__ = ["Timers"]


class Timers:
    """Named wall-clock timers whose times add up until they are read.

    Each start and stop synchronises the device, so that kernels launched asynchronously
    count in the part of the step that launched them. That costs throughput: build timers
    only when timing is asked for (``wall_clock_breakdown``).

    Args:
        synchronize: waits for the device; default :func:`shardtrain.accelerator.synchronize`.

    Example:
        >>> timers = Timers()
        >>> with timers.time("forward"):
        ...     loss = model(x)
        >>> timers.read()          # {"forward": 12.5} in milliseconds, then reset
    """

    def __init__(self, synchronize: Callable[[], None] = accelerator.synchronize):
        self._sync = synchronize
        self._started: Dict[str, float] = {}
        self._total: Dict[str, float] = {}

    def start(self, name: str) -> None:
        """Starts ``name``; does nothing if it runs already."""
        if name not in self._started:
            self._sync()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        """Stops ``name`` and adds the time since its start; does nothing if it is not running."""
        began = self._started.pop(name, None)
        if began is not None:
            self._sync()
            self._total[name] = self._total.get(name, 0.0) + time.perf_counter() - began

    def running(self, name: str) -> bool:
        return name in self._started

    def add(self, name: str, seconds: float) -> None:
        """Adds a time measured elsewhere."""
        self._total[name] = self._total.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def read(self, reset: bool = True) -> Dict[str, float]:
        """Accumulated milliseconds per name (running timers are not included)."""
        out = {name: seconds * 1000.0 for name, seconds in self._total.items()}
        if reset:
            self._total.clear()
        return out
