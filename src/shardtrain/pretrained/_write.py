"""What a rank reads of each tensor, and where it writes it.

* A ZeRO-3 partitioned parameter (an engine at stage 3, or a model built under
  ``zero.Init``): the rank keeps elements ``[lo, hi)`` of the flattened tensor
  (``layout_of(p).shard``). It reads the rows that hold them, which reach past the shard by
  less than one row at each end, and writes its shard (:func:`shardtrain.zero.values.write_shard`);
  the full tensor never exists on the rank.
* A tensor-parallel slice (``layout_of(p).tp``, on a mesh): the rank reads the unsplit
  tensor (one tensor at a time), keeps its slice (``SplitSpec.shard`` over the layout's
  ``tp_group``) and writes it as above: whole, or at stage 3 its shard of the slice.
* This rank's experts of a layer whose experts are stacked along their first dimension and
  split over ranks (``layout_of(p).expert.stacked``): the rows of those experts; from a
  checkpoint that holds each expert apart (:mod:`._experts`), those experts' tensors.
* Everything else (parameters at stages 0-2, the small ones stage 3 keeps whole, buffers, a
  plain model): the rank keeps the whole tensor and reads it whole. It is written in place,
  so an optimizer that holds the parameter or a view of it (fp32 at stages 0-2) sees the new
  values at once.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from ..layout import layout_of
from ..zero import values
from ..zero.values import is_partitioned
from ._files import WeightFiles
from ._match import Target


def covering_rows(lo: int, hi: int, shape: Tuple[int, ...]) -> Tuple[int, int, int]:
    """Rows ``[r0, r1)`` (along the first dimension) of a tensor of ``shape`` that hold its
    flattened elements ``[lo, hi)``, and where ``lo`` falls in the first of them."""
    row = math.prod(shape[1:])
    r0, r1 = lo // row, -(-hi // row)
    return r0, r1, lo - r0 * row


@torch.no_grad()
def load_target(target: Target, files: WeightFiles) -> None:
    """Reads what this rank keeps of ``target`` and writes it there."""
    layout = layout_of(target.tensor)
    split = layout.expert
    stacked = split is not None and split.stacked
    first, count = (split.ep_rank * split.num_local, split.num_local) if stacked else \
        (0, layout.full_shape[0] if target.parts else 0)
    if target.parts is not None:  # each expert apart in the file: this rank's ones, joined
        rows = torch.stack([torch.cat([files.read(n) for n in target.parts[e]])
                            for e in range(first, first + count)])
        _write_rows(target.tensor, rows)
    elif stacked:  # this rank's experts: rows of the stacked tensor
        _write_rows(target.tensor, files.read(target.source, (first, first + count)))
    elif layout.tp is not None:
        _load_slice(target.tensor, files.read(target.source).view(target.full_shape))
    elif is_partitioned(target.tensor):
        _load_shard(target.tensor, target.source, files)
    else:
        whole = files.read(target.source)
        target.tensor.copy_(whole.view(target.tensor.shape))


def _write_rows(p: torch.nn.Parameter, rows: torch.Tensor) -> None:
    """The rows of this rank's experts (whole along their other dimensions): its
    tensor-parallel slice of them when AutoTP split the experts too."""
    layout = layout_of(p)
    if layout.tp is not None:
        rows = layout.tp.shard(rows, layout.tp_group.rank(), layout.tp_group.size())
    values.write_whole(p, rows)


def _load_slice(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """This rank's tensor-parallel slice of the unsplit ``full``, written whole or, at stage 3,
    as this rank's shard of it."""
    layout = layout_of(p)
    group = layout.tp_group
    values.write_whole(p, layout.tp.shard(full, group.rank(), group.size()))


def _load_shard(p: torch.nn.Parameter, name: str, files: WeightFiles) -> None:
    lo, hi = layout_of(p).shard
    if hi <= lo:
        return  # a tensor with fewer elements than ranks leaves this one nothing
    shape = files.tensors[name].shape
    if not shape:  # a single number: nothing to slice
        values.write_shard(p, files.read(name).view(1))
        return
    r0, r1, start = covering_rows(lo, hi, shape)
    rows = files.read(name, (r0, r1)).reshape(-1)
    values.write_shard(p, rows[start: start + hi - lo])


def regather(targets: List[Target]) -> None:
    """Partitioned parameters that were gathered while their shards were written (inside a
    ``GatheredParameters`` block, say) are gathered again, so their full value is the new
    one (a collective: every rank has the same ones gathered)."""
    values.regather(t.tensor for t in targets)
