"""Tensor-parallel layers that hold this rank's shards as plain parameters.

Each layer replaces an ``nn.Linear`` or ``nn.Embedding`` and keeps only this rank's slice of
its weight, as an ordinary ``nn.Parameter`` whose layout record (:func:`shardtrain.layout.layout_of`)
holds its :class:`~shardtrain.parallel.SplitSpec`, so that ZeRO can flatten it like any other
parameter and checkpoints can rebuild the full value. Communication happens in the forward
and backward passes only, through the autograd functions of ``_tp_autograd``:

* :class:`ColumnParallelLinear`: output features split (weight dim 0, bias split with it);
  input replicated; output split unless ``gather_output``.
* :class:`RowParallelLinear`: input features split (weight dim 1); the partial products are
  summed over the group, then the replicated bias is added once.
* :class:`VocabParallelEmbedding`: vocabulary rows split; each rank looks up the ids it owns
  and the partial embeddings are summed.
* :func:`vocab_parallel_cross_entropy`: the exact loss of logits split over the vocabulary,
  without gathering them.

A column layer followed by a row layer (attention's q/k/v then o, an MLP's up then down)
costs one all-reduce forward and one backward.

Example:
    >>> mesh = comm.init_mesh(tp=2)
    >>> up = ColumnParallelLinear.from_linear(nn.Linear(64, 256), mesh.tp)
    >>> down = RowParallelLinear.from_linear(nn.Linear(256, 64), mesh.tp)
    >>> y = down(F.gelu(up(x)))          # the same y on both ranks of the group
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ._cross_entropy import vocab_parallel_cross_entropy
from ..layout import SplitSpec, place
from ._tp_autograd import copy_to_group, gather_from_group, reduce_from_group

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SharedInput", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy"]


def _as_shard(tensor: torch.Tensor, spec: SplitSpec, group: comm.Group) -> nn.Parameter:
    """``tensor`` (already this rank's shard) as a parameter whose layout records ``spec`` and
    the group its slices are spread over (full weights and checkpoints join them)."""
    param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
    place(param, local_shape=tuple(param.shape), tp=spec, tp_group=group)
    return param


def _shard_of(param: torch.Tensor, spec: SplitSpec, group: comm.Group) -> nn.Parameter:
    """This rank's shard of the full ``param``, as a new parameter marked with ``spec``."""
    shard = spec.shard(param.detach(), group.rank(), group.size())
    return _as_shard(nn.Parameter(shard, requires_grad=param.requires_grad), spec, group)


def _check_embedding_options(embedding: nn.Embedding) -> None:
    unsupported = {k: getattr(embedding, k) for k in ("max_norm", "sparse", "scale_grad_by_freq")
                   if getattr(embedding, k)}
    if unsupported:
        raise NotImplementedError(f"VocabParallelEmbedding does not support nn.Embedding's "
                                  f"{unsupported}: keep this embedding replicated.")


def _split_repr(spec: SplitSpec, group: comm.Group) -> str:
    parts = "" if len(spec.parts) == 1 else f", parts={spec.parts}"
    return f"tp={group.size()}, rank={group.rank()}{parts}"


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split over ``group``.

    Holds rows ``spec.shard(weight, rank, size)`` of the full ``[out, in]`` weight (and the
    same slice of the bias). The input must be the same on every rank of the group.

    Args:
        weight: this rank's shard of the weight, ``[out / N, in]``; a Parameter is kept as
            it is (so tied weights stay one Parameter).
        bias: this rank's shard of the bias, or None.
        group: the tensor-parallel group.
        spec: how the full weight is split (``dim`` 0).
        gather_output: gather the output over the group (every rank gets all features);
            otherwise each rank returns its own features.

    Attributes:
        in_features, out_features: the local weight's sizes.

    Example:
        >>> qkv = ColumnParallelLinear.from_linear(attn.qkv_proj, mesh.tp,
        ...                                        SplitSpec(0, (q, kv, kv)))
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: comm.Group,
                 spec: SplitSpec, gather_output: bool = False) -> None:
        super().__init__()
        if spec.dim != 0:
            raise ValueError(f"ColumnParallelLinear splits the output features (weight dim 0), "
                             f"got {spec}: use RowParallelLinear to split dim 1.")
        if gather_output and len(spec.parts) > 1:
            raise ValueError(f"gather_output cannot rebuild fused parts {spec.parts}: the gathered "
                             "features would come in rank order, not in the fused layout. "
                             "Leave the output split, or split a layer without fused parts.")
        self.group, self.spec, self.gather_output = group, spec, gather_output
        self.weight = _as_shard(weight, spec, group)
        self.bias = None if bias is None else _as_shard(bias, spec, group)
        self.out_features, self.in_features = self.weight.shape
        self.shared: Optional[SharedInput] = None  # see SharedInput

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group, spec: Optional[SplitSpec] = None,
                    gather_output: bool = False) -> "ColumnParallelLinear":
        """The column-parallel layer holding this rank's slice of ``linear``'s weights.

        Every rank of ``group`` must hold the same full weights. Keeps their dtype, device
        and ``requires_grad``.

        Args:
            linear: the full layer.
            group: the tensor-parallel group.
            spec: default: one part, ``SplitSpec(0, (linear.out_features,))``.
            gather_output: see the class.

        Example:
            >>> model.fc = ColumnParallelLinear.from_linear(model.fc, mesh.tp)
        """
        spec = spec or SplitSpec(0, (linear.out_features,))
        bias = None if linear.bias is None else _shard_of(linear.bias, spec, group)
        return cls(_shard_of(linear.weight, spec, group), bias, group, spec, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entered = self.shared.enter(x, self.group) if self.shared is not None else \
            copy_to_group(x, self.group)
        y = F.linear(entered, self.weight, self.bias)
        return gather_from_group(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {_split_repr(self.spec, self.group)}, "
                f"gather_output={self.gather_output}")


class SharedInput:
    """One entry into the group per input tensor for the column-parallel layers of one block
    (an attention block's q, k and v projections; an MLP's gate and up), while the block's
    forward runs: the layers that read the same tensor share one :func:`copy_to_group`, so
    their input gradients are summed by autograd before one all-reduce instead of one
    all-reduce each (what fusing the layers, as Megatron-LM fuses qkv, gives).

    :meth:`attach` clears the entries when the block's forward starts and ends, so a tensor is
    held no longer than the forward that reads it.

    Example:
        >>> shared = SharedInput().attach(attention)
        >>> for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        ...     proj.shared = shared
    """

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}

    def enter(self, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        hit = self._entries.get(id(x))
        if hit is not None and hit[0] is x and hit[2] == x._version:
            return hit[1]
        entered = copy_to_group(x, group)
        self._entries[id(x)] = (x, entered, x._version)
        return entered

    def attach(self, block: nn.Module) -> "SharedInput":
        block.register_forward_pre_hook(self._clear_before)
        block.register_forward_hook(self._clear_after)
        return self

    def _clear_before(self, module: nn.Module, args: Any) -> None:
        self._entries.clear()

    def _clear_after(self, module: nn.Module, args: Any, output: Any) -> None:
        self._entries.clear()


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over ``group``.

    Its input is this rank's slice of the features (a column-parallel layer's output); the
    partial products are summed over the group and the bias, replicated, is added after the
    sum (added on every rank before it, it would count N times).

    Args:
        weight: this rank's shard of the weight, ``[out, in / N]``.
        bias: the full bias (replicated, not split), or None.
        group: the tensor-parallel group.
        spec: how the full weight is split (``dim`` 1).

    Attributes:
        in_features, out_features: the local weight's sizes.

    Example:
        >>> model.proj = RowParallelLinear.from_linear(model.proj, mesh.tp)
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: comm.Group,
                 spec: SplitSpec) -> None:
        super().__init__()
        if spec.dim != 1:
            raise ValueError(f"RowParallelLinear splits the input features (weight dim 1), "
                             f"got {spec}: use ColumnParallelLinear to split dim 0.")
        self.group, self.spec = group, spec
        self.weight = _as_shard(weight, spec, group)
        self.bias = None if bias is None else (
            bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias))
        self.out_features, self.in_features = self.weight.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group,
                    spec: Optional[SplitSpec] = None) -> "RowParallelLinear":
        """The row-parallel layer holding this rank's slice of ``linear``'s weight and its
        whole bias (every rank must hold the same full weights).

        Args:
            linear: the full layer.
            group: the tensor-parallel group.
            spec: default: one part, ``SplitSpec(1, (linear.in_features,))``.

        Example:
            >>> block.down_proj = RowParallelLinear.from_linear(block.down_proj, mesh.tp)
        """
        spec = spec or SplitSpec(1, (linear.in_features,))
        return cls(_shard_of(linear.weight, spec, group), linear.bias, group, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {_split_repr(self.spec, self.group)}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows are split over ``group``.

    Rank r owns ids ``[r * V / N, (r + 1) * V / N)``; it embeds those, gives zeros for the
    others, and the partial embeddings are summed over the group, so every rank gets the
    full embedding of every id.

    Args:
        weight: this rank's rows, ``[V / N, dim]``; a Parameter is kept as it is (an LM head
            split over the same vocabulary can share it: tied weights stay one Parameter).
        group: the tensor-parallel group.
        spec: ``SplitSpec(0, (V,))``.
        padding_idx: the full vocabulary's padding id (its row gets no gradient), or None.

    Attributes:
        num_embeddings: the local rows; ``embedding_dim``.

    Example:
        >>> model.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, mesh.tp)
    """

    def __init__(self, weight: torch.Tensor, group: comm.Group, spec: SplitSpec,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        if spec.dim != 0 or len(spec.parts) != 1:
            raise ValueError(f"VocabParallelEmbedding splits the vocabulary (dim 0, one part), "
                             f"got {spec}.")
        self.group, self.spec, self.padding_idx = group, spec, padding_idx
        self.weight = _as_shard(weight, spec, group)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        self.vocab_start = group.rank() * self.num_embeddings
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self._local_padding_idx = local_pad if local_pad is not None and \
            0 <= local_pad < self.num_embeddings else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: comm.Group) -> "VocabParallelEmbedding":
        """The embedding holding this rank's rows of ``embedding`` (every rank must hold the
        same full weight).

        Example:
            >>> model.wte = VocabParallelEmbedding.from_embedding(model.wte, mesh.tp)
        """
        _check_embedding_options(embedding)
        spec = SplitSpec(0, (embedding.num_embeddings,))
        return cls(_shard_of(embedding.weight, spec, group), group, spec, embedding.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        foreign = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight, self._local_padding_idx)
        # Zeroed rows also get a zero gradient: row 0 is not charged for ids it does not own.
        return reduce_from_group(out.masked_fill(foreign.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"vocab_start={self.vocab_start}, padding_idx={self.padding_idx}, "
                f"{_split_repr(self.spec, self.group)}")
