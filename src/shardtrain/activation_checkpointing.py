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
(for timing). ``partition_activations``, with tensor parallelism (the engine's mesh, or
``configure(mpu_=...)``), keeps 1/T of each region's saved inputs on each of the T ranks
(which all hold the same inputs) and gathers them back in backward: the region then runs
as torch's reentrant variant does, recomputed inside backward with the forward's RNG
states and autocast. ``contiguous_memory_optimization``, ``number_checkpoints`` and
``profile`` are accepted and change nothing here: the caching allocator reuses checkpoint
memory, and regions show in ``torch.profiler`` traces as ``shardtrain.checkpoint`` ranges.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from . import accelerator, comm
from .parallel.rng import RNGStatesTracker, get_rng_tracker
from .parallel.rng import model_parallel_manual_seed as _model_parallel_manual_seed

__all__ = ["checkpoint", "configure", "is_configured", "reset", "get_rng_tracker",
           "model_parallel_manual_seed", "RNGStatesTracker", "release_mpu"]


@dataclass
class _Settings:
    cpu_checkpointing: bool = False
    synchronize: bool = False
    use_reentrant: bool = False
    configured: bool = False
    mpu: Any = None  # DeepSpeed's mpu_ argument: whose model-parallel rank seeds the RNG stream
    partition: bool = False  # partition_activations: saved inputs split over the mpu's group
    group: Any = None  # the mpu's model-parallel group, as a comm.Group


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
        partition_activations: split each region's saved inputs over the model-parallel
            group of ``mpu_`` (the engine's mesh when it has tensor parallelism).
        checkpoint_in_cpu: keep saved region inputs in host memory (``cpu_checkpointing``).
        synchronize: synchronise the device at region boundaries.
        use_reentrant: torch's reentrant variant (default False, which supports keyword
            arguments and inputs that do not require grad).
    """
    if mpu_ is not None:
        _settings.mpu = mpu_
        _settings.group = _model_parallel_group(mpu_)
    if config is not None:
        _settings.partition = bool(config.partition_activations)
    if partition_activations is not None:
        _settings.partition = partition_activations
    del deepspeed_config, contiguous_checkpointing
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


def _model_parallel_group(mpu: Any) -> Optional[comm.Group]:
    """The mpu's model-parallel group: the engine's mesh's, or a caller's process group."""
    mesh = getattr(mpu, "mesh", None)
    if mesh is not None:
        return mesh.tp
    handle = mpu.get_model_parallel_group() if hasattr(mpu, "get_model_parallel_group") else None
    return comm.Group(handle, "tp") if handle is not None else None


def release_mpu(mpu: Any) -> None:
    """Forgets ``mpu`` if :func:`configure` was given it (its engine was destroyed: its
    groups must not split later regions)."""
    if mpu is not None and _settings.mpu is mpu:
        _settings.mpu = _settings.group = None


def is_configured() -> bool:
    return _settings.configured


def model_parallel_manual_seed(seed: int) -> None:
    """:func:`shardtrain.parallel.rng.model_parallel_manual_seed` with the model-parallel rank of the
    ``mpu_`` given to :func:`configure` (0 without one): DeepSpeed's
    ``model_parallel_cuda_manual_seed``."""
    mpu = _settings.mpu
    _model_parallel_manual_seed(seed, mpu.get_model_parallel_rank() if mpu is not None else 0)


def reset() -> None:
    """Back to the defaults (for tests and for reusing a process)."""
    global _settings
    _settings = _Settings()


def _rng_states() -> tuple:
    """The CPU generator's, the device generator's and the tracker's streams' states."""
    return torch.get_rng_state(), accelerator.get_rng_state(), get_rng_tracker().get_states()


def _set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    accelerator.set_rng_state(states[1])
    get_rng_tracker().set_states(states[2])


class _PartitionedRegion(torch.autograd.Function):
    """A checkpointed region whose saved inputs are split over the model-parallel group
    (``partition_activations``): every rank of the group holds the same inputs, so each keeps
    1/T of each floating tensor and backward gathers them back before recomputing. The
    recomputation runs with the RNG states (device, CPU, tracker) and autocast of the
    forward, and backward returns the inputs' whole gradients, as torch's reentrant variant."""

    @staticmethod
    def forward(ctx, function, group, on_host, *args):
        ctx.function, ctx.group, ctx.kinds = function, group, []
        ctx.rng = _rng_states()
        device = accelerator.device_type()
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        saved, size, rank = [], group.size(), group.rank()
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point() and a.numel() >= size:
                flat, per = a.detach().reshape(-1), -(-a.numel() // size)
                mine = flat[rank * per:(rank + 1) * per].clone()
                saved.append(mine.to("cpu") if on_host else mine)
                ctx.kinds.append(("part", (a.shape, a.numel(), per, a.device), a.requires_grad))
            elif torch.is_tensor(a):
                saved.append(a.detach())
                ctx.kinds.append(("tensor", None, a.requires_grad))
            else:
                ctx.kinds.append(("value", a, False))
        ctx.save_for_backward(*saved)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved, inputs = iter(ctx.saved_tensors), []
        for kind, meta, requires_grad in ctx.kinds:
            if kind == "part":
                shape, numel, per, device = meta
                mine = next(saved).to(device)
                padded = torch.zeros(per, dtype=mine.dtype, device=device)
                padded[:mine.numel()] = mine
                full = torch.empty(per * ctx.group.size(), dtype=mine.dtype, device=device)
                comm.all_gather(full, padded, group=ctx.group)
                inputs.append(full[:numel].view(shape).requires_grad_(requires_grad))
            elif kind == "tensor":
                inputs.append(next(saved).detach().requires_grad_(requires_grad))
            else:
                inputs.append(meta)
        outside = _rng_states()
        _set_rng_states(ctx.rng)
        device, enabled, dtype = ctx.autocast
        try:
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = ctx.function(*inputs)
        finally:
            _set_rng_states(outside)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[x.grad if torch.is_tensor(x) and x.requires_grad else None
                                    for x in inputs])


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
    group = _settings.group
    if _settings.partition and group is not None and group.size() > 1 and not kwargs \
            and torch.is_grad_enabled():
        with accelerator.range("shardtrain.checkpoint"):
            return _PartitionedRegion.apply(function, group, _settings.cpu_checkpointing, *args)
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
