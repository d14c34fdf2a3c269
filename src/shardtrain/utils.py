"""Helpers found under ``deepspeed.utils`` in DeepSpeed scripts: the ZeRO-3 leaf-module marks
(defined in :mod:`shardtrain.zero.leaf`) and ``logger``, so that ``from deepspeed.utils import
set_z3_leaf_modules, logger`` reads ``from shardtrain.utils import ...``."""
from .log import logger
from .zero.leaf import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                        set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["logger", "set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "z3_leaf_module", "get_z3_leaf_modules"]
