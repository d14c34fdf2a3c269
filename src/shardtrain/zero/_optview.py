"""What the optimizer sees in place of each trainable parameter.

The optimizer never holds a module parameter directly unless that is exact and free: for
each parameter it holds this rank's slice of it (the whole tensor at stage 0), as

* the parameter itself, when the slice is whole and the parameter is fp32;
* a view of the parameter's storage, when the slice is partial and the parameter is fp32
  (the optimizer then updates this rank's part of the module in place);
* an fp32 master copy of the slice, when the parameter is 16-bit (unless ``master_dtype`` is
  that 16-bit dtype: bf16 masters, ``bf16.bf16_master_weights_and_grads``).

A client optimizer built on ``model.parameters()`` is re-pointed at these tensors, keeping
its param groups and hyperparameters, so any ``torch.optim`` optimizer works unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from .. import accelerator
from ..layout import layout_of

Slice = Tuple[int, int]  # [lo, hi) of the parameter's flattened elements


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """What the optimizer holds of one trainable parameter on this rank.

    ``tensor`` is the optimizer's tensor for elements ``[lo, hi)`` of the flattened
    parameter (its fp32 master, a view of the parameter, or the parameter itself; None when
    this rank holds no element of it); ``numel`` is the full parameter's element count;
    ``sharded`` is False when every rank holds all of it. ``is_copy``: the optimizer updates
    a copy of the slice (an fp32 master of a 16-bit parameter, or a host copy when the
    optimizer is offloaded), not the parameter's own memory, so weights written into the
    module must be copied into it too.
    """

    param: torch.nn.Parameter
    lo: int
    hi: int
    numel: int
    tensor: Optional[torch.Tensor]
    sharded: bool
    is_copy: bool


class OptimizerView:
    """The optimizer's tensors for ``params``, one per non-empty slice.

    Args:
        params: the trainable parameters, each listed once.
        slices: this rank's ``(lo, hi)`` of each parameter's flattened elements.
        sources: where each slice's values live, when not in the parameter itself (a
            ZeRO-3 shard); None entries mean ``param.view(-1)[lo:hi]``.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], slices: Sequence[Slice],
                 sources: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 offload: bool = False, pin_memory: bool = False,
                 master_dtype: torch.dtype = torch.float32):
        self.params = list(params)
        self.slices = list(slices)
        self.offload = offload
        self.master_dtype = master_dtype
        self._pin = pin_memory and accelerator.is_cuda()
        sources = list(sources) if sources is not None else [None] * len(self.params)
        self.sources = [src if src is not None else p.data.view(-1)[lo:hi]
                        for p, (lo, hi), src in zip(self.params, self.slices, sources)]
        self.tensors: List[Optional[torch.nn.Parameter]] = [
            self._optimizer_tensor(p, src, lo, hi)
            for p, src, (lo, hi) in zip(self.params, self.sources, self.slices)]
        self._by_id = {id(p): t for p, t in zip(self.params, self.tensors)}
        # Tensors the optimizer updates in place of their source, copied back after a step.
        self.masters = [t for p, src, t in zip(self.params, self.sources, self.tensors)
                        if t is not None and not _shares(t, src)]
        self._host_grads: dict = {}

    def _optimizer_tensor(self, p: torch.nn.Parameter, src: torch.Tensor, lo: int,
                          hi: int) -> Optional[torch.nn.Parameter]:
        if hi <= lo:
            return None
        whole = lo == 0 and hi == p.numel()
        if src.dtype in (torch.float32, self.master_dtype) and not self.offload:
            if whole:
                return p
            return torch.nn.Parameter(src)  # a view: the optimizer updates the slice in place
        device = torch.device("cpu") if self.offload else src.device
        dtype = self.master_dtype if src.dtype == self.master_dtype else torch.float32
        master = torch.empty(src.shape, dtype=dtype, device=device,
                             pin_memory=self._pin and device.type == "cpu")
        master.copy_(src)
        return torch.nn.Parameter(master.view_as(p) if whole else master)

    def slots(self, sharded: bool) -> List[ParamSlot]:
        """One :class:`ParamSlot` per parameter, in ``params`` order."""
        return [ParamSlot(p, lo, hi, layout_of(p).local_numel, t, sharded,
                          t is not None and not _shares(t, src))
                for p, (lo, hi), t, src in zip(self.params, self.slices, self.tensors,
                                                self.sources)]

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-points the optimizer's groups at this rank's tensors; parameters this rank
        holds nothing of leave their group."""
        for group in optimizer.param_groups:
            group["params"] = [self._by_id.get(id(p), p) for p in group["params"]
                               if self._by_id.get(id(p), p) is not None]
            if self.offload and group.get("foreach", False) is None:
                group["foreach"] = True  # a vectorised CPU step, not a loop per parameter

    def load_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        """Attaches the reduced gradient of each slice (fp32 for masters; in host memory
        when the optimizer is offloaded); returns them."""
        out = []
        for tensor, grad in zip(self.tensors, grads):
            if tensor is None:
                continue
            if grad is None:
                tensor.grad = None
                continue
            if grad.shape != tensor.shape:  # a flat shard of a parameter held whole
                grad = grad.view(tensor.shape)
            if grad.dtype != tensor.dtype or grad.device != tensor.device:
                grad = self._to_optimizer(tensor, grad)
            tensor.grad = grad
            out.append(grad)
        if self.offload and self._pin:
            accelerator.synchronize()  # the non-blocking copies to host must have landed
        return out

    def split_flags(self, grads: Sequence[Optional[torch.Tensor]]) -> List[bool]:
        """For each gradient :meth:`load_grads` returns for ``grads``: whether its parameter
        is a tensor-parallel slice (``layout_of(p).tp``)."""
        return [_is_tensor_parallel_slice(p) for p, tensor, grad in
                zip(self.params, self.tensors, grads) if tensor is not None and grad is not None]

    def _to_optimizer(self, tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if tensor.device == grad.device:
            return grad.to(tensor.dtype)
        buffer = self._host_grads.get(id(tensor))
        if buffer is None:  # one host buffer per tensor, reused every step
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device,
                                 pin_memory=self._pin)
            self._host_grads[id(tensor)] = buffer
        buffer.copy_(grad, non_blocking=self._pin)
        return buffer

    def release_grads(self) -> None:
        """Drops the optimizer tensors' gradients; a tensor that is the module parameter
        itself keeps its ``.grad`` (the strategy manages that one)."""
        for p, tensor in zip(self.params, self.tensors):
            if tensor is not None and tensor is not p:
                tensor.grad = None

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Writes updated masters (16-bit or offloaded copies) back into their slices."""
        for src, t in zip(self.sources, self.tensors):
            if t is not None and not _shares(t, src):
                src.copy_(t.view(-1), non_blocking=self._pin)

    @torch.no_grad()
    def refresh_masters(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """Re-reads masters from the parameters (after weights were loaded into them); only
        those of ``params`` when given."""
        wanted = None if params is None else {id(p) for p in params}
        for p, src, t in zip(self.params, self.sources, self.tensors):
            if t is not None and not _shares(t, src) and (wanted is None or id(p) in wanted):
                t.view(-1).copy_(src)


def _is_tensor_parallel_slice(p: torch.nn.Parameter) -> bool:
    """A parameter each tensor-parallel rank holds a different slice of: split by AutoTP
    (``layout_of(p).tp``) or marked by Megatron-style layers."""
    return layout_of(p).tp is not None or \
        bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


def _shares(tensor: torch.Tensor, src: torch.Tensor) -> bool:
    """True when the optimizer's tensor is the slice itself (same memory)."""
    return (tensor.device == src.device and tensor.dtype == src.dtype
            and tensor.data_ptr() == src.data_ptr())


def full_slices(params: Sequence[torch.nn.Parameter]) -> List[Slice]:
    return [(0, p.numel()) for p in params]
