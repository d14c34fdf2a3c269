"""``disable_python_gc``: Python's cyclic garbage collector stays off while an engine that asks
for it lives, as DeepSpeed's key does (a collection pass over a large heap of tensors and
modules can stall a step for tens of milliseconds at an unpredictable point).

Engines hold a lease: the first one turns the collector off, the last one to go (``destroy``)
turns it back on if it was on before. Reference counting still frees everything without
cycles; ``engine.collect_python_gc()`` runs one collection where the training loop chooses
(between steps, after evaluation).
"""
from __future__ import annotations

import gc
import threading

__all__ = ["acquire", "release", "collect"]

_lock = threading.Lock()
_holders = 0
_was_enabled = False


def acquire() -> None:
    """Takes a lease: the collector is off until every lease is released."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1


def release() -> None:
    """Returns a lease; the last one turns the collector back on if it was on before."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _was_enabled:
            gc.enable()


def collect() -> int:
    """One full collection now; the number of unreachable objects found."""
    return gc.collect()
