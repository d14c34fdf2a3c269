"""``deepspeed.module_inject``: the few names of DeepSpeed's kernel injection and AutoTP that
training scripts import; the rest of the package is refused, naming the feature.

shardtrain applies AutoTP in ``initialize`` from the config (``tensor_parallel.autotp_size``,
docs/parallelism.md); kernel injection (``replace_transformer_layer``) belongs to
DeepSpeed-Inference and is not provided.
"""
from .._missing import unsupported_function
from . import layers
from .layers import LinearAllreduce, LinearLayer, set_autotp_mode

__all__ = ["layers", "set_autotp_mode", "LinearLayer", "LinearAllreduce", "replace_transformer_layer"]

replace_transformer_layer = unsupported_function("deepspeed.module_inject.replace_transformer_layer",
                                                 "kernel injection", "the model's own layers")
