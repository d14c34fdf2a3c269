"""Mixtures of experts with expert parallelism: DeepSpeed's ``MoE`` layer (top-1 and top-2
gating, capacity and token dropping or dropless routing, residual MoE, the load-balancing
loss), its experts split over ``ep_size`` ranks, and the helpers that tell expert parameters
from the others.

Example:
    >>> from shardtrain.moe import MoE
    >>> moe = MoE(hidden_size=64, expert=mlp, num_experts=8, ep_size=2, k=2)
    >>> out, l_aux, exp_counts = moe(hidden)
"""
from .gating import Routing, capacity
from ._groups import ExpertGroups, expert_groups, find_expert_groups
from .layer import MoE, MOELayer, Experts, TopKGate, split_experts, wire_experts
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "MOELayer", "Experts", "TopKGate", "Routing", "capacity", "ExpertGroups",
           "expert_groups", "find_expert_groups", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer", "split_experts",
           "wire_experts"]
