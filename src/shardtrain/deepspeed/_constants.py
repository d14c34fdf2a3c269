"""The ``__all__`` of a module of DeepSpeed's constants.

DeepSpeed's modules of constants have no ``__all__``, so ``from deepspeed.runtime.config import *``
hands a script every upper-case name. The alias's modules write each constant out as a plain
assignment (so that static readers and ``from ... import NAME`` see it) and list them in
``__all__`` with :func:`constant_names` rather than by hand a second time.
"""
from __future__ import annotations

from typing import Any, Dict, List

#: the types a DeepSpeed constant has: key names, defaults, lists of allowed values
_PLAIN = (str, int, float, bool, type(None), list, tuple)


def constant_names(namespace: Dict[str, Any]) -> List[str]:
    """The upper-case names of plain values in ``namespace`` (a module's ``globals()``), in the
    order they were defined."""
    return [name for name, value in namespace.items()
            if name.isupper() and not name.startswith("_") and isinstance(value, _PLAIN)]
