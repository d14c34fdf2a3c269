"""``deepspeed.moe.experts``: the local experts of a MoE layer (:class:`shardtrain.moe.Experts`)."""
from shardtrain.moe.layer import Experts

__all__ = ["Experts"]
