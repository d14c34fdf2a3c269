"""How ``import deepspeed`` reaches this tree: the module ``deepspeed`` *is*
``shardtrain.deepspeed``, and ``deepspeed.X.Y`` *is* ``shardtrain.deepspeed.X.Y``.

The alias distribution (``shardtrain deepspeed-alias install``) ships a one-file package
``deepspeed`` that calls :func:`install`. Two things make the names one and the same object:

* ``sys.modules["deepspeed"]`` is replaced by ``shardtrain.deepspeed`` while the alias
  package is being imported, so the import statement hands back this tree's package;
* a finder at the front of ``sys.meta_path`` answers every ``deepspeed.*`` import with the
  module of the same path under ``shardtrain.deepspeed``, imported under its own name.
  Without it, Python would load ``shardtrain/deepspeed/comm.py`` a second time under the name
  ``deepspeed.comm``, and its classes (``ZeroParamStatus``, ``DeepSpeedEngine``) would exist
  twice, so ``isinstance`` and ``is`` checks between the two spellings would fail.

A DeepSpeed module this tree does not provide raises ``ModuleNotFoundError`` (an
``ImportError``, which libraries that probe for optional parts already catch) whose message
names the feature and what to use instead.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Optional

from ._missing import is_listed_missing, missing_module_message

_TARGET = "shardtrain.deepspeed"
#: top-level names that DeepSpeed defines as attributes of other modules' objects
_REMAP = {"zero": "runtime.zero", "checkpointing": "runtime.activation_checkpointing.checkpointing"}


class _Loader(importlib.abc.Loader):
    """Hands out the already-imported module of the real path."""

    def __init__(self, real: str):
        self._real = real

    def create_module(self, spec):
        return importlib.import_module(self._real)

    def exec_module(self, module) -> None:
        pass  # imported by create_module under its own name; nothing to run twice


class _Refusal(importlib.abc.Loader):
    """A DeepSpeed module that is not provided: importing it raises with the reason."""

    def __init__(self, name: str):
        self._name = name

    def create_module(self, spec):
        raise ModuleNotFoundError(missing_module_message(self._name), name=self._name)

    def exec_module(self, module) -> None:  # pragma: no cover - create_module raised
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, alias: str):
        self.alias = alias

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.startswith(_TARGET + "."):
            # ``from deepspeed.utils import groups`` looks for shardtrain.deepspeed.utils.groups
            # (the package's real name): a module listed as missing is refused with its reason
            # under the name the user wrote.
            alias_name = self.alias + fullname[len(_TARGET):]
            if is_listed_missing(alias_name) and not _exists_on_disk(fullname):
                return importlib.machinery.ModuleSpec(fullname, _Refusal(alias_name))
            return None
        if not fullname.startswith(self.alias + "."):
            return None
        rest = fullname[len(self.alias) + 1:]
        head, dot, tail = rest.partition(".")
        real = f"{_TARGET}.{_REMAP.get(head, head)}{dot}{tail}"
        if _exists(real):
            return importlib.machinery.ModuleSpec(fullname, _Loader(real),
                                                  is_package=_is_package(real))
        return importlib.machinery.ModuleSpec(fullname, _Refusal(fullname))


def _exists(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _exists_on_disk(name: str) -> bool:
    """Whether the path-based finders have the module (this finder left out)."""
    parent = sys.modules.get(name.rpartition(".")[0])
    paths = getattr(parent, "__path__", None)
    return paths is not None and importlib.machinery.PathFinder.find_spec(name, paths) is not None


def _is_package(name: str) -> bool:
    module = sys.modules.get(name)
    if module is not None:
        return hasattr(module, "__path__")
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def install(alias: str = "deepspeed") -> None:
    """Makes ``alias`` and its submodules the modules of ``shardtrain.deepspeed``.

    Called by the alias package's ``__init__``; safe to call more than once.
    """
    if not any(isinstance(f, _Finder) and f.alias == alias for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(alias))
    sys.modules[alias] = importlib.import_module(_TARGET)


def active_alias() -> Optional[str]:
    """The module name this tree is installed under (``"deepspeed"``), or None."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            return finder.alias
    return None
