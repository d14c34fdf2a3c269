"""Memory per rank for the step records: on CUDA the allocator's counters; on the CPU, which
has none, the model-state bytes plus the largest saved-activation bytes of the step
(:mod:`.activation`). A model-info profile measures every forward on CUDA too.

Under a memory budget (``SHARDTRAIN_MEMORY_BUDGET``) the CPU, which would swap rather than
fail, is held to it from the same measures: a forward whose model states plus saved
activations exceed the budget raises :class:`~shardtrain.autotune.OutOfMemoryError` there,
and so does a step whose new optimizer states push the sum over it. On CUDA the allocator
is capped instead (:func:`shardtrain.accelerator.limit_memory`) and fails by itself."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

from .. import accelerator
from ..memory import format_bytes
from ..autotune.budget import MEMORY_BUDGET_ENV, OutOfMemoryError
from .activation import ActivationMemory, SavedTensorMeter
from ..state import EngineFace


class MemoryProbe:
    """Memory per rank: on CUDA the allocator's counters; on the CPU the model-state bytes
    plus the largest micro-batch's saved-activation bytes of the step. With ``per_forward``
    (a model-info profile) each forward is measured on CUDA too, into ``last_forward``. With
    a ``budget`` (bytes) the CPU's measures are held to it after each forward and step."""

    def __init__(self, engine: EngineFace, per_forward: bool, budget: Optional[int] = None):
        self.engine = engine
        self.cuda = accelerator.is_cuda()
        self.per_forward = per_forward
        self.budget = None if self.cuda else budget
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
        self._hold_to_budget(meter.bytes, "the saved activations of this micro-batch")

    def read(self) -> Tuple[int, int]:
        """(allocated, peak) bytes of this rank for the step just finished; starts a new step."""
        if self.cuda:
            stats = accelerator.memory_stats()
            accelerator.reset_peak_memory()
            return stats["allocated"], stats["peak"]
        activation, self.activation = self.activation, 0
        states = self._model_states()
        self._hold_to_budget(activation, "the largest saved activations of the step")
        return states, states + activation

    def _model_states(self) -> int:
        step = self.engine.global_steps
        # Model states stop changing after the first steps (optimizer states are created
        # lazily), so they are counted again only now and then.
        if self._states_step < 0 or step <= 2 or step - self._states_step >= 100:
            self._states, self._states_step = self.engine.model_state_bytes()["total"], step
        return self._states

    def _hold_to_budget(self, activation: int, what: str) -> None:
        if self.budget is None:
            return
        states = self._model_states()
        if states + activation > self.budget:
            raise OutOfMemoryError(
                f"this rank's model states ({format_bytes(states)}) plus {what} "
                f"({format_bytes(activation)}) need {states + activation:,} bytes, above the memory "
                f"budget {MEMORY_BUDGET_ENV}={self.budget:,}")
