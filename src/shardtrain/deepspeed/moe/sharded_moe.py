"""``deepspeed.moe.sharded_moe``: the router, the layer's core and the gating functions with
DeepSpeed's signatures, over :mod:`shardtrain.moe` (its rules: docs/parallelism.md)."""
from typing import Optional

import torch

from shardtrain.moe import gating
from shardtrain.moe.layer import MOELayer, TopKGate, largest_over

__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating"]


def _agree_over(ep_group):
    """The largest of a value over ``ep_group`` (a torch process group or None)."""
    from shardtrain import comm
    return largest_over(None if ep_group is None else comm.Group.of(ep_group, "ep"))


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
               drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
               use_tutel: bool = False):
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-1 gating."""
    if use_tutel:
        raise NotImplementedError("top1gating(use_tutel=True): Tutel's kernels are not provided.")
    return gating.top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy,
                        drop_tokens, use_rts, agree=_agree_over(ep_group)).as_tuple()


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int,
               drop_tokens: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True):
    """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` of top-2 gating."""
    return gating.top2(logits, capacity_factor, min_capacity, drop_tokens,
                        top2_2nd_expert_sampling, agree=_agree_over(ep_group)).as_tuple()
