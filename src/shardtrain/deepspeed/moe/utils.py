"""``deepspeed.moe.utils``: splitting parameters into expert and shared groups.

shardtrain has no expert parallelism, so no parameter is an expert parameter in DeepSpeed's
sense (``allreduce = False``, set by DeepSpeed's MoE layer): the helpers return the groups
they are given, which is what DeepSpeed returns for a model without its MoE layer.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple, Union

import torch

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "is_moe_param_group",
           "configure_moe_param_groups"]


def has_moe_layers(m: torch.nn.Module) -> Tuple[bool, int]:
    """(False, 0): DeepSpeed's MoE layer is not provided, so no model has one."""
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed's MoE layer marked as an expert (``allreduce=False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: List[torch.nn.Parameter]):
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: List[torch.nn.Parameter]):
    shared = [p.grad for p in group if p.grad is not None and not is_moe_param(p)]
    expert = [p.grad for p in group if p.grad is not None and is_moe_param(p)]
    return shared, expert


def _as_groups(param_groups: Union[Dict[str, Any], Tuple, List]) -> List[Dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        return [{"params": groups}]
    return groups


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """The parameter groups with expert parameters (none here) split off; a dict, a tuple or
    a list of dicts comes back as a list of dicts."""
    groups = _as_groups(param_groups)
    for group in groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError("expert-parallel parameters (allreduce=False) are not "
                                      "supported: shardtrain has no expert parallelism.")
    return groups


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: List):
    return model_parameters
