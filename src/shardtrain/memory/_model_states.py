"""The bytes of model states: those a rank holds (:func:`count_bytes`), and those the ZeRO
formula predicts per stage (:func:`zero_formula_bytes`, and ``shardtrain estimate``'s rules in
:func:`bytes_per_param` and :func:`estimate_model_states`).

Tensors that share storage (a gradient that is a view into a flat bucket, a parameter
tied to another) are counted once, in the first category that names them.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional

import torch

__all__ = ["count_bytes", "zero_formula_bytes", "BytesPerParam", "bytes_per_param",
           "estimate_model_states"]


def count_bytes(groups: Dict[str, Iterable[torch.Tensor]]) -> Dict[str, int]:
    """Bytes per category of distinct storages, plus ``total``.

    Example:
        >>> count_bytes({"params": [w], "grads": [w.grad]})["total"]
    """
    seen = set()
    out: Dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[name] = total
    out["total"] = sum(out.values())
    return out


def zero_formula_bytes(num_params: int, world_size: int, stage: int, param_bytes: int = 4,
                       grad_bytes: int = 4, optimizer_bytes: int = 8) -> int:
    """Model-state bytes per rank that the ZeRO paper's formula predicts.

    ``optimizer_bytes`` is K: fp32 Adam alone is 8 (two moments); with 16-bit parameters
    the fp32 master copy adds 4, so K = 12.
    """
    p, g, k, n = param_bytes * num_params, grad_bytes * num_params, optimizer_bytes * num_params, world_size
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


@dataclasses.dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in model states: ``p`` as parameter, ``g`` as gradient,
    ``k`` in the optimizer (fp32 master copy included), and what ``k`` is made of."""

    p: int
    g: int
    k: int
    k_parts: str


def bytes_per_param(dtype: str, optimizer: str, grad_accum_dtype: Optional[str] = None,
                    bf16_masters: bool = False) -> BytesPerParam:
    """The bytes per parameter of ``dtype`` ("fp32", "bf16", "fp16") parameters trained
    with ``optimizer`` ("adam": two fp32 moments, "sgd": one momentum); gradients are held in
    ``grad_accum_dtype`` (``data_types.grad_accum_dtype``; None: ``dtype``). ``bf16_masters``
    (``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``): no master copy, and
    the states in bf16."""
    states, what = {"adam": (8, "Adam moments"), "sgd": (4, "SGD momentum")}[optimizer]
    grads = 4 if "fp32" in (dtype, grad_accum_dtype) else 2
    if dtype == "fp32":
        return BytesPerParam(4, grads, states, f"{what} {states}")
    if bf16_masters:
        return BytesPerParam(2, grads, states // 2, f"no master + bf16 {what} {states // 2}")
    return BytesPerParam(2, grads, 4 + states, f"fp32 master 4 + {what} {states}")


def estimate_model_states(trainable: int, frozen: int, persistent: int, world_size: int,
                          stage: int, b: BytesPerParam) -> Dict[str, int]:
    """Per-rank model-state bytes at ``stage`` over ``world_size`` ZeRO ranks, as
    ``shardtrain estimate`` predicts them: ``params``, ``grads``, ``optimizer`` and
    ``total``. Frozen parameters cost their parameter bytes only; at stage 3 the
    ``persistent`` (small) parameters are whole on every rank, adding
    ``p * persistent * (N - 1) / N``.

    The formula is linear in each kind of bytes, so one kind at a time splits the total.
    """
    def share(p: int = 0, g: int = 0, k: int = 0) -> int:
        return round(zero_formula_bytes(trainable, world_size, stage, p, g, k)
                     + zero_formula_bytes(frozen, world_size, stage, p, 0, 0))

    extra = round(b.p * persistent * (world_size - 1) / world_size) if stage == 3 else 0
    return {"params": share(p=b.p) + extra, "grads": share(g=b.g), "optimizer": share(k=b.k),
            "total": share(b.p, b.g, b.k) + extra}
