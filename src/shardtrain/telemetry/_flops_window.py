"""The FLOPs profile of one optimizer step: a :class:`~.flops.FlopsProfiler` over the
micro-steps of one chosen step, then never again, because counting slows every operation.
Its FLOPs per step, over measured step times, give the MFU of the step records."""
from __future__ import annotations

from typing import Optional

import torch

from .flops import FlopsProfile, FlopsProfiler


class FlopsWindow:
    """Runs a :class:`FlopsProfiler` over the micro-steps of one optimizer step."""

    def __init__(self, module: torch.nn.Module, step: int):
        self.module, self.step = module, step
        self.profiler: Optional[FlopsProfiler] = None
        self.done = False

    def forward_begin(self, global_steps: int) -> None:
        if self.done or global_steps != self.step:
            return
        if self.profiler is None:
            self.profiler = FlopsProfiler(self.module)
            self.profiler.start()
        self.profiler.forward_begin()

    def forward_end(self) -> None:
        if self.profiler is not None and not self.done:
            self.profiler.forward_end()

    def finish(self) -> Optional[FlopsProfile]:
        """The profile, once the profiled step is over (else None)."""
        if self.profiler is None or self.done:
            return None
        self.profiler.stop()
        self.done = True
        return self.profiler.result()
