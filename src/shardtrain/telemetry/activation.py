"""Activation memory: what one micro-batch keeps alive for backward.

On CUDA the measure is the allocator's peak rise during the forward: activations plus the
forward's temporaries, which is what a larger batch really costs. On the CPU there is no
allocator to ask, so :class:`SavedTensorMeter` adds up the bytes of the tensors autograd saves
(each storage once, parameters and buffers left out): the same quantity without the
temporaries, which lets the autotuner and its tests run without a GPU.

Example:
    >>> out, mem = measure_activation_memory(lambda: model(x), model)
    >>> out.sum().backward(); mem.bytes, mem.method
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import accelerator

__all__ = ["SavedTensorMeter", "ActivationMemory", "measure_activation_memory"]


class SavedTensorMeter:
    """Counts the bytes of the tensors autograd saves for backward while it is active.

    Those tensors are a forward pass's activation memory: they stay alive until backward
    frees them. Each storage counts once (a layer's output that the next layer saves as its
    input is one tensor), and only the bytes the saved views cover (a batch sliced from a
    large tensor costs its slice). Parameters and buffers of ``module`` are left out: they are
    model states and alive anyway. Tensors saved inside a checkpointed region are not seen,
    since the checkpoint does not keep them.

    Args:
        module: the model whose parameters and buffers are not activations (optional).

    Example:
        >>> with SavedTensorMeter(model) as meter:
        ...     out = model(x)
        >>> meter.bytes
    """

    def __init__(self, module: Optional[torch.nn.Module] = None):
        self.module = module
        self.bytes = 0
        self._spans: Dict[int, List[Tuple[int, int]]] = {}
        self._excluded: set = set()
        self._hooks: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "SavedTensorMeter":
        self._spans = {}
        self._excluded = set()
        if self.module is not None:
            tensors = list(self.module.parameters()) + list(self.module.buffers())
            self._excluded = {t.untyped_storage().data_ptr() for t in tensors}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.bytes = sum(_covered(spans) for spans in self._spans.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # A parameter (or a view of one, like the transposed weight a Linear saves) is a
        # model state. At ZeRO-3 its storage moves at every gather, hence the type test.
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        if t.is_sparse or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # a tensor being traced by torch.compile has no memory to count
            return t
        if ptr == 0 or ptr in self._excluded:
            return t
        start = t.storage_offset() * t.element_size()
        extent = 0
        if t.numel():
            extent = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        self._spans.setdefault(ptr, []).append((start, min(start + extent, storage.nbytes())))
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _covered(spans: List[Tuple[int, int]]) -> int:
    """Bytes in the union of [start, end) intervals."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """What one forward pass keeps for backward.

    Attributes:
        bytes: the measure: the allocator's peak rise during the forward on CUDA (activations
            plus the forward's temporaries), the saved-tensor bytes on the CPU.
        saved_bytes: the saved-tensor bytes (measured on both devices).
        method: ``"cuda_peak"`` or ``"saved_tensors"``.
    """

    bytes: int
    saved_bytes: int
    method: str


def measure_activation_memory(forward: Callable[[], Any],
                              module: Optional[torch.nn.Module] = None
                              ) -> Tuple[Any, ActivationMemory]:
    """Runs ``forward()`` and measures the activation memory it leaves for backward.

    Args:
        forward: runs one forward pass (of one micro-batch) and returns its output.
        module: the model, whose parameters and buffers are not activations.

    Returns:
        ``(output of forward(), ActivationMemory)``; run backward on the output as usual.

    Example:
        >>> out, mem = measure_activation_memory(lambda: model(x), model)
        >>> out.sum().backward(); mem.bytes
    """
    cuda = accelerator.is_cuda()
    if cuda:
        accelerator.synchronize()
        base = accelerator.memory_stats()["allocated"]
        accelerator.reset_peak_memory()
    with SavedTensorMeter(module) as meter:
        output = forward()
    if cuda:
        accelerator.synchronize()
        rise = max(0, accelerator.memory_stats()["peak"] - base)
        return output, ActivationMemory(rise, meter.bytes, "cuda_peak")
    return output, ActivationMemory(meter.bytes, meter.bytes, "saved_tensors")
