"""``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*``: whole tensors of a parameter
whose fp32 master, gradient and optimizer states are sharded across ranks.

Each full value is assembled from every rank's slice (a collective: call it on every rank,
for the same parameters in the same order); the ``*_local_*`` variants return or set this
rank's slice only (1-D; empty where the rank holds nothing of the parameter). Between the
backward of an accumulation boundary and ``engine.step()`` a gradient is the averaged one the
optimizer will see, unscaled (without the fp16 loss scale). Before the boundary and inside
``no_sync()``, at ZeRO stages 0-1, it is this rank's gradient accumulated so far, as
DeepSpeed's ``param.grad`` is then (no collective: the ranks' values differ); stages 2-3 keep
none and raise, as DeepSpeed's stage 2 does. A parameter no engine trains gives None, as in
DeepSpeed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import Engine, comm
from ...layout import layout_of
from ...zero.values import is_partitioned

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]


def _slot(param):
    """(engine, slot) for a trained parameter, else (None, None)."""
    engine = Engine.of_parameter(param)
    if engine is None:
        return None, None
    return engine, engine.optimizer_slot(param)


def _local(engine: Engine, slot, kind: str, key: Optional[str] = None) -> torch.Tensor:
    """This rank's slice (1-D fp32) of the fp32 value, the gradient or a state ``key``."""
    if slot.tensor is None:
        return torch.zeros(0, dtype=torch.float32, device=engine.device)
    if kind == "param":
        value = slot.tensor
    elif kind == "grad":
        if not _averaged(engine):
            return _accumulated(engine, slot)[slot.lo:slot.hi]
        engine.reduced_gradients(f"safe_get_{'full' if slot.sharded else 'local'}_grad")
        value = slot.tensor.grad
        if value is None:
            return torch.zeros(slot.hi - slot.lo, dtype=torch.float32, device=engine.device)
        value = value.float() / engine.get_loss_scale()
    else:
        state = engine.optimizer.state.get(slot.tensor, {})
        if key not in state:
            raise KeyError(f"the optimizer holds no state {key!r} for this parameter "
                           f"(it has {sorted(state) or 'none yet: step once first'}).")
        value = state[key]
    return value.detach().reshape(-1).to(engine.device, torch.float32)


def _averaged(engine: Engine) -> bool:
    """Whether the gradients asked for are the boundary's averaged ones (else this rank's
    accumulated so far)."""
    return engine.is_gradient_accumulation_boundary() and not engine.inside_no_sync_ctxt


def _accumulated(engine: Engine, slot) -> torch.Tensor:
    """This rank's whole gradient accumulated so far (1-D; zeros before any)."""
    grad = engine.accumulated_gradient(slot.param)
    if grad is None:
        return torch.zeros(slot.numel, dtype=torch.float32, device=engine.device)
    return grad.reshape(-1).to(engine.device)


def _full(engine: Engine, slot, param, kind: str, key: Optional[str] = None) -> torch.Tensor:
    shape = layout_of(param).local_shape
    if kind == "grad" and not _averaged(engine):
        return _accumulated(engine, slot).clone().reshape(shape)  # whole on each rank already
    local = _local(engine, slot, kind, key)
    if not slot.sharded:
        return local.clone().reshape(shape)
    full = torch.zeros(slot.numel, dtype=torch.float32, device=engine.device)
    full[slot.lo:slot.hi] = local
    comm.all_reduce(full)  # slices are disjoint: the sum is the concatenation
    return full.reshape(shape)


def _write_local(engine: Engine, slot, kind: str, value: torch.Tensor,
                 key: Optional[str] = None) -> None:
    if slot.tensor is None:
        return
    value = value.reshape(-1)
    with torch.no_grad():
        if kind == "param":
            slot.tensor.view(-1).copy_(value)
            engine.parameters_changed(slot.param)
        elif kind == "grad":
            engine.reduced_gradients("safe_set_full_grad")
            grad = slot.tensor.grad
            scaled = value * engine.get_loss_scale()
            if grad is None:
                slot.tensor.grad = scaled.to(slot.tensor.device, slot.tensor.dtype).view_as(slot.tensor)
            else:
                grad.view(-1).copy_(scaled)
        else:
            state = engine.optimizer.state.get(slot.tensor, {})
            if key not in state:
                raise KeyError(f"the optimizer holds no state {key!r} for this parameter.")
            state[key].view(-1).copy_(value)


def _get_full(param, kind: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
    engine, slot = _slot(param)
    return None if slot is None else _full(engine, slot, param, kind, key)


def _set_full(param, value: torch.Tensor, kind: str, key: Optional[str] = None) -> None:
    engine, slot = _slot(param)
    if slot is None:
        return
    flat = value.detach().reshape(-1)
    if flat.numel() != slot.numel:
        raise ValueError(f"the value has {flat.numel()} elements, the parameter {slot.numel}.")
    _write_local(engine, slot, kind, flat[slot.lo:slot.hi].to(engine.device), key)
    if kind == "param" and not is_partitioned(param):
        with torch.no_grad():  # a whole module weight on every rank: all of it, not one slice
            param.data.copy_(flat.view_as(param).to(param.device, param.dtype))


def _get_local(param, kind: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
    engine, slot = _slot(param)
    return None if slot is None else _local(engine, slot, kind, key)


def _set_local(param, value: torch.Tensor, kind: str, key: Optional[str] = None) -> None:
    engine, slot = _slot(param)
    if slot is None:
        return
    if value.numel() != slot.hi - slot.lo:
        raise ValueError(f"the value has {value.numel()} elements, this rank's slice "
                         f"{slot.hi - slot.lo}.")
    _write_local(engine, slot, kind, value.detach().to(engine.device), key)


def safe_get_full_fp32_param(param) -> Optional[torch.Tensor]:
    """The full fp32 value of ``param`` (its master copy in 16-bit training)."""
    return _get_full(param, "param")


def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    """Sets ``param`` (master and module weight) to the full ``value`` on every rank."""
    _set_full(param, value, "param")


def safe_get_full_grad(param) -> Optional[torch.Tensor]:
    """The full averaged, unscaled fp32 gradient of ``param`` (after a boundary backward,
    before ``step()``)."""
    return _get_full(param, "grad")


def safe_set_full_grad(param, value: torch.Tensor) -> None:
    """Replaces the gradient ``step()`` will apply with the full ``value`` (unscaled)."""
    _set_full(param, value, "grad")


def safe_get_full_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    """The full optimizer state ``optim_state_key`` (``"exp_avg"``, ...) of ``param``."""
    return _get_full(param, "state", optim_state_key)


def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    _set_full(param, value, "state", optim_state_key)


def safe_get_local_fp32_param(param) -> Optional[torch.Tensor]:
    """This rank's slice of the fp32 value (1-D)."""
    return _get_local(param, "param")


def safe_set_local_fp32_param(param, value: torch.Tensor) -> None:
    _set_local(param, value, "param")


def safe_get_local_grad(param) -> Optional[torch.Tensor]:
    """This rank's slice of the averaged, unscaled gradient (1-D)."""
    return _get_local(param, "grad")


def safe_set_local_grad(param, value: torch.Tensor) -> None:
    _set_local(param, value, "grad")


def safe_get_local_optimizer_state(param, optim_state_key: str) -> Optional[torch.Tensor]:
    return _get_local(param, "state", optim_state_key)


def safe_set_local_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    _set_local(param, value, "state", optim_state_key)
