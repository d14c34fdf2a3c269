"""The attention function that :func:`shardtrain.parallel.ulysses.enable_ulysses` registers in
Hugging Face Transformers' ``AttentionInterface``.

A model calls it as ``fn(module, query, key, value, attention_mask, dropout=, scaling=,
**kwargs)`` with ``query``/``key``/``value`` as ``[batch, heads, seq / S, head_dim]`` and
expects ``[batch, seq / S, heads, head_dim]`` back. In between, the heads are spread over the
group so that the model's own attention (``sdpa`` or its module's ``eager_attention_forward``)
runs over the whole sequence for ``heads / S`` heads on each rank.

Masks: with our name as the configured implementation, Transformers' mask builders return
None (they build masks only for the implementations they know), so causality is ours to
apply over the whole sequence: ``sdpa`` with no mask is causal by ``is_causal``; ``eager``
gets the additive causal mask its model's mask builder would have made.

Packed rows (several documents in one row, ``position_ids`` restarting at each): the model
passes each rank's slice of ``position_ids`` to attention; gathered over the group they give
every position's document, and attention gets the block-causal mask (a query sees the earlier
positions of its own document only), as Transformers builds it for packed rows on one process.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .. import comm
from ._seq_autograd import all_to_all

AttentionFn = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]

# HF layouts: the function's inputs are [batch, heads, seq, dim], its output is
# [batch, seq, heads, dim]; dims 1 and 2 are heads and sequence in one, the reverse in the other.
_IN_HEADS, _IN_SEQ = 1, 2
_OUT_SEQ, _OUT_HEADS = 1, 2


class _LocalGroups:
    """The attention module as the original function must see it once key/value heads were
    replicated: every attribute is the module's but ``num_key_value_groups``, the number of
    query heads per key/value head on this rank (the model's own ratio no longer holds when
    one key/value head serves only this rank's share of its query heads)."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _CausalMask:
    """The additive causal mask ``[1, 1, seq, seq]`` for ``eager`` attention (0 where a query
    may attend, the dtype's minimum elsewhere, as Transformers' eager mask), kept for the last
    length, dtype and device: every layer of a forward asks for the same one."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._mask: Optional[torch.Tensor] = None

    def __call__(self, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (length, dtype, device)
        if key != self._key:
            allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            mask = torch.zeros(length, length, dtype=dtype, device=device)
            self._mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
            self._key = key
        return self._mask


_EAGER: Dict[type, AttentionFn] = {}


def _model_eager(module: torch.nn.Module) -> AttentionFn:
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class:
    Transformers has no ``eager`` entry in its interface; each model passes its own (some
    add soft-capping or attention sinks)."""
    cls = type(module)
    if cls not in _EAGER:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(
                f"{cls.__name__} ({cls.__module__}) has no eager_attention_forward to run over "
                "the whole sequence: load the model with attn_implementation='sdpa'.")
        _EAGER[cls] = fn
    return _EAGER[cls]


def _refuse_unsupported(attention_mask: Optional[torch.Tensor], kwargs: Dict[str, Any]) -> None:
    """What this attention cannot honour, refused by name (Python checks only: no sync)."""
    if attention_mask is not None:
        raise NotImplementedError(
            f"Ulysses attention got an attention mask of shape {tuple(attention_mask.shape)}: "
            "a mask built on one rank covers only its slice of the sequence. Pass batches "
            "through shard_sequence (it drops masks it proves unnecessary) and no custom mask.")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"sliding-window attention (window {kwargs['sliding_window']}) is not supported "
            "under Ulysses sequence parallelism: disable the model's sliding window "
            "(e.g. use_sliding_window=False) or train without sequence parallelism.")


class _Documents:
    """The block-causal mask of packed rows, from this rank's slice of ``position_ids``:
    None when no row restarts its positions (then plain causal attention is exact). Every
    layer of a forward passes the same ``position_ids`` tensor; the gather and the check
    (one host synchronisation) run once per forward, on every rank alike."""

    def __init__(self, group: comm.Group):
        self._group = group
        self._last: Optional[torch.Tensor] = None
        self._mask: Optional[torch.Tensor] = None

    def __call__(self, position_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if position_ids is None:
            return None
        if position_ids is not self._last:
            self._last, self._mask = position_ids, self._build(position_ids)
        return self._mask

    def _build(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        size = self._group.size()
        local = local.contiguous()
        rows = local.shape[0]
        gathered = torch.empty((size * rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        comm.all_gather(gathered, local, group=self._group)
        full = torch.cat(list(gathered.view(size, rows, -1).unbind(0)), dim=-1)  # [rows, seq]
        starts = full.diff(dim=-1) != 1
        if not bool(starts.any()):
            return None
        doc = torch.cat([torch.zeros_like(full[:, :1]), starts.cumsum(-1)], dim=-1)
        length = full.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool, device=full.device).tril()
        return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # [rows, 1, seq, seq]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention's additive one (0, or the dtype's minimum)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def _is_causal(module: torch.nn.Module, kwargs: Dict[str, Any]) -> bool:
    # The same rule as Transformers' sdpa function: a call's is_causal wins over the module's.
    given = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if given is None else given)


def make_attention(group: comm.Group, original: str, kv_replicas: int,
                   local_groups: int) -> AttentionFn:
    """The function to register: exchanges q/k/v from sequence- to head-sharded, runs
    ``original`` ("sdpa" or "eager") over the whole sequence, exchanges the output back.
    ``kv_replicas`` copies of each key/value head are sent when the model has fewer of them
    than ranks; ``local_groups`` is then the query heads per key/value head on a rank."""
    from transformers import AttentionInterface
    sdpa = AttentionInterface()["sdpa"] if original == "sdpa" else None
    causal_mask = _CausalMask()
    documents = _Documents(group)

    def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                          **kwargs: Any) -> Tuple[torch.Tensor, None]:
        _refuse_unsupported(attention_mask, kwargs)
        if kv_replicas > 1:  # rank r receives copy r, which serves its query heads
            key = key.repeat_interleave(kv_replicas, dim=_IN_HEADS)
            value = value.repeat_interleave(kv_replicas, dim=_IN_HEADS)
        q, k, v = (all_to_all(t, group, _IN_HEADS, _IN_SEQ) for t in (query, key, value))
        mask = None
        packed = documents(kwargs.get("position_ids")) if _is_causal(module, kwargs) else None
        if packed is not None:
            mask = packed if sdpa is not None else _additive(packed, q.dtype)
        elif sdpa is None and _is_causal(module, kwargs):
            mask = causal_mask(q.shape[_IN_SEQ], q.dtype, q.device)
        target = module if kv_replicas == 1 else _LocalGroups(module, local_groups)
        out, _ = (sdpa or _model_eager(module))(target, q, k, v, mask, **kwargs)
        # The weights (eager) cover this rank's heads only: returned as None, as sdpa does.
        return all_to_all(out, group, _OUT_SEQ, _OUT_HEADS), None

    return ulysses_attention
