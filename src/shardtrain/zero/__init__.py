"""ZeRO: sharding model states across data-parallel ranks.

Public: :class:`Init` (build a model already partitioned, for stage 3),
:class:`GatheredParameters` (gather partitioned parameters for a ``with`` block),
:class:`ZeroParamStatus`, and the leaf-module marks of :mod:`shardtrain.zero.leaf`
(``set_z3_leaf_modules`` and friends: modules stage 3 gathers whole),
:func:`set_state_dict_gather` (whether ``module.state_dict()`` gathers at stage 3), and
:mod:`shardtrain.zero.values`: how other rooms read and write a partitioned parameter's
values (where it lives is :func:`shardtrain.layout.layout_of`'s record).

The engine's machinery is :mod:`shardtrain.zero.strategy`: one :class:`~.strategy.Strategy`
per engine, assembled per stage from private parts (a gradient reducer, an optimizer view,
an after-step gatherer and, at stage 3, a parameter schedule) that move data with the free
functions of ``_collectives``.
"""
from ._access import set_state_dict_gather
from ._groups import GATHERING
from ._in_graph import PASSES, gathered_bytes
from ._params import GatheredParameters, ZeroParamStatus
from . import values  # noqa: F401  (shardtrain.zero.values, public)
from .init import Init
from .leaf import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                   set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["Init", "GatheredParameters", "GATHERING", "ZeroParamStatus", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "z3_leaf_module", "get_z3_leaf_modules", "set_state_dict_gather", "PASSES",
           "gathered_bytes"]
