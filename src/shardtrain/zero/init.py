"""``zero.Init``: build a model already partitioned, so it never exists whole on a rank."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from ._params import GatheredParameters, is_partitioned, partition

__all__ = ["Init"]


class Init:
    """A context under which each module's parameters are partitioned as soon as the module
    is built: at most one module's full parameters exist at a time on any rank.

    Initialisation is the same as a plain build with the same seed: each module's own
    ``__init__`` runs on full tensors, then rank 0's values are broadcast and sharded; a
    later ``module.apply(fn)`` (the usual way models re-initialise their weights) gathers
    each module's parameters around ``fn``. Code that writes parameters outside ``apply``
    must use :class:`GatheredParameters` with ``modifier_rank``.

    Args:
        module: partition an already built model instead of using a ``with`` block.
        config, config_dict_or_path: accepted for DeepSpeed compatibility (the engine reads
            the dtype and stage from its own config).
        enabled: False makes it a no-op.
        dtype: cast parameters to this dtype as they are partitioned.

    Example:
        >>> with shardtrain.zero.Init():
        ...     model = GPT(config)            # each rank keeps 1/N of every weight
        >>> engine, *_ = shardtrain.initialize(model=model, config={"zero_optimization":
        ...                                    {"stage": 3}, ...})
    """

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device=None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu=None):
        if data_parallel_group is not None or mpu is not None:
            raise NotImplementedError("zero.Init: custom process groups are not supported; "
                                      "the world group is used.")
        del mem_efficient_linear, remote_device, pin_memory, config_dict_or_path, config
        self.enabled, self.dtype = enabled, dtype
        self._patched: Dict[type, Callable] = {}
        self._apply = None
        self._subclass_hook = None
        if enabled:
            comm.init_distributed()
        if module is not None and enabled:
            self._partition_tree(module)

    def _partition_tree(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if not is_partitioned(p):
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                partition(p, comm.WORLD, src=0)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        for cls in _all_module_classes():
            self._wrap(cls)
        self._apply = torch.nn.Module.apply
        torch.nn.Module.apply = _gathered_apply
        self._subclass_hook = torch.nn.Module.__dict__.get("__init_subclass__")
        torch.nn.Module.__init_subclass__ = classmethod(_make_subclass_hook(self))
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()
        torch.nn.Module.apply = self._apply
        if self._subclass_hook is not None:
            torch.nn.Module.__init_subclass__ = self._subclass_hook
        else:
            del torch.nn.Module.__init_subclass__

    def _wrap(self, cls: type) -> None:
        if cls in self._patched or "__init__" not in cls.__dict__:
            return
        original = cls.__dict__["__init__"]
        init = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            depth = module.__dict__.get("_zero_init_depth", 0)
            module.__dict__["_zero_init_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_zero_init_depth"] = depth
            if depth == 0:  # the outermost __init__ of this object has finished
                del module.__dict__["_zero_init_depth"]
                init._partition_tree(module)

        self._patched[cls] = original
        cls.__init__ = wrapped


def _all_module_classes() -> List[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


def _make_subclass_hook(init: Init):
    def hook(cls, **kwargs):
        init._wrap(cls)  # classes defined inside the block are partitioned too
    return hook


def _gathered_apply(self: torch.nn.Module, fn):
    """``Module.apply`` under ``Init``: each module's parameters are whole while ``fn`` runs,
    and rank 0's result is kept (as a plain build would have it)."""
    for child in self.children():
        child.apply(fn)
    with GatheredParameters(list(self.parameters(recurse=False)), modifier_rank=0):
        fn(self)
    return self
