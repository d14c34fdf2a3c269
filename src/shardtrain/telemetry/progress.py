"""A progress bar for the training loop: tqdm with loss, throughput and ETA.

Only rank 0 draws, and only on a terminal; elsewhere (a log file, CI) it can print a plain line
every few steps instead. Reading the engine's loss waits for the device, so the bar asks the
engine's watch for its numbers only when something is about to be shown.

Example:
    >>> with shardtrain.telemetry.Progress(total=300, engine=engine) as bar:
    ...     for step in range(300):
    ...         ...                    # forward, engine.backward(loss), engine.step()
    ...         bar.update()           # loss and throughput come from the engine
"""
from __future__ import annotations

import sys
import time
from typing import Any, Optional

from .. import comm
from ..state import EngineFace

__all__ = ["Progress"]


class Progress:
    """A tqdm bar with loss, throughput and ETA, drawn by rank 0 only.

    Other ranks, and rank 0 when stderr is not a terminal (a log file, CI), draw nothing;
    there a plain line can be printed every ``every`` steps instead.

    Args:
        total: the number of steps.
        desc: a short label.
        enabled: force the bar on or off; default: rank 0 on a terminal.
        every: with no bar, rank 0 prints a line every this many steps (0: never).
        engine: take loss, learning rate and throughput from this engine when
            :meth:`update` is given no metrics (the loss of ``engine.backward(loss)``).

    Example:
        >>> with Progress(total=steps, engine=engine) as bar:
        ...     ...; engine.step(); bar.update()
    """

    def __init__(self, total: int, desc: str = "train", enabled: Optional[bool] = None,
                 every: int = 0, engine: Optional[EngineFace] = None):
        self.total, self.desc, self.every, self.engine = total, desc, every, engine
        self.rank0 = comm.get_rank() == 0
        tty = sys.stderr.isatty()
        self.enabled = self.rank0 and (tty if enabled is None else enabled)
        self.count = 0
        self._start = time.perf_counter()
        self._shown = 0.0
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **metrics: float) -> None:
        """Advances by ``n`` steps and shows ``metrics`` (or the engine's, when none are given)."""
        self.count += n
        line_due = (not self._bar and self.rank0 and self.every
                    and (self.count % self.every == 0 or self.count == self.total))
        # Reading the engine's loss waits for the device: do it only when something is shown.
        now = time.perf_counter()
        if not metrics and self.engine is not None and (line_due or (self._bar and now - self._shown > 0.5)):
            metrics = self.engine.monitor.summary()
            self._shown = now
        text = {k: _fmt(v) for k, v in metrics.items()}
        if self._bar is not None:
            if text:
                self._bar.set_postfix(text, refresh=False)
            self._bar.update(n)
        elif line_due:
            elapsed = now - self._start
            eta = elapsed / self.count * (self.total - self.count)
            fields = " ".join(f"{k}={v}" for k, v in text.items())
            print(f"{self.desc} {self.count}/{self.total} {fields} eta={eta:.0f}s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)
