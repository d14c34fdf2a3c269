"""``deepspeed.moe.layer``: the mixture-of-experts layer (:class:`shardtrain.moe.MoE`)."""
from shardtrain.moe.layer import MoE

__all__ = ["MoE"]
