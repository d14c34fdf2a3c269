"""``deepspeed.compression.helper``: dotted-name access to submodules."""
from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: torch.nn.Module, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model: torch.nn.Module, module_name: str, module: Any) -> None:
    """Sets ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
