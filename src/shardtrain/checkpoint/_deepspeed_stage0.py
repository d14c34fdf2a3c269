"""Stage 0: naming the optimizer's parameters, which a stage-0 checkpoint numbers only.

At stage 0 DeepSpeed saves the module and the optimizer's own state dict, whose parameters are
indices ``0..n-1`` in the order the optimizer was given them, group after group; the 16-bit
wrapper adds the fp32 masters in that order (``fp32_groups``). The converter gives each index
the module parameter it stands for: the optimizer's parameters are taken to be a subsequence
of the module's (buffers and tied aliases left out) in module order, group by group, each
fitting its parameter's shape (a master's or an Adam moment's) and, where an fp32 master
exists, rounding to the 16-bit weight. When frozen parameters leave more than one fit,
:func:`align` refuses and lists the candidates; the caller names the frozen ones (``frozen=``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._deepspeed_files import DeepSpeedFiles
from .deepspeed_keys import FP32_GROUPS, OPTIMIZER_STATE_DICT
from ._deepspeed_state import (DeepSpeedState, TrainedParam, base_state, hyperparameters,
                               per_element, scaler_state, whole_frozen)

__all__ = ["read_stage0", "align"]


def read_stage0(files: DeepSpeedFiles, model: Dict[str, Any], frozen: Optional[Sequence[str]],
                untrained: Optional[Sequence[str]] = None) -> DeepSpeedState:
    """A stage-0 checkpoint: the module, and the optimizer's state under the module's names.
    ``untrained`` is tried as ``frozen`` first when ``frozen`` is not given: a module's
    frozen parameters are most likely the ones the optimizer did not hold."""
    path = files.model_states[0]
    saved = model.get("optimizer")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no optimizer state and the tag has no ZeRO optimizer "
                         "files: the checkpoint was saved without its optimizer; nothing to "
                         "resume from but the weights.")
    if "fp32_groups_flat" in saved:
        raise NotImplementedError(f"{path}: the fused fp16 optimizer's flat stage-0 layout is "
                                  "not supported; convert a checkpoint of ZeRO stage 1-3.")
    wrapped = OPTIMIZER_STATE_DICT in saved
    base = saved[OPTIMIZER_STATE_DICT] if wrapped else saved
    state = base_state(files, model, "ZeRO stage 0", 0, int(model.get("dp_world_size") or 1))
    masters = [list(g) for g in saved[FP32_GROUPS]] if wrapped else None
    names = None
    if frozen is None and untrained:
        known = [n for n in untrained if n in model["module"]]
        try:
            names = _stage0_names(path, state, model["module"], base, masters, known)
        except ValueError:  # they are not what the optimizer left out: shapes must tell
            names = None
    if names is None:
        names = _stage0_names(path, state, model["module"], base, masters, frozen)
    _stage0_params(state, model["module"], base, masters, names)
    whole_frozen(state, model["module"])
    state.groups = hyperparameters(base["param_groups"])
    state.loss_scaler = scaler_state(saved if wrapped else {},
                                     saved.get("dynamic_loss_scale", False),
                                     state.counters["global_steps"])
    return state


def _stage0_params(state: DeepSpeedState, module: Dict[str, torch.Tensor], base: Dict[str, Any],
                   masters: Optional[List[List[torch.Tensor]]], names: Dict[int, str]) -> None:
    """Each optimizer index's tensors under its module name (the fp32 weight is its master
    when there is no 16-bit wrapper)."""
    for g, group in enumerate(base["param_groups"]):
        for k, index in enumerate(group["params"]):
            weight = module[names[index]]
            master = masters[g][k] if masters else weight
            entry = dict(base["state"].get(index, {}))
            state.params[names[index]] = TrainedParam(
                list(weight.shape), master.reshape(-1).float(), weight.reshape(-1),
                {key: v.reshape(-1) for key, v in entry.items() if per_element(v)},
                {key: v for key, v in entry.items() if not per_element(v)}, g)


def _stage0_names(path: str, state: DeepSpeedState, module: Dict[str, torch.Tensor],
                  base: Dict[str, Any], masters: Optional[List[List[torch.Tensor]]],
                  frozen: Optional[Sequence[str]]) -> Dict[int, str]:
    """The module name of each optimizer index, group by group (see :func:`align`)."""
    unknown = sorted(set(frozen or ()) - set(module))
    if unknown:
        raise ValueError(f"{path}: frozen= (--frozen) names {unknown}, which the checkpoint's "
                         f"module does not have; its parameters are {sorted(module)}.")
    left = [n for n in module if n not in state.buffers and n not in state.aliases
            and n not in set(frozen or ())]
    names: Dict[int, str] = {}
    for g, group in enumerate(base["param_groups"]):
        refs = list(masters[g]) if masters else [None] * len(group["params"])
        chosen = _align_group(path, module, base, group["params"], refs, left, state.dtype)
        names.update(zip(group["params"], chosen))
        left = [n for n in left if n not in chosen]
    return names


def _align_group(path: str, module: Dict[str, torch.Tensor], base: Dict[str, Any],
                 indices: List[int], refs: List[Optional[torch.Tensor]], left: List[str],
                 dtype: torch.dtype) -> List[str]:
    """The module names of one param group's optimizer indices."""
    wanted = [_index_shape(base, i, ref) for i, ref in zip(indices, refs)]

    def fits(k: int, name: str) -> bool:
        return _fits(module[name], wanted[k], refs[k], dtype)
    return align(len(indices), left, fits, path)


