"""Activation checkpointing: recompute a region's activations in backward instead of
keeping them, built on ``torch.utils.checkpoint``.

The engine configures it from the config's ``activation_checkpointing`` block; call
:func:`configure` yourself to use it without an engine.

``shardtrain.checkpointing``, DeepSpeed's name (``deepspeed.checkpointing``), is this very
module: both names give the same functions and the same settings. This one says what it is
about, apart from the training checkpoints of :mod:`shardtrain.checkpoint`.

Example:
    >>> from shardtrain.activation_checkpointing import checkpoint
    >>> for block in self.blocks:
    ...     x = checkpoint(block, x)     # works at every ZeRO stage

Config keys: ``cpu_checkpointing`` keeps the region's saved inputs in host memory until
backward; ``synchronize_checkpoint_boundary`` synchronises the device around each region
(for timing). ``partition_activations`` (which shards saved inputs across tensor-parallel
ranks), ``contiguous_memory_optimization``, ``number_checkpoints`` and ``profile`` are
accepted and change nothing here: saved inputs stay whole on each tensor-parallel rank, the
caching allocator reuses checkpoint memory, and regions show in ``torch.profiler`` traces as
``shardtrain.checkpoint`` ranges.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from . import accelerator
from .rng import RNGStatesTracker, get_rng_tracker
from .rng import model_parallel_manual_seed as _model_parallel_manual_seed

__all__ = ["checkpoint", "configure", "is_configured", "reset", "get_rng_tracker",
           "model_parallel_manual_seed", "RNGStatesTracker"]


@dataclass
class _Settings:
    cpu_checkpointing: bool = False
    synchronize: bool = False
    use_reentrant: bool = False
    configured: bool = False
    mpu: Any = None  # DeepSpeed's mpu_ argument: whose model-parallel rank seeds the RNG stream


_settings = _Settings()


def configure(mpu_=None, deepspeed_config=None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None,
              num_checkpoints: Optional[int] = None, checkpoint_in_cpu: Optional[bool] = None,
              synchronize: Optional[bool] = None, profile: Optional[bool] = None,
              config=None, use_reentrant: Optional[bool] = None) -> None:
    """Sets how :func:`checkpoint` behaves (DeepSpeed's argument names).

    Args:
        mpu_: a model-parallel unit (``engine.mpu``, or Megatron's): its model-parallel rank
            seeds the per-rank stream of :func:`model_parallel_manual_seed`.
        config: an ``ActivationCheckpointingConfig`` (the engine passes its own).
        checkpoint_in_cpu: keep saved region inputs in host memory (``cpu_checkpointing``).
        synchronize: synchronise the device at region boundaries.
        use_reentrant: torch's reentrant variant (default False, which supports keyword
            arguments and inputs that do not require grad).
    """
    if mpu_ is not None:
        _settings.mpu = mpu_
    del deepspeed_config, partition_activations, contiguous_checkpointing
    del num_checkpoints, profile
    if config is not None:
        _settings.cpu_checkpointing = bool(config.cpu_checkpointing)
        _settings.synchronize = bool(config.synchronize_checkpoint_boundary)
    if checkpoint_in_cpu is not None:
        _settings.cpu_checkpointing = checkpoint_in_cpu
    if synchronize is not None:
        _settings.synchronize = synchronize
    if use_reentrant is not None:
        _settings.use_reentrant = use_reentrant
    _settings.configured = True


def is_configured() -> bool:
    return _settings.configured


def model_parallel_manual_seed(seed: int) -> None:
    """:func:`shardtrain.rng.model_parallel_manual_seed` with the model-parallel rank of the
    ``mpu_`` given to :func:`configure` (0 without one): DeepSpeed's
    ``model_parallel_cuda_manual_seed``."""
    mpu = _settings.mpu
    _model_parallel_manual_seed(seed, mpu.get_model_parallel_rank() if mpu is not None else 0)


def reset() -> None:
    """Back to the defaults (for tests and for reusing a process)."""
    global _settings
    _settings = _Settings()


def _with_tracker_states(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, whose second run (the recomputation) starts from the RNG tracker's
    states of its first; the tracker's states outside are kept."""
    first: list = []

    def run(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.append(get_rng_tracker().get_states())
            return function(*args, **kwargs)
        outside = get_rng_tracker().get_states()
        get_rng_tracker().set_states(first[0])
        try:
            return function(*args, **kwargs)
        finally:
            get_rng_tracker().set_states(outside)
    return run


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``function(*args, **kwargs)`` without keeping its activations; backward
    re-runs it. The result equals the plain call's, gradients included.

    Args:
        function: a module or function.
        *args, **kwargs: its inputs; ``use_reentrant=`` overrides the configured variant.
    """
    use_reentrant = kwargs.pop("use_reentrant", _settings.use_reentrant)
    host = (torch.autograd.graph.save_on_cpu(pin_memory=accelerator.is_cuda())
            if _settings.cpu_checkpointing else contextlib.nullcontext())
    if _settings.synchronize:
        accelerator.synchronize()
    if get_rng_tracker().states:  # the recomputation draws what the forward drew
        function = _with_tracker_states(function)
    with accelerator.range("shardtrain.checkpoint"), host:
        out = _torch_checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
    if _settings.synchronize:
        accelerator.synchronize()
    return out
