"""What the optimizer sees in place of each trainable parameter.

The optimizer never holds a module parameter directly unless that is exact and free: for
each parameter it holds this rank's slice of it (the whole tensor at stage 0), as

* the parameter itself, when the slice is whole and the parameter is fp32;
* a view of the parameter's storage, when the slice is partial and the parameter is fp32
  (the optimizer then updates this rank's part of the module in place);
* an fp32 master copy of the slice, when the parameter is 16-bit.

A client optimizer built on ``model.parameters()`` is re-pointed at these tensors, keeping
its param groups and hyperparameters, so any ``torch.optim`` optimizer works unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

Slice = Tuple[int, int]  # [lo, hi) of the parameter's flattened elements


class OptimizerView:
    """The optimizer's tensors for ``params``, one per non-empty slice.

    Args:
        params: the trainable parameters, each listed once.
        slices: this rank's ``(lo, hi)`` of each parameter's flattened elements.
        sources: where each slice's values live, when not in the parameter itself (a
            ZeRO-3 shard); None entries mean ``param.view(-1)[lo:hi]``.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], slices: Sequence[Slice],
                 sources: Optional[Sequence[Optional[torch.Tensor]]] = None):
        self.params = list(params)
        self.slices = list(slices)
        sources = list(sources) if sources is not None else [None] * len(self.params)
        self.sources = [src if src is not None else p.data.view(-1)[lo:hi]
                        for p, (lo, hi), src in zip(self.params, self.slices, sources)]
        self.tensors: List[Optional[torch.nn.Parameter]] = [
            _optimizer_tensor(p, src, lo, hi)
            for p, src, (lo, hi) in zip(self.params, self.sources, self.slices)]
        self._by_id = {id(p): t for p, t in zip(self.params, self.tensors)}
        self.masters = [t for p, t in zip(self.params, self.tensors)
                        if t is not None and p.dtype != torch.float32]

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-points the optimizer's groups at this rank's tensors; parameters this rank
        holds nothing of leave their group."""
        for group in optimizer.param_groups:
            group["params"] = [self._by_id.get(id(p), p) for p in group["params"]
                               if self._by_id.get(id(p), p) is not None]

    def load_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        """Attaches the reduced gradient of each slice (fp32 for masters); returns them."""
        out = []
        for tensor, grad in zip(self.tensors, grads):
            if tensor is None:
                continue
            if grad is None:
                tensor.grad = None
                continue
            if grad.shape != tensor.shape:  # a flat shard of a parameter held whole
                grad = grad.view(tensor.shape)
            tensor.grad = grad if grad.dtype == tensor.dtype else grad.to(tensor.dtype)
            out.append(tensor.grad)
        return out

    def release_grads(self) -> None:
        """Drops the optimizer tensors' gradients; a tensor that is the module parameter
        itself keeps its ``.grad`` (the strategy manages that one)."""
        for p, tensor in zip(self.params, self.tensors):
            if tensor is not None and tensor is not p:
                tensor.grad = None

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Writes updated fp32 masters into their 16-bit parameter slices."""
        for p, src, t in zip(self.params, self.sources, self.tensors):
            if t is not None and t is not p and src.dtype != torch.float32:
                src.copy_(t.view(-1))

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Re-reads fp32 masters from the parameters (after weights were loaded into them)."""
        for p, src, t in zip(self.params, self.sources, self.tensors):
            if t is not None and t is not p and src.dtype != torch.float32:
                t.view(-1).copy_(src)


def _optimizer_tensor(p: torch.nn.Parameter, src: torch.Tensor, lo: int,
                      hi: int) -> Optional[torch.nn.Parameter]:
    if hi <= lo:
        return None
    whole = lo == 0 and hi == p.numel()
    if src.dtype == torch.float32:
        if whole:
            return p
        return torch.nn.Parameter(src)  # a view: the optimizer updates the slice in place
    master = src.float().clone()
    return torch.nn.Parameter(master.view_as(p) if whole else master)


def full_slices(params: Sequence[torch.nn.Parameter]) -> List[Slice]:
    return [(0, p.numel()) for p in params]


def tensor_map(view: OptimizerView) -> Dict[int, torch.Tensor]:
    """Module parameter id -> the optimizer's tensor (for state lookups)."""
    return {id(p): t for p, t in zip(view.params, view.tensors) if t is not None}
