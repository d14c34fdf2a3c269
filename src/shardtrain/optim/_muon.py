"""Muon with an auxiliary AdamW, as DeepSpeed's ``"type": "Muon"`` block builds it.

Muon (MomentUm Orthogonalized by Newton-Schulz) updates each 2-D weight by the orthogonalised
form of its Nesterov-blended momentum; every other parameter (biases, norms, and any whose name
holds ``embed`` or ``lm_head``) takes an AdamW step. The formulas follow DeepSpeed 0.19.8:

* momentum ``m <- beta m + (1 - beta) g``; the update is the Nesterov blend
  ``u = (1 - beta) g + beta m`` (always on, as in DeepSpeed);
* ``u`` (a matrix ``rows x cols``; a higher-rank weight is viewed as ``shape[0] x rest``) is
  normalised by its Frobenius norm (``+ 1e-7``) and run through 5 quintic Newton-Schulz steps
  ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, on
  the wide orientation; the result is scaled by ``sqrt(max(1, rows / cols))``;
* ``p <- p (1 - lr wd) - lr O(u)``.

The iteration runs in fp32: DeepSpeed runs it in fp16 (``ns_method: "gram"``, the same
polynomial regrouped on the Gram matrix) or bf16 (``"standard"``) where the device has them,
which moves the update by the rounding of those types; both names are accepted and give the
same fp32 result here.

Sharded optimizers hold a slice of each flattened matrix, but Newton-Schulz needs the whole
matrix. The momentum is elementwise and stays sliced; at a step each rank blends its slices,
one all-gather over the data-parallel group (all Muon matrices packed in one buffer, each
padded to its even chunk) hands every rank the whole blended updates, and each rank
orthogonalises the matrices it holds a slice of and keeps its slice of the result. See
``docs/optimizers.md`` for the cost and why this beats sending matrices to owner ranks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

from .. import accelerator, comm
from ..layout import chunk_size, layout_of

__all__ = ["MuonWithAuxAdam", "MUON_KEYS", "uses_muon"]

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_NS_METHODS = ("gram", "standard")
_MUON_HALF_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_HALF_KEYS = ("lr", "betas", "eps", "weight_decay")
#: The keys a Muon block's ``params`` accepts (DeepSpeed 0.19.8's).
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method", "betas", "eps", "muon_lr", "adam_lr",
             "adam_w_mode", "per_head_muon")
_MUON_DEFAULTS: Dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0,
                                  "ns_method": "gram"}
_ADAM_DEFAULTS: Dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10,
                                  "weight_decay": 0.0}


def uses_muon(name: str, shape: Sequence[int]) -> bool:
    """DeepSpeed's split: a weight of two or more dimensions goes to Muon unless its name
    holds ``embed`` or ``lm_head`` (any case); everything else to the auxiliary AdamW."""
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


@dataclasses.dataclass
class _Matrix:
    """One Muon weight as this rank's optimizer holds it: elements ``[lo, hi)`` of the
    flattened ``shape`` (``tensor`` None when this rank holds none of it)."""

    tensor: Optional[torch.Tensor]
    lo: int
    hi: int
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def newton_schulz(update: torch.Tensor, steps: int = _NS_STEPS) -> torch.Tensor:
    """The orthogonalised ``update`` (2-D), scaled by ``sqrt(max(1, rows / cols))``, in fp32."""
    a, b, c = _NS_COEFFICIENTS
    x = update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.T
    rows, cols = update.shape
    return x * (math.sqrt(rows / cols) if rows > cols else 1.0)


class MuonWithAuxAdam(Optimizer):
    """Muon for the groups with ``use_muon`` true, AdamW for the others.

    Args:
        param_groups: dicts with ``params`` and ``use_muon``; a Muon group takes ``lr``,
            ``momentum``, ``weight_decay``, ``ns_method``, an AdamW group ``lr``, ``betas``,
            ``eps``, ``weight_decay`` (DeepSpeed's defaults fill what is missing).
        adam_w_mode: the AdamW groups decay decoupled (True) or add ``weight_decay * p`` to
            the gradient (False).

    Example:
        >>> import torch
        >>> w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(3))
        >>> opt = MuonWithAuxAdam([{"params": [w], "use_muon": True},
        ...                        {"params": [b], "use_muon": False}])
        >>> opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
        (0.02, 0.0003)
    """

    def __init__(self, param_groups: List[Dict[str, Any]], adam_w_mode: bool = True):
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("MuonWithAuxAdam: every param group needs 'use_muon' (True for "
                                 "the 2-D weights Muon updates, False for the AdamW ones)")
            defaults = _MUON_DEFAULTS if group["use_muon"] else _ADAM_DEFAULTS
            groups.append({**defaults, **group})
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self._matrices: Optional[List[_Matrix]] = None  # None: the whole tensors of the groups
        self._group: Any = None

    def bind(self, matrices: Sequence[Tuple[Optional[torch.Tensor], int, int, Tuple[int, ...]]],
             group: Any) -> None:
        """The optimizer holds slices: ``matrices`` lists every Muon weight of the model in the
        same order on every rank of the data-parallel ``group``, as ``(tensor, lo, hi, shape)``
        (``tensor`` this rank's slice of the flattened weight, None when it holds none)."""
        self._matrices = [_Matrix(t, lo, hi, tuple(shape)) for t, lo, hi, shape in matrices]
        self._group = group

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owners = {id(p): g for g in self.param_groups for p in g["params"]}
        self._muon_step(owners)
        for group in self.param_groups:
            if not group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._adam_update(p, group)
        return loss

    def _muon_matrices(self) -> List[_Matrix]:
        if self._matrices is not None:
            return self._matrices
        return [_Matrix(p, 0, p.numel(), tuple(p.shape)) for g in self.param_groups
                if g["use_muon"] for p in g["params"]]

    def _muon_step(self, owners: Mapping[int, Dict[str, Any]]) -> None:
        matrices = self._muon_matrices()
        # A weight without a gradient (no rank used it) is left alone, as AdamW leaves it; its
        # place in the gather stays (zeros), so every rank issues the same collective.
        stepped = [m.tensor is not None and m.tensor.grad is not None for m in matrices]
        blended = [self._blend(m.tensor, owners[id(m.tensor)]) if go else None
                   for m, go in zip(matrices, stepped)]
        wholes = self._whole_updates(matrices, blended)
        for m, whole, go in zip(matrices, wholes, stepped):
            if not go:
                continue
            group = owners[id(m.tensor)]
            ortho = newton_schulz(whole.view(m.shape[0], -1)).reshape(-1)[m.lo:m.hi]
            m.tensor.mul_(1 - group["lr"] * group["weight_decay"])
            m.tensor.add_(ortho.view_as(m.tensor).to(m.tensor.dtype), alpha=-group["lr"])

    def _blend(self, p: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
        """Advances the (elementwise) momentum; returns the Nesterov blend, in fp32."""
        grad = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, beta = state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad.to(buf.dtype), 1 - beta)
        return grad.float().lerp(buf.float(), beta)

    def _whole_updates(self, matrices: List[_Matrix],
                       blended: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Each matrix's whole blended update (flat): gathered over the data-parallel group
        when the optimizer holds slices."""
        if self._group is None or self._group.size() == 1:
            return [None if u is None else u.reshape(-1) for u in blended]
        world = self._group.size()
        chunks = [chunk_size(m.numel, world) for m in matrices]
        send = torch.zeros(sum(chunks), dtype=torch.float32, device=_device(blended))
        offset = 0
        for u, c in zip(blended, chunks):
            if u is not None:
                send[offset:offset + u.numel()].copy_(u.reshape(-1))
            offset += c
        flat = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        comm.all_gather(flat, send, group=self._group)
        rows = flat.view(world, send.numel())
        out, offset = [], 0
        for m, c in zip(matrices, chunks):
            out.append(rows[:, offset:offset + c].reshape(-1)[:m.numel])
            offset += c
        return out

    def _adam_update(self, p: torch.Tensor, group: Mapping[str, Any]) -> None:
        grad = p.grad
        if not self.adam_w_mode and group["weight_decay"]:
            grad = grad.add(p, alpha=group["weight_decay"])
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        (beta1, beta2), eps = group["betas"], group["eps"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(eps)
        if self.adam_w_mode:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


def _device(tensors: Sequence[Optional[torch.Tensor]]) -> torch.device:
    for t in tensors:
        if t is not None:
            return t.device
    return accelerator.device()


def split_param_groups(params: List[Any], names: Mapping[int, str],
                       settings: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Each incoming group split into its Muon and AdamW halves, as DeepSpeed does: the
    config's shared values, then ``muon_lr``/``adam_lr``, then the group's own keys."""
    groups = [dict(g) for g in params] if params and isinstance(params[0], Mapping) \
        else [{"params": params}]
    halves = ((True, _MUON_HALF_KEYS, "muon_lr"), (False, _ADAM_HALF_KEYS, "adam_lr"))
    out = []
    for group in groups:
        trainable = [p for p in group["params"] if p.requires_grad]
        for flag, keys, lr_key in halves:
            half = [p for p in trainable if _flag(p, names) is flag]
            if not half:
                continue
            values = {k: settings[k] for k in keys if k in settings}
            if lr_key in settings:
                values["lr"] = settings[lr_key]
            values.update({k: v for k, v in group.items() if k in keys})
            out.append({"params": half, "use_muon": flag, **values})
    return out


def _flag(p: torch.Tensor, names: Mapping[int, str]) -> bool:
    tagged = getattr(p, "use_muon", None)
    if tagged is not None and id(p) not in names:
        return bool(tagged)
    return uses_muon(names.get(id(p), ""), layout_of(p).local_shape)
