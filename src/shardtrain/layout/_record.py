"""The record of where one parameter lives, and the one function that changes it.

A parameter's layout is set by the rooms that split it (``parallel/`` for tensor parallelism,
``zero/`` for ZeRO-3's partitions and the parameters stage 3 keeps whole, ``moe/`` for the
experts split over ranks) through
:func:`place`, and read by every other room through :func:`layout_of`. The record is kept
on the parameter itself, so it follows the parameter wherever the parameter goes (a module
moved, copied or pickled keeps it).

DeepSpeed's attributes (``ds_shape``, ``ds_numel``, ``ds_process_group``, ``ds_persist``)
and the tensor-parallel marks (``tp_split``, ``tp_group``) are written by :func:`place` from
the record, for the scripts and libraries that read them (transformers reads ``ds_shape``
and ``ds_numel``); nothing in shardtrain reads them outside ``zero/``'s own machinery. What
changes while training (the shard's storage ``ds_tensor``, the gathered value, ``ds_status``)
is ZeRO's working state, not the parameter's layout, and stays ``zero/``'s.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import torch

from ._even import shard_range
from ._split import SplitSpec

__all__ = ["ExpertSplit", "ParamLayout", "layout_of", "place"]

_ATTR = "_shardtrain_layout"


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """Which experts of a mixture-of-experts layer a parameter holds, when the layer's experts
    are split over an expert-parallel group: rank ``ep_rank`` of the ``ep_size`` ranks holds
    the ``num_local`` experts ``ep_rank * num_local`` onward.

    Two ways to hold them: one module per expert (``index``: the ``index``-th local expert,
    whose parameters' names carry that local index after ``marker``,
    ``...deepspeed_experts.<index>.weight``, where the unsplit model's names carry the global
    one); or every local expert stacked along the parameter's first dimension (``index``
    None: Hugging Face's ``experts.gate_up_proj`` of shape ``(num_experts, ...)``, of which
    this rank holds rows ``ep_rank * num_local`` onward, under the unsplit model's name).
    """

    index: Optional[int]
    num_local: int
    ep_size: int
    ep_rank: int
    marker: str = "deepspeed_experts"

    @property
    def stacked(self) -> bool:
        """The parameter holds this rank's experts stacked along its first dimension."""
        return self.index is None

    def global_name(self, local_name: str, ep_rank: Optional[int] = None) -> str:
        """``local_name`` with the global index of the expert it names on ``ep_rank`` (default:
        this rank): the name a model holding every expert gives it (a stacked parameter's
        name is already that).

        Example:
            >>> ExpertSplit(1, 2, 4, 3).global_name("moe.deepspeed_experts.1.w")
            'moe.deepspeed_experts.7.w'
        """
        if self.stacked:
            return local_name
        head, sep, tail = local_name.rpartition(f"{self.marker}.")
        local, dot, rest = tail.partition(".")
        if not sep or local != str(self.index):
            raise ValueError(f"{local_name!r} is not the name of local expert {self.index} "
                             f"(after '{self.marker}.').")
        rank = self.ep_rank if ep_rank is None else ep_rank
        return f"{head}{sep}{rank * self.num_local + self.index}{dot}{rest}"


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives on this rank.

    Each way of splitting a parameter is one field, set by the room that splits it; a new
    one (experts, pipeline stages) is a new field, and the properties below stay the only
    arithmetic readers need.

    Attributes:
        local_shape: the shape of this rank's tensor-parallel piece, whole (the parameter's
            own shape when it is not partitioned; DeepSpeed's ``ds_shape``).
        tp: how the full parameter is split over the tensor-parallel group (None: each of
            its ranks holds all of it).
        tp_group: that group (:class:`shardtrain.comm.Group`).
        zero_group: the data-parallel group over which ZeRO-3 cuts the local piece into even
            shards (None: no rank partitions it).
        persistent: stage 3 keeps it whole on every rank of ``zero_group`` (a small
            parameter: DeepSpeed's ``ds_persist``).
        unit: the name of the stage-3 group it is gathered with (None outside stage 3).
        expert: which expert it belongs to, when a mixture-of-experts layer's experts are
            split over ranks (:class:`ExpertSplit`; None: every rank holds it).
        expert_groups: then, the expert-parallel group (the ranks holding the other
            experts) and the expert-data-parallel one (those holding the same), as a pair.
    """

    local_shape: Tuple[int, ...]
    tp: Optional[SplitSpec] = None
    tp_group: Any = None
    zero_group: Any = None
    persistent: bool = False
    unit: Optional[str] = None
    expert: Optional[ExpertSplit] = None
    expert_groups: Any = None

    @property
    def full_shape(self) -> Tuple[int, ...]:
        """The unsplit parameter's shape (tensor-parallel pieces joined, shards gathered,
        stacked experts of every expert-parallel rank joined)."""
        shape = list(self.local_shape)
        if self.tp is not None:
            shape[self.tp.dim] = self.tp.full_size
        if self.expert is not None and self.expert.stacked:
            shape[0] *= self.expert.ep_size
        return tuple(shape)

    @property
    def numel(self) -> int:
        """Elements of the unsplit parameter."""
        return math.prod(self.full_shape)

    @property
    def local_numel(self) -> int:
        """Elements of this rank's piece (tensor-parallel, or its stacked experts)."""
        return math.prod(self.local_shape)

    @property
    def partitioned(self) -> bool:
        """ZeRO-3 keeps only a shard of it on each rank."""
        return self.zero_group is not None and not self.persistent

    @property
    def shard(self) -> Optional[Tuple[int, int]]:
        """This rank's ``[lo, hi)`` of the flattened local piece when partitioned, else None."""
        if not self.partitioned:
            return None
        return shard_range(self.local_numel, self.zero_group.size(), self.zero_group.rank())


def layout_of(param: torch.Tensor) -> ParamLayout:
    """Where ``param`` lives; a tensor no room has split is whole on every rank.

    Example:
        >>> layout = layout_of(model.lm_head.weight)
        >>> layout.full_shape, layout.partitioned, layout.tp
        ((50304, 768), True, None)
    """
    record = param.__dict__.get(_ATTR) if hasattr(param, "__dict__") else None
    return record if record is not None else ParamLayout(tuple(param.shape))


def place(param: torch.Tensor, **changes: Any) -> ParamLayout:
    """Changes the fields ``changes`` of ``param``'s layout and writes DeepSpeed's and the
    tensor-parallel attributes from the result. Only the rooms that split parameters call
    it (``parallel/``, ``zero/``, ``moe/``)."""
    record = dataclasses.replace(layout_of(param), **changes)
    if "local_shape" in changes:
        record = dataclasses.replace(record, local_shape=tuple(record.local_shape))
    setattr(param, _ATTR, record)
    _write_attributes(param, record)
    return record


def _write_attributes(param: torch.Tensor, record: ParamLayout) -> None:
    if record.tp is not None:
        param.tp_split, param.tp_group = record.tp, record.tp_group
    if record.zero_group is not None:
        param.ds_shape = torch.Size(record.local_shape)
        param.ds_numel = record.local_numel
        param.ds_process_group = record.zero_group
        param.ds_persist = record.persistent
