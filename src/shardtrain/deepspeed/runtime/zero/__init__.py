"""``deepspeed.zero`` (``deepspeed.runtime.zero``): ZeRO-3 parameter tools.

Example:
    >>> with deepspeed.zero.Init():
    ...     model = build()                       # each rank keeps 1/N of every weight
    >>> with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
    ...     ...
"""
from ....zero import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                      set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)
from . import config, offload_config, offload_states, partition_parameters
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus,
                                   register_external_parameter, unregister_external_parameter)
from ..._missing import unsupported_class

MiCS_Init = unsupported_class("deepspeed.zero.MiCS_Init", "MiCS hierarchical partitioning",
                              "deepspeed.zero.Init")
TiledLinear = unsupported_class("deepspeed.zero.TiledLinear", "tiled linear layers",
                                "torch.nn.Linear with ZeRO-3 (each layer is gathered on its own)")
TiledLinearReturnBias = unsupported_class("deepspeed.zero.TiledLinearReturnBias",
                                          "tiled linear layers", "torch.nn.Linear")
ZeroOptimizer = unsupported_class("deepspeed.zero.ZeroOptimizer", "DeepSpeed's ZeRO optimizer wrapper",
                                  "deepspeed.initialize(), whose engine.optimizer is the torch optimizer")

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "partition_parameters", "config", "offload_config",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "z3_leaf_module", "get_z3_leaf_modules", "MiCS_Init",
           "TiledLinear", "TiledLinearReturnBias", "ZeroOptimizer", "offload_states"]
