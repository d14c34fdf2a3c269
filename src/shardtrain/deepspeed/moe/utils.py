"""``deepspeed.moe.utils``: telling expert parameters from the others, and the optimizer
groups for them (:mod:`shardtrain.moe.utils`)."""
from shardtrain.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param,
                                  is_moe_param_group,
                                  split_params_grads_into_shared_and_expert_params,
                                  split_params_into_different_moe_groups_for_optimizer,
                                  split_params_into_shared_and_expert_params)

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "is_moe_param_group",
           "configure_moe_param_groups"]
