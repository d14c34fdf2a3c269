"""ZeRO-3 leaf modules: modules gathered whole, children included, by one all-gather.

At stage 3 each module is gathered before its forward by default. A *leaf* module is
gathered as one unit with everything inside it, and only the leaf itself carries hooks.
That helps in two cases:

* a mixture-of-experts block whose experts differ from rank to rank (the gathers are
  collectives, so every rank must run the same modules: it does, the leaf);
* a model of many small modules, where one gather per module costs more in latency and
  hooks than it saves in memory.

Modules are marked with :func:`set_z3_leaf_modules` (by class), by name, by name suffix,
through the ``zero_optimization.leaf_module`` config block, or automatically with
``zero_optimization.stage3_module_granularity_threshold``. Marks are read when the engine
is built.
"""
from __future__ import annotations

import logging
import sys
from typing import Dict, List, Sequence, Tuple, Type, Union

import torch

from ..log import log_dist
from ._shards import full_numel

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "z3_leaf_module", "get_z3_leaf_modules",
           "apply_config", "granularity", "mark_by_granularity", "outermost_leaves"]

_FLAG = "_z3_leaf"  # the attribute DeepSpeed reads too, so marks made by either are seen by both
#: Above this many parameter elements a module is never made a leaf by the threshold: one
#: gather of it would hold too much at once.
_MAX_LEAF_NUMEL = 10 ** 9
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict)

ClassSpec = Union[Type[torch.nn.Module], str]


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked as a leaf."""
    return bool(getattr(module, _FLAG, False))


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` marked as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module: torch.nn.Module, spec: ClassSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    cls = getattr(cls, "_zero_original_class", cls)  # a class the engine derived for stage 3
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark_classes(model: torch.nn.Module, classes: Sequence[ClassSpec], flag: bool,
                  raise_if_not_found: bool) -> List[torch.nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names; got {bad!r}.")
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    for m in found:
        setattr(m, _FLAG, flag)
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {', '.join(names)} in {type(model).__name__}; check the class "
                         "names (a class name or 'package.module.Class').")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[ClassSpec],
                        raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Marks every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or names: ``"Block"`` or ``"package.module.Block"``) as a leaf; returns them.
    Raises ValueError when nothing matches, unless ``raise_if_not_found`` is False."""
    return _mark_classes(model, list(leaf_module_classes), True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[ClassSpec],
                          raise_if_not_found: bool = True) -> List[torch.nn.Module]:
    """Takes the leaf mark off the modules of those classes; returns them."""
    return _mark_classes(model, list(leaf_module_classes), False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True
                                ) -> Tuple[List[torch.nn.Module], List[str]]:
    """Marks the modules named (as in ``model.named_modules()``); returns them and the names
    that matched nothing (a ValueError instead, when ``raise_if_not_found``)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {', '.join(map(repr, missing))} in {type(model).__name__}; "
                         "names are those of model.named_modules().")
    for m in found:
        setattr(m, _FLAG, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Sequence[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> Tuple[List[torch.nn.Module], List[str]]:
    """Marks the modules whose name ends with one of the suffixes; returns them and the
    suffixes that matched nothing."""
    named = list(model.named_modules())
    found: Dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        found.update((id(m), m) for m in hits)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {', '.join(map(repr, missing))} in "
                         f"{type(model).__name__}.")
    for m in found.values():
        setattr(m, _FLAG, flag)
    return list(found.values()), missing


# -- what the engine calls ------------------------------------------------------------------------


def apply_config(model: torch.nn.Module, leaf_config, granularity_threshold: int) -> None:
    """Marks leaves from the ``leaf_module`` block and the granularity threshold; logs on
    rank 0 what matched, and warns when a setting of the user's matched nothing."""
    from ..config import DEFAULT_LEAF_MODULE_CLASSES
    matched = _mark_classes(model, leaf_config.classes, True, raise_if_not_found=False)
    custom_classes = list(leaf_config.classes) != list(DEFAULT_LEAF_MODULE_CLASSES)
    if leaf_config.classes and custom_classes and not matched:
        _warn(f"zero_optimization.leaf_module.classes {leaf_config.classes} matched no module of the model.")
    _, missing = set_z3_leaf_modules_by_name(model, leaf_config.names, raise_if_not_found=False)
    if missing:
        _warn(f"zero_optimization.leaf_module.names: no module named {missing}.")
    _, missing = set_z3_leaf_modules_by_suffix(model, leaf_config.name_suffixes, raise_if_not_found=False)
    if missing:
        _warn(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {missing}.")
    if granularity_threshold > 0:
        mark_by_granularity(model, granularity_threshold)


def _warn(message: str) -> None:
    log_dist(message, ranks=[0], level=logging.WARNING)


def granularity(model: torch.nn.Module) -> Dict[int, Tuple[int, int]]:
    """``id(module) -> (granularity, layers)`` for every module of ``model``: its parameter
    elements (children included) per layer, where each module with parameters counts as a
    layer. Modules that cannot be leaves get ``sys.maxsize``: those without parameters,
    those without children (nothing to merge), containers (they may never be called), and
    modules above 10^9 elements."""
    table: Dict[int, Tuple[int, int]] = {}

    def visit(m: torch.nn.Module) -> Tuple[int, int]:  # (layers, elements) in m's subtree
        if next(m.parameters(), None) is None:
            table[id(m)] = (sys.maxsize, 0)
            return 0, 0
        own = sum(full_numel(p) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            table[id(m)] = (sys.maxsize, 1)
            return 1, own
        layers, numel = 0, own
        for child in children:
            child_layers, child_numel = visit(child)
            layers, numel = layers + child_layers, numel + child_numel
        if isinstance(m, _CONTAINERS):
            table[id(m)] = (sys.maxsize, layers)
            return layers, numel
        layers += 1
        table[id(m)] = (numel // layers if numel <= _MAX_LEAF_NUMEL else sys.maxsize, layers)
        return layers, numel

    visit(model)
    return table


def mark_by_granularity(model: torch.nn.Module, threshold: int) -> List[torch.nn.Module]:
    """Marks, from the root down, each module whose granularity is at most ``threshold`` (its
    children are then inside it and not looked at); returns the marked modules."""
    table = granularity(model)
    marked: List[torch.nn.Module] = []

    def descend(m: torch.nn.Module) -> None:
        value, _ = table[id(m)]
        if value <= threshold:
            setattr(m, _FLAG, True)
            marked.append(m)
            return
        for child in m.children():
            descend(child)

    descend(model)
    if not marked:
        finest = min(((v, type(m).__name__) for m in model.modules() for v in [table[id(m)][0]]),
                     default=(sys.maxsize, ""))
        hint = (f"the finest module is a {finest[1]} with {finest[0]} elements per layer; set it to at "
                f"least {finest[0]} to merge it") if finest[0] < sys.maxsize else \
            "no module of this model can be merged (each needs parameters and children)"
        _warn(f"zero_optimization.stage3_module_granularity_threshold {threshold} makes no module a leaf: "
              f"{hint}.")
    else:
        log_dist(f"stage3_module_granularity_threshold {threshold}: {len(marked)} leaf modules "
                 f"({', '.join(sorted({type(m).__name__ for m in marked}))})")
    return marked


def outermost_leaves(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The marked modules that are not inside another marked module."""
    found: List[torch.nn.Module] = []

    def descend(m: torch.nn.Module) -> None:
        if z3_leaf_module(m):
            found.append(m)
            return
        for child in m.children():
            descend(child)

    descend(model)
    return found
