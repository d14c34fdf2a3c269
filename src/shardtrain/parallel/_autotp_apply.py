"""Carries out a checked AutoTP plan: layers replaced in place, shards cut, head counts made
local. Nothing here can fail on a user's mistake; ``_autotp_match`` has refused those.

Layers keep their names (``q_proj`` stays ``q_proj``, its weight stays ``q_proj.weight``),
so optimizer groups, checkpoints and state dicts keep addressing them by the same keys.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from .. import comm
from ._autotp_match import Actions, LinearSplit, Registered
from ._tp_autograd import copy_to_group, reduce_from_group
from ..layout import SplitSpec, layout_of
from .tensor import ColumnParallelLinear, RowParallelLinear, SharedInput, VocabParallelEmbedding, _shard_of


def execute(root: nn.Module, group: comm.Group, actions: Actions) -> Dict[int, str]:
    """Applies ``actions``; returns each split parameter's kind, by ``id``."""
    kinds: Dict[int, str] = {}
    for split in actions.linears:
        _split_linear(root, group, split, kinds)
    _share_inputs(root, actions)
    for at in actions.embeddings:
        embedding = VocabParallelEmbedding.from_embedding(at.module, group)
        _replace(root, at.module_name, embedding)
        kinds[id(embedding.weight)] = "vocab"
    for owned in actions.fused.values():
        _split_fused(group, owned, kinds)
    for _, module, attr, count in actions.head_counts:
        setattr(module, attr, count)
    _localise_configs(actions)
    return kinds


def _share_inputs(root: nn.Module, actions: Actions) -> None:
    """The column-parallel layers of one block (siblings: q, k, v; gate, up) share their
    entry into the group (:class:`~shardtrain.parallel.tensor.SharedInput`): one all-reduce
    in backward for the layers that read the same input."""
    siblings: Dict[str, list] = {}
    for split in actions.linears:
        if split.kind == "column" and not split.head and not split.tied:
            parent = split.at.module_name.rpartition(".")[0]
            siblings.setdefault(parent, []).append(root.get_submodule(split.at.module_name))
    for parent, layers in siblings.items():
        if len(layers) > 1:
            shared = SharedInput().attach(root.get_submodule(parent) if parent else root)
            for layer in layers:
                layer.shared = shared


def _replace(root: nn.Module, module_name: str, new: nn.Module) -> None:
    parent_name, _, child = module_name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _split_linear(root: nn.Module, group: comm.Group, split: LinearSplit,
                  kinds: Dict[int, str]) -> None:
    linear = split.at.module
    if split.kind == "column":
        new = ColumnParallelLinear.from_linear(linear, group, split.split, split.gather_output)
    else:
        new = RowParallelLinear.from_linear(linear, group, split.split)
    _replace(root, split.at.module_name, new)
    vocab = split.head or bool(split.tied)
    kinds[id(new.weight)] = "vocab" if vocab else split.kind
    if new.bias is not None and split.kind == "column":
        kinds[id(new.bias)] = "vocab" if vocab else split.kind
    for tied in split.tied:  # the input embedding keeps sharing the head's (now split) weight
        _tie_embedding(root, group, tied, new.weight)


def _tie_embedding(root: nn.Module, group: comm.Group, at: Registered,
                   weight: nn.Parameter) -> None:
    embedding = VocabParallelEmbedding(weight, group, layout_of(weight).tp, at.module.padding_idx)
    _replace(root, at.module_name, embedding)


def _split_fused(group: comm.Group, owned: List[Tuple[Registered, str, SplitSpec]],
                 kinds: Dict[int, str]) -> None:
    """Shards a fused block's own parameters; its floating inputs enter the group (their
    gradients are summed) and its output, partial on each rank, is summed."""
    module = owned[0][0].module
    for at, kind, spec in owned:
        shard = _shard_of(at.param, spec, group)
        setattr(module, at.attr, shard)
        kinds[id(shard)] = kind
    module.register_forward_pre_hook(functools.partial(_enter_group, group), with_kwargs=True)
    module.register_forward_hook(functools.partial(_leave_group, group))


def _enter_group(group: comm.Group, module: nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    def enter(value: Any) -> Any:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        return copy_to_group(value, group) if floating else value
    return tuple(enter(a) for a in args), {k: enter(v) for k, v in kwargs.items()}


def _leave_group(group: comm.Group, module: nn.Module, args: Tuple[Any, ...],
                 output: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; a block "
                        "split by AutoTP as a whole must return one tensor (its partial sums).")
    return reduce_from_group(output, group)


def _localise_configs(actions: Actions) -> None:
    """Attention blocks that read head counts from their config (Phi3 slices its fused qkv
    at ``config.num_attention_heads * head_dim``) get a view of it with local counts; the
    model's own config, which checkpoints save, keeps the full ones. One view per config
    object. Everything else is read from the model's config as it is now, so a later
    change there (``set_attn_implementation``, as Ulysses does) reaches the blocks too."""
    views: Dict[int, Any] = {}
    for _, module, counts in actions.config_counts:
        original = module.config
        if id(original) not in views:
            views[id(original)] = LocalCounts(original, counts)
        module.config = views[id(original)]


class LocalCounts:
    """A config with some head counts replaced; every other attribute is the original's."""

    def __init__(self, original: Any, counts: Dict[str, int]):
        self.__dict__.update(counts)
        self.__dict__["_original"] = original

    def __getattr__(self, name: str) -> Any:  # only for names not replaced
        try:
            original = self.__dict__["_original"]
        except KeyError:  # a copy being built (copy, pickle) has no original yet
            raise AttributeError(name) from None
        return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self._original, name, value)

    def __repr__(self) -> str:
        counts = {k: v for k, v in self.__dict__.items() if k != "_original"}
        return f"LocalCounts({type(self._original).__name__}, {counts})"
