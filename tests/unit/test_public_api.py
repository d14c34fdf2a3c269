"""The public surface, frozen: every public module's names and the engine's public members.

A module is public when no part of its dotted name starts with ``_``. Each must list its
names in ``__all__``, every name there must exist, and everything it defines itself that
is not in ``__all__`` must be ``_private``. The names of every public module and the
signatures of the engine's public members are compared with ``public_api.json``: a change
to the public surface is a deliberate act, made by regenerating the snapshot with

    python tests/unit/test_public_api.py --update

and reviewing its diff.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import sys
from pathlib import Path
from typing import Dict, List

import torch

import shardtrain

SNAPSHOT = Path(__file__).with_name("public_api.json")
UPDATE = "python tests/unit/test_public_api.py --update"


def public_modules() -> List[str]:
    names = ["shardtrain"]
    for info in pkgutil.walk_packages(shardtrain.__path__, "shardtrain."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def defined_here(module) -> List[str]:
    """Classes and functions the module defines itself (not ones it imports)."""
    return sorted(name for name, value in vars(module).items()
                  if (inspect.isclass(value) or inspect.isfunction(value))
                  and getattr(value, "__module__", None) == module.__name__)


def engine_members() -> Dict[str, str]:
    """The engine's public members that shardtrain defines (``torch.nn.Module``'s own are
    torch's surface), each as its kind and signature."""
    own = [cls for cls in shardtrain.Engine.__mro__
           if cls.__module__.startswith("shardtrain")]
    out = {}
    for cls in own:
        for name, value in vars(cls).items():
            if name.startswith("_") or name in out:
                continue
            if isinstance(value, property):
                out[name] = "property" + (" (settable)" if value.fset else "")
            elif isinstance(value, staticmethod):
                out[name] = f"staticmethod{inspect.signature(value.__func__)}"
            elif callable(value):
                out[name] = f"method{inspect.signature(value)}"
            else:
                out[name] = f"attribute {type(value).__name__}"
    return dict(sorted(out.items()))


def current() -> Dict[str, object]:
    modules = {name: sorted(getattr(importlib.import_module(name), "__all__", []))
               for name in public_modules()}
    return {"modules": modules, "engine": engine_members()}


def test_every_public_module_lists_its_names():
    for name in public_modules():
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} has no __all__: list its public names"
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not have: {missing}"
        unlisted = [n for n in defined_here(module)
                    if not n.startswith("_") and n not in module.__all__]
        assert not unlisted, (f"{name} defines {unlisted} outside __all__: add them to "
                              "__all__ if they are public, else prefix them with '_'")


def test_public_surface_matches_the_snapshot():
    saved, now = json.loads(SNAPSHOT.read_text()), current()
    for kind in ("modules", "engine"):
        added = {k: now[kind][k] for k in now[kind] if saved[kind].get(k) != now[kind][k]}
        removed = {k: saved[kind][k] for k in saved[kind] if now[kind].get(k) != saved[kind][k]}
        assert not added and not removed, (
            f"the public surface changed ({kind}): now {added}, was {removed}. If that is "
            f"intended, run `{UPDATE}` and review the diff.")


def test_engine_public_members_are_documented():
    undocumented = [name for name in engine_members()
                    if not inspect.getdoc(getattr(shardtrain.Engine, name))]
    assert not undocumented, f"Engine members without a docstring: {undocumented}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {UPDATE}")
    torch.set_num_threads(1)
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