def _index_shape(base: Dict[str, Any], index: int,
                 master: Optional[torch.Tensor]) -> Optional[List[int]]:
    if master is not None:
        return list(master.shape)
    states = [v for v in base["state"].get(index, {}).values() if per_element(v)]
    return list(states[0].shape) if states else None


def _fits(weight: torch.Tensor, shape: Optional[List[int]], master: Optional[torch.Tensor],
          dtype: torch.dtype) -> bool:
    if shape is not None and list(weight.shape) != shape:
        return False
    # A 16-bit weight is its fp32 master rounded: that tells same-shaped parameters apart.
    return master is None or torch.equal(master.to(dtype), weight.to(dtype))


def align(count: int, candidates: List[str], fits: Callable[[int, str], bool],
          where: str) -> List[str]:
    """The one order-preserving choice of ``count`` of ``candidates`` such that item ``i``
    fits the ``i``-th choice; refused when there is none or more than one."""
    first, ways = _leftmost(count, candidates, fits)
    if first is None:
        raise ValueError(f"{where}: the optimizer's {count} parameters do not match the "
                         f"module's parameters {candidates} in order and shape: the checkpoint "
                         "is damaged, or its optimizer was not built over the module's "
                         "parameters in module order.")
    if ways > 1:  # the rightmost choice is the leftmost one of the reversed problem
        last, _ = _leftmost(count, candidates[::-1], lambda i, n: fits(count - 1 - i, n))
        untrained = [[n for n in candidates if n not in chosen] for chosen in (first, last)]
        raise ValueError(f"{where}: the optimizer holds {count} of the module's "
                         f"{len(candidates)} parameters and a stage-0 checkpoint does not say "
                         f"which; by shape, the ones not trained could be {untrained[0]} or "
                         f"{untrained[1]}. Name them: --frozen {','.join(untrained[0])} "
                         "(import_deepspeed(..., frozen=[...])).")
    return first


def _leftmost(count: int, candidates: List[str], fits: Callable[[int, str], bool]
              ) -> Tuple[Optional[List[str]], int]:
    """The leftmost order-preserving fit and the number of fits (counted up to 2)."""
    m = len(candidates)
    ways = [[0] * (m + 1) for _ in range(count + 1)]  # ways[i][j]: items i.. into candidates j..
    ways[count] = [1] * (m + 1)
    for i in range(count - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            fit = ways[i + 1][j + 1] if fits(i, candidates[j]) else 0
            ways[i][j] = min(2, ways[i][j + 1] + fit)
    if ways[0][0] == 0:
        return None, 0
    chosen, j = [], 0
    for i in range(count):
        while not (ways[i + 1][j + 1] > 0 and fits(i, candidates[j])):
            j += 1
        chosen.append(candidates[j])
        j += 1
    return chosen, ways[0][0]
