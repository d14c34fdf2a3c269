"""Which parameters AutoTP splits and how, decided before anything in the model changes.

Every check that can fail (a pattern that matches nothing, a parameter that is not a
Linear or Embedding weight, a size not divisible by the group, head counts, strict mode,
weights tied to a layer that stays whole) runs here, over the whole model, so that a
mistake leaves the user's model as it was instead of half converted.

Parameters are matched by the name they are registered under (``named_modules`` x own
parameters), so a weight tied between an embedding and the LM head is seen under both
names; a Linear's bias is never matched itself, it follows its weight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ._autotp_config import AutoTPConfig, LayerSpec
from ..layout import SplitSpec, layout_of
from .tensor import _check_embedding_options

#: Integer head counts divided by the group size on an attention block whose projections
#: are split (and on its config, which some attention blocks read in forward).
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads",
              "num_kv_heads", "n_kv_heads")


@dataclass
class Registered:
    """A parameter where it is registered: ``module``'s attribute ``attr``."""

    name: str
    module_name: str
    module: nn.Module
    attr: str

    @property
    def param(self) -> nn.Parameter:
        return getattr(self.module, self.attr)


@dataclass
class LinearSplit:
    at: Registered
    kind: str  # "column" or "row"
    split: SplitSpec
    gather_output: bool
    head: bool
    tied: List[Registered] = field(default_factory=list)  # embeddings sharing the weight


@dataclass
class Actions:
    """Everything AutoTP will change in the model."""

    linears: List[LinearSplit] = field(default_factory=list)
    embeddings: List[Registered] = field(default_factory=list)  # split over the vocabulary
    fused: Dict[str, List[Tuple[Registered, str, SplitSpec]]] = field(default_factory=dict)
    head_counts: List[Tuple[str, nn.Module, str, int]] = field(default_factory=list)
    config_counts: List[Tuple[str, nn.Module, Dict[str, int]]] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)


def registered(root: nn.Module) -> List[Registered]:
    return [Registered(f"{mname}.{attr}" if mname else attr, mname, module, attr)
            for mname, module in root.named_modules()
            for attr, _ in module.named_parameters(recurse=False)]


def plan(root: nn.Module, size: int, config: AutoTPConfig, specs: Sequence[LayerSpec],
         model_type: Optional[str]) -> Actions:
    """What to split, checked over the whole model (see the module docstring)."""
    params = registered(root)
    check_user_patterns(root, params, config.layer_specs, model_type)
    active = [s for s in specs if s.applies_to(model_type)]
    matches = {id(r): _first(active, r.name) for r in params if not _is_linear_bias(r)}
    actions = Actions()
    by_param: Dict[int, List[Registered]] = {}
    for r in params:
        if id(r) in matches:
            by_param.setdefault(id(r.param), []).append(r)
    for owners in by_param.values():
        _decide(owners, [matches[id(r)] for r in owners], size, config, actions)
    _check_fused(actions)
    if config.strict_mode:
        _check_strict(params, matches, config)
    _plan_head_counts(root, actions, size)
    return actions


def _first(specs: Sequence[LayerSpec], name: str) -> Optional[LayerSpec]:
    return next((s for s in specs if s.matches(name)), None)


def _is_linear_bias(r: Registered) -> bool:
    return isinstance(r.module, nn.Linear) and r.attr == "bias"


def refuse_resplit(root: nn.Module) -> None:
    """AutoTP needs every weight whole on every rank: not yet split, not partitioned by
    ZeRO-3 (``zero.Init``)."""
    done = [name for name, p in root.named_parameters() if layout_of(p).tp is not None]
    if done:
        raise ValueError(f"the model is already tensor-parallel ({done[0]} is a shard): apply "
                         "AutoTP once, to the full model.")
    sharded = [name for name, p in root.named_parameters() if layout_of(p).partitioned]
    if sharded:
        raise ValueError(
            f"{sharded[0]} is partitioned by ZeRO-3 (the model was built under "
            "shardtrain.zero.Init): tensor parallelism splits whole weights. Build the model "
            "without zero.Init (ZeRO-3 then shards each tensor-parallel slice over the "
            "data-parallel ranks), or train it without tensor_parallel.")


