"""Telling expert parameters from the others, and the optimizer groups DeepSpeed's ZeRO
wants for them: the expert parameters of each expert-parallel size in groups of their own
(``moe: True``, ``name: "ep_size_<N>"``), never mixed with dense ones.

Example:
    >>> groups = split_params_into_different_moe_groups_for_optimizer(
    ...     {"params": list(model.parameters()), "name": "parameters"})
    >>> optimizer = torch.optim.AdamW(groups, lr=1e-3)
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple, Union

import torch

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "is_moe_param_group",
           "configure_moe_param_groups"]

#: DeepSpeed's default bound on the elements of one expert parameter group.
MAX_GROUP_SIZE = 178956971


def has_moe_layers(m: torch.nn.Module) -> Tuple[bool, int]:
    """Whether ``m`` holds an :class:`~shardtrain.moe.MoE` layer, and the experts of the
    first one (0 when none)."""
    from .layer import MoE
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (marked ``allreduce = False`` by the MoE layer)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: List[torch.nn.Parameter]):
    """(the dense parameters, the expert ones)."""
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group: List[torch.nn.Parameter]):
    """(the dense parameters' gradients, the expert ones'), leaving out missing ones."""
    with_grad = [p for p in group if p.grad is not None]
    return ([p.grad for p in with_grad if not is_moe_param(p)],
            [p.grad for p in with_grad if is_moe_param(p)])


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def _as_groups(param_groups: Union[Dict[str, Any], Tuple, List]) -> List[Dict[str, Any]]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if not isinstance(param_groups, (list, tuple)):
        raise ValueError(f"parameter groups must be a dict or a list or tuple of dicts, got "
                         f"{type(param_groups).__name__}.")
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        return [{"params": groups}]
    return groups


def split_params_into_different_moe_groups_for_optimizer(
        param_groups, max_group_size: Union[int, None] = MAX_GROUP_SIZE) -> List[Dict[str, Any]]:
    """Each group's expert parameters moved into new groups, one per expert-parallel size
    (``name`` its ``group_name``, ``moe: True``, the other settings the group's), cut into
    groups of at most ``max_group_size`` elements (None: uncut); the dense parameters stay.
    A dict, a tuple or a list comes back as a list of dicts."""
    groups = _as_groups(param_groups)
    added: List[Dict[str, Any]] = []
    for group in groups:
        experts: Dict[str, List[torch.nn.Parameter]] = {}
        for p in group["params"]:
            if is_moe_param(p):
                experts.setdefault(p.group_name, []).append(p)
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
        settings = {k: v for k, v in group.items() if k not in ("params", "name")}
        for name, params in experts.items():
            for chunk in _cut(params, max_group_size):
                added.append({**settings, "name": name, "moe": True, "params": chunk})
    return groups + added


def _cut(params: List[torch.nn.Parameter], limit: Union[int, None]) -> List[List[torch.nn.Parameter]]:
    if limit is None:
        return [params]
    out: List[List[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return [chunk for chunk in out if chunk]


def configure_moe_param_groups(model_parameters: List) -> List[Dict[str, Any]]:
    """Optimizer groups for ``model_parameters`` (parameters, or groups) with the expert
    parameters split off, unless groups with ``moe`` are already there."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}.")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("the optimizer's parameters must be tensors or dicts, got "
                            f"{type(p).__name__}.")
    if model_parameters and isinstance(model_parameters[0], dict):
        if any("moe" in g for g in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer(
        {"params": model_parameters, "name": "dense-params"})
