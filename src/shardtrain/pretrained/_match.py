"""Which tensor of the model each tensor of the file fills, checked before anything is read.

The model's names are its ``state_dict`` names (parameters and persistent buffers), taken
with ``keep_vars=True`` so that nothing is gathered or copied: a ZeRO-3 parameter answers
with itself, and its layout record (:func:`shardtrain.layout.layout_of`) gives its full
shape; a tensor-parallel slice is matched against the unsplit tensor the file holds. A tensor
the model holds under several names (tied weights: an embedding shared with the output layer)
is one :class:`Target` with all its names; it loads once, from the first of its names the
file holds, and the others are neither missing nor unexpected (``save_pretrained`` writes a
tied weight once). An expert of a layer whose experts are split over ranks goes by its name
in the unsplit model (its global index), and the experts other ranks hold are not
unexpected; experts stacked in one weight also load from a file that holds each expert apart
(the Hub's layout, :mod:`._experts`).

Every check runs here, before any value is read, so a refused load leaves the model as it
was, and every rank refuses the same way (each reads the same headers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..layout import layout_of
from ._experts import per_expert_sources, renamed
from ._files import WeightFiles


@dataclass
class Target:
    """One tensor of the model: its names and the name in the file it loads from."""

    tensor: torch.Tensor
    names: List[str]
    source: Optional[str] = None  # None: the file holds none of its names
    # stacked experts the file holds one by one: each expert's tensors, concatenated along
    # their first dimension (``source`` is the first of them)
    parts: Optional[List[List[str]]] = None

    @property
    def full_shape(self) -> Tuple[int, ...]:
        """The shape the file holds: the unsplit tensor of a tensor-parallel slice
        (``layout_of(t).tp``), the whole of a ZeRO-3 partitioned one."""
        return layout_of(self.tensor).full_shape


@dataclass
class Match:
    """The model's tensors against the file's: what loads, and the names one side lacks."""

    targets: List[Target]
    missing: List[str] = field(default_factory=list)     # the model's, not in the file
    unexpected: List[str] = field(default_factory=list)  # the file's, not in the model

    @property
    def loading(self) -> List[Target]:
        return [t for t in self.targets if t.source is not None]


def match(module: torch.nn.Module, files: WeightFiles) -> Match:
    """Pairs ``module``'s tensors with the file's names (see the module docstring)."""
    by_tensor: Dict[int, Target] = {}
    others = set()  # the experts other ranks of an expert-parallel group hold
    for name, tensor in module.state_dict(keep_vars=True).items():
        target = by_tensor.setdefault(id(tensor), Target(tensor, []))
        split = layout_of(tensor).expert
        if split is not None and not split.stacked:  # the file names it by its global index
            others.update(split.global_name(name, r) for r in range(split.ep_size))
            name = split.global_name(name)
        target.names.append(name)
    targets = list(by_tensor.values())
    for t in targets:
        t.source = next((n for n in t.names if n in files.tensors), None)
        if t.source is None:  # a Hub checkpoint: Mixtral's block name, experts one by one
            t.source = next((r for n in t.names for r in [renamed(n, files.tensors)] if r), None)
        if t.source is None and len(t.full_shape) == 3:  # partitioned: the whole's shape
            experts = t.full_shape[0]
            t.parts = next((p for n in t.names
                            for p in [per_expert_sources(n, experts, files.tensors)] if p), None)
            t.source = t.parts[0][0] if t.parts else None
    known = others | {n for t in targets for n in t.names} | {
        n for t in targets for n in ([t.source] if t.source else [])
        + [p for expert in t.parts or [] for p in expert]}
    return Match(targets,
                 missing=[n for t in targets if t.source is None for n in t.names],
                 unexpected=[n for n in files.tensors if n not in known])


def refuse_mismatches(found: Match, files: WeightFiles) -> None:
    """Shapes must be equal; dtypes equal, or both floating point (the value is cast)."""
    for t in found.loading:
        info = files.tensors[t.source]
        if t.parts is not None:
            _refuse_expert_shapes(t, files)
        elif info.shape != t.full_shape:
            raise ValueError(
                f"{info.file}: {t.source!r} has shape {list(info.shape)} in the file but "
                f"{list(t.full_shape)} in the model: the checkpoint is of another model or "
                "configuration; build the model from the checkpoint's own config (its "
                "config.json), or leave the tensor out of the file.")
        model_dtype = t.tensor.dtype
        if info.dtype != model_dtype and not (info.dtype.is_floating_point
                                              and model_dtype.is_floating_point):
            raise ValueError(
                f"{info.file}: {t.source!r} is {info.dtype} in the file but {model_dtype} in "
                "the model, and only floating-point values are cast: the checkpoint is of "
                "another model; build the model the checkpoint was saved from.")


def _refuse_expert_shapes(t: Target, files: WeightFiles) -> None:
    """Each expert's tensors, joined along their first dimension, must be one row of the
    stacked weight."""
    row = tuple(t.full_shape[1:])
    for expert in t.parts:
        shapes = [tuple(files.tensors[n].shape) for n in expert]
        joined = (sum(s[0] for s in shapes),) + shapes[0][1:]
        if any(s[1:] != shapes[0][1:] for s in shapes) or joined != row:
            raise ValueError(
                f"{files.tensors[expert[0]].file}: {expert} (shapes {shapes}) do not make a "
                f"row {list(row)} of {t.names[0]!r} {list(t.full_shape)}: the checkpoint is "
                "of another model or configuration; build the model from its config.json.")


def refuse_differences(found: Match, files: WeightFiles) -> None:
    """``strict=True``: every name of one side must be on the other."""
    if not found.missing and not found.unexpected:
        return
    parts = []
    if found.missing:
        parts.append(f"missing from the file: {_names(found.missing)}")
    if found.unexpected:
        parts.append(f"in the file but not in the model: {_names(found.unexpected)}")
    raise ValueError(
        f"load_pretrained({str(files.source)!r}, strict=True): the names differ; "
        f"{'; '.join(parts)}. Nothing was loaded. If the difference is expected (a new head, "
        "a file of a larger model), pass strict=False: the names both sides have are loaded "
        "and the call returns the two lists.")


def _names(names: List[str], shown: int = 20) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} ({', '.join(names[:shown])}{more})"
