"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
activation checkpointing, as :mod:`shardtrain.activation_checkpointing` provides it, and the
model-parallel RNG streams of :mod:`shardtrain.parallel.rng` under DeepSpeed's names."""
from ....activation_checkpointing import (RNGStatesTracker, checkpoint, configure,
                                          get_rng_tracker, is_configured,
                                          model_parallel_manual_seed, reset)

#: DeepSpeed's names (the streams are the device's generator: CUDA's, or the CPU's).
CudaRNGStatesTracker = RNGStatesTracker
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed

__all__ = ["checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker"]
