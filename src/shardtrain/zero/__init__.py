"""ZeRO: sharding model states across data-parallel ranks.

Public: :class:`Init` (build a model already partitioned, for stage 3),
:class:`GatheredParameters` (gather partitioned parameters for a ``with`` block) and
:class:`ZeroParamStatus`, and the leaf-module marks of :mod:`shardtrain.zero.leaf`
(``set_z3_leaf_modules`` and friends: modules stage 3 gathers whole). The strategies (one per stage) are the engine's machinery.
"""
from ._params import GatheredParameters, ZeroParamStatus
from .init import Init
from .leaf import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                   set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)
from .stage0 import DataParallel, ReduceSettings
from .stage12 import ZeroStage1, ZeroStage2
from .stage3 import ZeroStage3

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "DataParallel", "ReduceSettings",
           "ZeroStage1", "ZeroStage2", "ZeroStage3", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "z3_leaf_module",
           "get_z3_leaf_modules"]
