"""``deepspeed.utils``: the logger, the ZeRO-3 leaf-module marks, full-tensor access to
sharded parameters, gradients and optimizer states (``safe_get_full_*``/``safe_set_full_*``),
``zero_to_fp32`` and ``OnDevice``."""
from ...zero.leaf import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                          set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)
from ..compression.helper import recursive_getattr, recursive_setattr
from ..runtime.dataloader import RepeatingLoader
from . import groups, logging, zero_to_fp32
from ._init_on_device import OnDevice
from ._tensors import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                       safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                       safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                       safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state)
from .logging import log_dist, log_dist_once, logger, set_log_level_from_string

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "logging", "groups",
           "zero_to_fp32", "OnDevice", "RepeatingLoader", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "z3_leaf_module",
           "get_z3_leaf_modules", "recursive_getattr", "recursive_setattr",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]
