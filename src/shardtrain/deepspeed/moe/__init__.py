"""``deepspeed.moe``: the mixture-of-experts layer with expert parallelism (``layer.MoE``),
its experts, router and gating functions (``experts``, ``sharded_moe``) and the
parameter-group helpers (``utils``), over :mod:`shardtrain.moe`."""
from . import experts, layer, sharded_moe, utils

__all__ = ["experts", "layer", "sharded_moe", "utils"]
