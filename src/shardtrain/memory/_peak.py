"""The peak memory of a block of code: how far it raised this process's anonymous resident
memory (sampled by a thread) and the device's allocated bytes above their level at its start."""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

from .. import accelerator

__all__ = ["peak_memory", "resident_bytes"]


@contextlib.contextmanager
def peak_memory(interval: float = 0.0005) -> Iterator[Dict[str, Optional[int]]]:
    """Measures how far the block raised this process's memory above its level at the start:
    ``host``, the peak of anonymous resident memory (Linux's ``RssAnon``, sampled every
    ``interval`` seconds by a thread: file pages a read maps in are the page cache's, not the
    process's, and are not counted; None where it cannot be read), and ``device``, CUDA's peak
    of allocated bytes (0 without CUDA). The dict is filled when the block ends.

    Example:
        >>> with peak_memory() as peak:
        ...     engine.save_16bit_model("out", "model.safetensors")
        >>> peak["host"], peak["device"]
    """
    result: Dict[str, Optional[int]] = {}
    start = _anonymous()
    device_start = accelerator.memory_stats().get("allocated", 0)
    accelerator.reset_peak_memory()
    sampler = _Sampler(interval) if start is not None else None
    try:
        yield result
    finally:
        top = sampler.stop() if sampler is not None else None
        result["host"] = None if top is None else max(top - start, 0)
        result["device"] = max(accelerator.memory_stats().get("peak", device_start) - device_start, 0)


def resident_bytes() -> Optional[int]:
    """This process's anonymous resident memory now (Linux's ``RssAnon``; None elsewhere)."""
    return _anonymous()


def _anonymous() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _Sampler:
    """The largest :func:`_anonymous` seen by a thread polling it until :meth:`stop`."""

    def __init__(self, interval: float):
        import threading
        self.top, self._interval = _anonymous() or 0, interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(self._interval):
            self.top = max(self.top, _anonymous() or 0)

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.top, _anonymous() or 0)
