"""Memory per rank for the step records: on CUDA the allocator's counters; on the CPU, which
has none, the model-state bytes plus the largest saved-activation bytes of the step
(:mod:`.activation`). A model-info profile measures every forward on CUDA too."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

from .. import accelerator
from .activation import ActivationMemory, SavedTensorMeter


class MemoryProbe:
    """Memory per rank: on CUDA the allocator's counters; on the CPU the model-state bytes
    plus the largest micro-batch's saved-activation bytes of the step. With ``per_forward``
    (a model-info profile) each forward is measured on CUDA too, into ``last_forward``."""

    def __init__(self, engine: Any, per_forward: bool):
        self.engine = engine
        self.cuda = accelerator.is_cuda()
        self.per_forward = per_forward
        self.last_forward: Optional[ActivationMemory] = None
        self.activation = 0
        self._states = 0
        self._states_step = -1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if self.cuda and not self.per_forward:
            yield
            return
        if self.cuda:  # a profile: the allocator's rise during the forward is the measure
            accelerator.synchronize()
            base = accelerator.memory_stats()["allocated"]
            accelerator.reset_peak_memory()
        with SavedTensorMeter(self.engine.module) as meter:
            yield
        if self.cuda:
            accelerator.synchronize()
            rise = max(0, accelerator.memory_stats()["peak"] - base)
            self.last_forward = ActivationMemory(rise, meter.bytes, "cuda_peak")
            return
        self.activation = max(self.activation, meter.bytes)
        self.last_forward = ActivationMemory(meter.bytes, meter.bytes, "saved_tensors")

    def read(self) -> Tuple[int, int]:
        """(allocated, peak) bytes of this rank for the step just finished; starts a new step."""
        if self.cuda:
            stats = accelerator.memory_stats()
            accelerator.reset_peak_memory()
            return stats["allocated"], stats["peak"]
        step = self.engine.global_steps
        # Model states stop changing after the first steps (optimizer states are created
        # lazily), so they are counted again only now and then.
        if self._states_step < 0 or step <= 2 or step - self._states_step >= 100:
            self._states, self._states_step = self.engine.model_state_bytes()["total"], step
        peak, self.activation = self._states + self.activation, 0
        return self._states, peak
