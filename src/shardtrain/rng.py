"""The names ``shardtrain.rng`` has always offered, kept for existing code: the model-parallel
random streams (Megatron's RNG tracker) now live in :mod:`shardtrain.parallel.rng`, beside the
tensor-parallel layers whose dropout they serve. New code imports from there.

Example:
    >>> from shardtrain.rng import get_rng_tracker            # as before
    >>> from shardtrain.parallel.rng import get_rng_tracker   # the same object
"""
from .parallel.rng import (MODEL_PARALLEL_RNG, MODEL_PARALLEL_SEED_OFFSET, RNGStatesTracker,
                           get_rng_tracker, model_parallel_manual_seed)

__all__ = ["RNGStatesTracker", "get_rng_tracker", "model_parallel_manual_seed",
           "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET"]
