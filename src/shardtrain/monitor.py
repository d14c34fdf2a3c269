"""What a person watches while training runs: a progress bar, quiet where it should be.

Example:
    >>> with shardtrain.monitor.Progress(total=300, desc="train") as bar:
    ...     for step in range(300):
    ...         bar.update(loss=2.1, tokens_per_s=5400.0)
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from . import comm

__all__ = ["Progress"]


class Progress:
    """A tqdm bar with loss, throughput and ETA, drawn by rank 0 only.

    When the output is not a terminal (a log file, CI) the bar is replaced by a plain line
    every ``every`` steps, so logs stay readable.

    Args:
        total: the number of steps.
        desc: a short label.
        enabled: force the bar on or off; default: rank 0 on a terminal.
        every: with no terminal, print a line every this many steps (0: never).
    """

    def __init__(self, total: int, desc: str = "train", enabled: Optional[bool] = None,
                 every: int = 50):
        self.total, self.desc, self.every = total, desc, every
        self.rank0 = comm.get_rank() == 0
        tty = sys.stderr.isatty()
        self.enabled = self.rank0 and (tty if enabled is None else enabled)
        self.count = 0
        self._start = time.perf_counter()
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **metrics: float) -> None:
        self.count += n
        text = {k: _fmt(v) for k, v in metrics.items()}
        if self._bar is not None:
            self._bar.set_postfix(text, refresh=False)
            self._bar.update(n)
        elif self.rank0 and self.every and (self.count % self.every == 0
                                             or self.count == self.total):
            elapsed = time.perf_counter() - self._start
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


def _fmt(value: float) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)
