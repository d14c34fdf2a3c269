"""``deepspeed.moe``: the parameter-group helpers. DeepSpeed's MoE layer (with expert
parallelism) is not provided; a model's own MoE block trains at ZeRO-3 as a leaf module
(``deepspeed.utils.set_z3_leaf_modules``)."""
from . import utils

__all__ = ["utils"]
