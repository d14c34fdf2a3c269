"""Optimizers and learning-rate schedulers built from DeepSpeed-style config blocks.

This package turns the ``optimizer`` and ``scheduler`` blocks of a DeepSpeed config
(``{"type": ..., "params": {...}}``) into plain PyTorch objects:

* :func:`build_optimizer` maps the DeepSpeed optimizer names (``adam``, ``adamw``,
  ``adagrad``; case-insensitive) onto ``torch.optim`` classes with DeepSpeed's
  defaults, and falls back to ``torch.optim.<type>`` for any other name.
* :class:`MuonWithAuxAdam` is what ``"type": "Muon"`` builds: Muon for the 2-D weights, AdamW
  for the rest; it takes the whole of each matrix's update even where this rank holds a slice
  (:meth:`MuonWithAuxAdam.bind`).
* :class:`WarmupLR`, :class:`WarmupDecayLR`, :class:`WarmupCosineLR`,
  :class:`OneCycle` and :class:`LRRangeTest` reproduce DeepSpeed's schedule
  formulas. They count ``last_batch_iteration`` from -1, write the construction
  learning rate into the optimizer immediately and keep only
  ``{"last_batch_iteration": t}`` in their state dict.
* :func:`build_scheduler` builds one of those five by name, or any
  ``torch.optim.lr_scheduler`` class.

This package is the public face; its modules are private and each holds one idea:
``_muon`` is Muon; ``_spec`` reads a block and checks its ``params`` against the class that receives them (shared
by both factories); ``_optimizers`` is the optimizer factory; ``_schedule`` is what every
schedule shares (the counter, stepping, the state dict); ``_warmup`` and ``_cyclic`` hold the
schedule formulas; ``_schedulers`` is the scheduler factory.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = build_optimizer({"type": "Adam", "params": {"lr": 0.01}}, model.parameters())
    >>> sched = build_scheduler(
    ...     {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}, opt)
    >>> opt.param_groups[0]["lr"]
    0.0
"""
from __future__ import annotations

from ._cyclic import LRRangeTest, OneCycle
from ._muon import MuonWithAuxAdam, uses_muon
from ._optimizers import DS_OPTIMIZER_NAMES, build_optimizer
from ._schedulers import DS_SCHEDULER_NAMES, build_scheduler
from ._warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

# The type of build_optimizer's ``params``, importable from here outside __all__.
from ._optimizers import ParamsLike as ParamsLike

__all__ = [
    "DS_OPTIMIZER_NAMES",
    "DS_SCHEDULER_NAMES",
    "build_optimizer",
    "build_scheduler",
    "MuonWithAuxAdam",
    "uses_muon",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]

# The public classes and functions name this package as their home, as they did when it was one
# module: a pickled schedule and a traceback refer to ``shardtrain.optim.WarmupLR``, a path that
# stays put however the private modules are arranged.
for _name in __all__:
    _public = globals()[_name]
    if callable(_public):
        _public.__module__ = __name__
del _name, _public
