"""What a DeepSpeed checkpoint holds, layout aside, and the parts every layout shares.

:class:`DeepSpeedState` is what :mod:`._deepspeed_reader` makes of any layout and what
:mod:`._import` writes: for every trained parameter its whole fp32 master, per-element and
scalar optimizer states and the 16-bit copy DeepSpeed saved; frozen parameters, buffers, tied
weights; the optimizer's hyperparameters, the counters, the scheduler's state dict, the loss
scaler, the config and the user's ``client_state`` keys. The helpers here read the model
states file's own keys (the same in every layout) and DeepSpeed's loss scaler, whichever form
it was saved in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ._deepspeed_files import DeepSpeedFiles, LossScalerState
from .deepspeed_keys import (BUFFER_NAMES, CHECKPOINT_PARALLEL_DIMS, DS_VERSION, FROZEN_PARAM_FRAGMENTS,
                              FROZEN_PARAM_SHAPES, PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO)

__all__ = ["DS_KEYS", "Load", "TrainedParam", "DeepSpeedState", "base_state", "whole_frozen",
           "scaler_state", "hyperparameters", "per_element", "whole", "numel"]

#: The keys DeepSpeed writes into a model states file; any other key is the user's.
DS_KEYS = frozenset((
    "module", BUFFER_NAMES, "optimizer", PARAM_SHAPES, FROZEN_PARAM_SHAPES,
    "shared_params", FROZEN_PARAM_FRAGMENTS, "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", CHECKPOINT_PARALLEL_DIMS, "ds_config",
    DS_VERSION, UNIVERSAL_CHECKPOINT_INFO))

Load = Callable[[str], Any]


@dataclass
class TrainedParam:
    """One parameter the optimizer trained: whole and flattened (views where possible)."""

    shape: List[int]
    master: torch.Tensor                  # fp32
    weight: Optional[torch.Tensor]        # the module's copy DeepSpeed saved; None at stage 3
    states: Dict[str, torch.Tensor] = field(default_factory=dict)  # per element
    scalars: Dict[str, Any] = field(default_factory=dict)          # e.g. step
    group: int = 0


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint's training state, layout aside."""

    tag_dir: str
    tag: str
    layout: str                            # e.g. "ZeRO stage 2", "universal"
    stage: int
    world_size: int
    dtype: torch.dtype                     # the module's dtype in training
    config: Dict[str, Any]
    params: Dict[str, TrainedParam]
    frozen: Dict[str, torch.Tensor]
    buffers: Dict[str, torch.Tensor]
    aliases: Dict[str, str]                # tied weights: name -> the name that holds it
    groups: List[Dict[str, Any]]           # the optimizer's hyperparameters, per group
    lr_scheduler: Optional[Dict[str, Any]]
    loss_scaler: Dict[str, Any]
    counters: Dict[str, int]
    client_state: Dict[str, Any]
    data_sampler: Any = None


def base_state(files: DeepSpeedFiles, model: Dict[str, Any], layout: str, stage: int,
               world: int) -> DeepSpeedState:
    """Everything but the trained parameters, the frozen ones and the optimizer's groups."""
    config = dict(model.get("ds_config") or {})
    module = model["module"]
    buffers = {n: module[n] for n in model.get(BUFFER_NAMES) or [] if n in module}
    steps = int(model.get("global_steps") or 0)
    batch = int(config.get("train_batch_size") or 0)
    counters = {"global_steps": steps, "skipped_steps": int(model.get("skipped_steps") or 0),
                "global_samples": int(model.get("global_samples") or steps * batch)}
    client = {k: v for k, v in model.items() if k not in DS_KEYS}
    shared = model.get("shared_params")
    aliases = dict(shared) if isinstance(shared, dict) else _tied(module)
    return DeepSpeedState(files.tag_dir, files.tag, layout, stage, world, _dtype(config),
                          config, {}, {}, buffers, aliases, [], model.get("lr_scheduler"), {},
                          counters, client, model.get("data_sampler"))


def _tied(module: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Tied weights where DeepSpeed did not record them (``shared_params`` is None at stage
    0): a name whose tensor is an earlier name's, as the pickle shares their storage."""
    seen: Dict[Any, str] = {}
    out: Dict[str, str] = {}
    for name, t in module.items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key in seen:
            out[name] = seen[key]
        else:
            seen[key] = name
    return out


def _dtype(config: Dict[str, Any]) -> torch.dtype:
    bf16 = config.get("bf16", config.get("bfloat16")) or {}
    if isinstance(bf16, dict) and bf16.get("enabled"):
        return torch.bfloat16
    fp16 = config.get("fp16") or {}
    return torch.float16 if isinstance(fp16, dict) and fp16.get("enabled") else torch.float32


def whole_frozen(state: DeepSpeedState, module: Dict[str, torch.Tensor]) -> None:
    """Stages 0-2: every module tensor that is not trained, a buffer or an alias is frozen."""
    for name, value in module.items():
        if name not in state.params and name not in state.buffers \
                and name not in state.aliases and value.numel() > 0:
            state.frozen[name] = value


def scaler_state(saved: Any, dynamic: Any, steps: int) -> Dict[str, Any]:
    """DeepSpeed's loss scaler (a stand-in object or the stage-0 wrapper's keys), as values."""
    attrs = dict(vars(saved)) if isinstance(saved, LossScalerState) else dict(saved or {})
    last = attrs.get("last_overflow_iter")
    return {"scale": float(attrs.get("cur_scale", 1.0)),
            "dynamic": bool(attrs.get("dynamic", dynamic)),
            "cur_iter": int(attrs.get("cur_iter", steps)),
            "last_overflow_iter": -1 if last is None else int(last),
            "window": int(attrs.get("scale_window") or 1000),
            "hysteresis": int(attrs.get("delayed_shift") or 2),
            "cur_hysteresis": int(attrs.get("cur_hysteresis") or attrs.get("delayed_shift") or 2),
            "consecutive_hysteresis": bool(attrs.get("consecutive_hysteresis", False)),
            "min_scale": float(attrs.get("min_scale") or attrs.get("min_loss_scale") or 1.0)}


def hyperparameters(groups: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def whole(weight: Optional[torch.Tensor], n: int) -> bool:
    """Whether DeepSpeed saved the module's copy of an ``n``-element parameter whole."""
    return isinstance(weight, torch.Tensor) and weight.numel() == n and n > 0
