"""How long a collective may wait, as training goes.

Inside training steps, once the first step has completed, a collective gets the short bound
(``diagnostics.collective_timeout``, 5 minutes by default): a rank that died or hangs is
reported within it. The first step (compilation, warm-up, a slow rank's first batch) and
everything outside training steps (checkpoint I/O, evaluation, a rank that saves while the
others wait) keep the long one: the process group's own timeout, or
``diagnostics.slow_collective_timeout``. ``$SHARDTRAIN_COLLECTIVE_TIMEOUT`` sets both.
"""
from __future__ import annotations

from typing import Any

from ._groups import set_timeout
from ._process import default_timeout, timeout_override


class CollectiveBounds:
    """Sets the process groups' timeout as the engine enters and leaves training steps.

    Args:
        diagnostics: the config's ``diagnostics`` block.
    """

    def __init__(self, diagnostics: Any):
        forced = timeout_override()
        self.slow = forced or diagnostics.slow_collective_timeout or default_timeout()
        self.steady = min(forced or diagnostics.collective_timeout, self.slow)
        self._stepped = False  # a first optimizer step has completed
        self._inside = False   # between a forward and the end of its optimizer step
        if diagnostics.slow_collective_timeout is not None:
            set_timeout(self.slow)

    def enter_step(self) -> None:
        """A forward begins: the short bound, once a first step has completed."""
        if self._stepped and not self._inside and self.steady < self.slow:
            set_timeout(self.steady)
        self._inside = True

    def leave_step(self) -> None:
        """An optimizer step has completed: the long bound until the next forward."""
        if self._inside and self._stepped and self.steady < self.slow:
            set_timeout(self.slow)
        self._inside, self._stepped = False, True
