"""Which tensor of the model each tensor of the file fills, checked before anything is read.

The model's names are its ``state_dict`` names (parameters and persistent buffers), taken
with ``keep_vars=True`` so that nothing is gathered or copied: a ZeRO-3 parameter answers
with itself, and its layout record (:func:`shardtrain.layout.layout_of`) gives its full
shape; a tensor-parallel slice is matched against the unsplit tensor the file holds. A tensor
the model holds under several names (tied weights: an embedding shared with the output layer)
is one :class:`Target` with all
its names; it loads once, from the first of its names the file holds, and the others are
neither missing nor unexpected (``save_pretrained`` writes a tied weight once).

Every check runs here, before any value is read, so a refused load leaves the model as it
was, and every rank refuses the same way (each reads the same headers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..layout import layout_of
from ._files import WeightFiles


@dataclass
class Target:
    """One tensor of the model: its names and the name in the file it loads from."""

    tensor: torch.Tensor
    names: List[str]
    source: Optional[str] = None  # None: the file holds none of its names

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
    for name, tensor in module.state_dict(keep_vars=True).items():
        target = by_tensor.setdefault(id(tensor), Target(tensor, []))
        target.names.append(name)
    targets = list(by_tensor.values())
    for t in targets:
        t.source = next((n for n in t.names if n in files.tensors), None)
    known = {n for t in targets for n in t.names}
    return Match(targets,
                 missing=[n for t in targets if t.source is None for n in t.names],
                 unexpected=[n for n in files.tensors if n not in known])


def refuse_mismatches(found: Match, files: WeightFiles) -> None:
    """Shapes must be equal; dtypes equal, or both floating point (the value is cast)."""
    for t in found.loading:
        info = files.tensors[t.source]
        if info.shape != t.full_shape:
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
