"""``deepspeed.module_inject.layers``: ``set_autotp_mode``, which AutoTP training scripts call
before building the model, and DeepSpeed's AutoTP layer classes as stand-ins.

shardtrain's tensor-parallel layers are its own (``shardtrain.parallel.ColumnParallelLinear``,
``RowParallelLinear``), built by ``initialize`` from the config's ``tensor_parallel`` block;
``LinearLayer`` and ``LinearAllreduce`` are here so that code which imports them to recognise
DeepSpeed's layers (``isinstance(m, LinearLayer)``, always False) keeps working.
"""
from .._missing import unsupported_class
from .._autotp import set_autotp_mode

__all__ = ["set_autotp_mode", "LinearLayer", "LinearAllreduce"]

_FEATURE = "DeepSpeed's AutoTP layer classes"
_INSTEAD = ("tensor_parallel.autotp_size in the config (initialize splits the model); for a layer "
            "of your own, shardtrain.parallel.ColumnParallelLinear / RowParallelLinear"
            ".from_linear(linear, group)")
LinearLayer = unsupported_class("deepspeed.module_inject.layers.LinearLayer", _FEATURE, _INSTEAD)
LinearAllreduce = unsupported_class("deepspeed.module_inject.layers.LinearAllreduce", _FEATURE, _INSTEAD)