def check_user_patterns(root: nn.Module, params: List[Registered],
                        specs: Sequence[LayerSpec], model_type: Optional[str]) -> None:
    """Every pattern of the config's own layer specs must match some parameter name."""
    names = [r.name for r in params]
    for spec in specs:
        if not spec.applies_to(model_type):
            continue
        for pattern in spec.patterns:
            if not any(re.match(pattern, n) for n in names):
                raise ValueError(
                    f"{spec.where}: pattern {pattern!r} matches no parameter of "
                    f"{type(root).__name__} (names look like {', '.join(names[:4])}): fix the "
                    "pattern; it is matched with re.match against full parameter names.")


def _decide(owners: List[Registered], specs: List[Optional[LayerSpec]], size: int,
            config: AutoTPConfig, actions: Actions) -> None:
    """The action for one parameter object, registered under one name or several (tied)."""
    actions.skipped.extend(r.name for r, s in zip(owners, specs)
                           if s is not None and s.partition_type == "skip")
    split = [(r, s) for r, s in zip(owners, specs) if s is not None and s.partition_type != "skip"]
    if not split:
        return
    linears = [(r, s) for r, s in split if isinstance(r.module, nn.Linear)]
    if len(owners) > 1:
        _decide_tied(owners, linears, split[0][0], size, config, actions)
    elif linears:
        actions.linears.append(_linear(*linears[0], size, config))
    elif isinstance(owners[0].module, nn.Embedding):
        _embedding_split(*split[0], size)
        actions.embeddings.append(owners[0])
    else:
        r, s = split[0]
        actions.fused.setdefault(r.module_name, []).append((r, s.partition_type,
                                                            _split(r, s, size)))


def _decide_tied(owners: List[Registered], linears: List[Tuple[Registered, LayerSpec]],
                 first: Registered, size: int, config: AutoTPConfig, actions: Actions) -> None:
    if not linears:
        others = ", ".join(r.name for r in owners if r is not first)
        raise ValueError(f"{first.name} is tied to {others} (one Parameter), which stays whole: "
                         "split the Linear layer sharing it too (a column spec over its "
                         "vocabulary, e.g. for lm_head), or none of them.")
    head, spec = linears[0]
    others = [r for r in owners if r is not head]
    if any(not isinstance(r.module, nn.Embedding) for r in others):
        names = ", ".join(r.name for r in others)
        raise ValueError(f"{head.name} is shared with {names}: a split Linear weight can be tied "
                         "only to input embeddings; untie the weights or keep them replicated.")
    split = _linear(head, spec, size, config)
    if split.kind != "column" or len(split.split.parts) != 1:
        raise ValueError(f"{head.name} is tied to the embedding {others[0].name}: it can only be "
                         "split over its vocabulary (a column spec without fused parts).")
    for r in others:
        _check_embedding_options(r.module)
    split.tied = others
    actions.linears.append(split)


def _split(r: Registered, spec: LayerSpec, size: int) -> SplitSpec:
    shape = tuple(r.param.shape)
    split = spec.split_for(r.name, shape)
    try:
        split.check(size)
    except ValueError as err:
        raise ValueError(f"{r.name} {shape} (matched by {spec.where}) in {r.module_name or 'the model'} "
                         f"({type(r.module).__name__}): {err}") from err
    return split


def _linear(r: Registered, spec: LayerSpec, size: int, config: AutoTPConfig) -> LinearSplit:
    want = {"column": 0, "row": 1}[spec.partition_type]
    if spec.dim != want:
        raise ValueError(f"{spec.where} splits {r.name} {tuple(r.param.shape)} along dim {spec.dim} "
                         f"as {spec.partition_type!r}: a Linear weight is [out, in], split on dim 0 "
                         "by 'column' and on dim 1 by 'row'; change partition_type or "
                         "partition_dim.")
    if not r.module_name:
        raise ValueError(f"{r.name}: the model itself is a Linear layer; AutoTP replaces layers "
                         "inside a model, wrap it in a module.")
    head = is_head(r.module_name, config.lm_head_patterns)
    split = _split(r, spec, size)
    if head and (spec.partition_type != "column" or len(split.parts) != 1):
        fused = f" into parts {split.parts}" if len(split.parts) > 1 else ""
        raise ValueError(f"{spec.where} splits the LM head {r.name} as {spec.partition_type!r}"
                         f"{fused}: an LM head is split over its vocabulary only (a column spec "
                         "without shape).")
    return LinearSplit(r, spec.partition_type, split, spec.gather_output, head)


