"""Named random streams on the device, for layers split across tensor-parallel ranks
(Megatron's RNG tracker, which DeepSpeed exposes as ``deepspeed.checkpointing``'s
``get_cuda_rng_tracker`` and ``model_parallel_cuda_manual_seed``).

Dropout on activations that every tensor-parallel rank holds whole must draw the same mask on
each of them; dropout on a rank's own slice (its attention heads) should draw independent
ones. :func:`model_parallel_manual_seed` seeds the default generator alike on every rank of a
tensor-parallel group and adds a stream, ``"model-parallel-rng"``, seeded differently on each;
``with get_rng_tracker().fork():`` runs a block on that stream. The streams are the device's
generator (CUDA's, or the CPU's on a CPU run), swapped in and out.

:func:`shardtrain.activation_checkpointing.checkpoint` restores the streams' states when it
re-runs a region, so a dropout inside ``fork()`` draws the same mask in the recomputation.

Example:
    >>> from shardtrain.parallel.rng import get_rng_tracker, model_parallel_manual_seed
    >>> model_parallel_manual_seed(1234, tp_rank=engine.mpu.get_model_parallel_rank())
    >>> with get_rng_tracker().fork():
    ...     probs = torch.nn.functional.dropout(probs, 0.1)   # differs per tensor-parallel rank
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

from .. import accelerator

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_manual_seed",
           "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET"]

#: The name of the per-rank stream :func:`model_parallel_manual_seed` adds (Megatron's).
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: Added to the seed for the per-rank stream, before the tensor-parallel rank (Megatron's).
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named states of the device's generator; :meth:`fork` runs a block on one of them."""

    def __init__(self):
        self.states: Dict[str, torch.Tensor] = {}
        self.seeds: set = set()

    def reset(self) -> None:
        self.states, self.seeds = {}, set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of every stream's state (to restore later with :meth:`set_states`)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (both must be new)."""
        if seed in self.seeds:
            raise ValueError(f"RNG seed {seed} is already used by another stream; give "
                             f"{name!r} its own seed.")
        if name in self.states:
            raise ValueError(f"an RNG stream named {name!r} exists already; reset() the "
                             "tracker first, or choose another name.")
        self.seeds.add(seed)
        outside = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block on stream ``name``; the default generator's state is kept aside."""
        if name not in self.states:
            raise KeyError(f"no RNG stream named {name!r}: call model_parallel_manual_seed(seed) "
                           f"or add({name!r}, seed) first.")
        outside = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(outside)


_tracker = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's ``get_cuda_rng_tracker()``)."""
    return _tracker


def model_parallel_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """Seeds the default device generator with ``seed`` (the same on every rank that passes
    it) and, after a reset, the tracker's ``"model-parallel-rng"`` stream with
    ``seed + 2718 + tp_rank`` (different on each tensor-parallel rank)."""
    _tracker.reset()
    accelerator.manual_seed(seed)
    _tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