def _embedding_split(r: Registered, spec: LayerSpec, size: int) -> SplitSpec:
    """Checks that ``spec`` splits an embedding over its vocabulary, as it can be."""
    _check_embedding_options(r.module)
    split = _split(r, spec, size)
    if spec.partition_type != "column" or split.dim != 0 or len(split.parts) != 1:
        raise ValueError(f"{spec.where} splits the embedding {r.name} {tuple(r.param.shape)} "
                         f"along dim {split.dim} with parts {split.parts}: an embedding is split "
                         "over its vocabulary only (a column spec, dim 0, without shape).")
    return split


def is_head(module_name: str, patterns: Sequence[str]) -> bool:
    """Whether the layer ``module_name`` is the LM head: a pattern matches its whole name
    or its last component."""
    last = module_name.rpartition(".")[2]
    return any(re.fullmatch(p, module_name) or re.fullmatch(p, last) for p in patterns)


def _check_fused(actions: Actions) -> None:
    """A split parameter outside Linear/Embedding layers is accepted only as part of a module
    whose own parameters are all split, column and row (a block of fused experts): its
    inputs then enter the group and its output is summed, as for a Linear pair."""
    for module_name, split in actions.fused.items():
        r = split[0][0]
        own = [a for a, _ in r.module.named_parameters(recurse=False)]
        kinds = {kind for _, kind, _ in split}
        if len(split) != len(own) or kinds != {"column", "row"}:
            raise ValueError(
                f"{r.name} {tuple(r.param.shape)} belongs to {type(r.module).__name__} "
                f"{module_name or '(the model)'}, not to an nn.Linear or nn.Embedding: other "
                f"parameters are split only when all of their module's parameters ({', '.join(own)}) "
                "are, with both a column and a row spec (fused experts). Change the pattern "
                "so that it does not match it, or make it a 'skip' spec.")


def _check_strict(params: List[Registered], matches: Dict[int, Optional[LayerSpec]],
                  config: AutoTPConfig) -> None:
    missed = [r.module_name for r in params
              if isinstance(r.module, nn.Linear) and r.attr == "weight" and matches[id(r)] is None
              and not is_head(r.module_name, config.lm_head_patterns)]
    if missed:
        more = f" and {len(missed) - 5} more" if len(missed) > 5 else ""
        raise ValueError(f"tensor_parallel.partition_config.strict_mode: no layer spec matches the "
                         f"Linear layer(s) {', '.join(missed[:5])}{more}: add a layer spec for them "
                         "(partition_type 'skip' keeps one replicated), or set strict_mode false.")


def _plan_head_counts(root: nn.Module, actions: Actions, size: int) -> None:
    """Head counts of the attention blocks whose projections are split become local."""
    seen = set()
    for split in actions.linears:
        parent_name = split.at.module_name.rpartition(".")[0]
        parent = root.get_submodule(parent_name) if parent_name else root
        if split.head or not parent_name or id(parent) in seen or not _is_attention(parent):
            continue
        seen.add(id(parent))
        for attr, count in _counts(parent):
            actions.head_counts.append((parent_name, parent, attr, _local(parent_name, attr,
                                                                          count, size)))
        config_counts = {a: _local(f"{parent_name}.config", a, c, size)
                         for a, c in _counts(getattr(parent, "config", None))}
        if config_counts:
            actions.config_counts.append((parent_name, parent, config_counts))


def _is_attention(module: nn.Module) -> bool:
    return hasattr(module, "head_dim") or bool(_counts(module))


def _counts(owner: object) -> List[Tuple[str, int]]:
    if owner is None:
        return []
    values = [(a, getattr(owner, a, None)) for a in HEAD_ATTRS]
    return [(a, v) for a, v in values if isinstance(v, int) and not isinstance(v, bool)]


def _local(where: str, attr: str, count: int, size: int) -> int:
    if count % size:
        raise ValueError(f"{where}.{attr} is {count}: {count} heads cannot be split over {size} "
                         f"tensor-parallel ranks; choose a tensor-parallel size that divides "
                         f"{count}.")
    return count // size
