"""Applying a load: what was read goes into the parts, and nothing can fail any more.

By the time :func:`apply` runs, every rank has read and checked everything it will apply
(:class:`Loaded`) and every rank has agreed that it could. So applying makes no reads and no
collectives, and a load that fails has changed nothing.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..log import logger
from . import _engine_state as engine_state
from ..state import TrainingParts
from ._format import decode


__all__ = ["LoadOptions", "Loaded", "apply"]


@dataclass
class LoadOptions:
    strict: bool
    optimizer: bool
    scheduler: bool
    module_only: bool


@dataclass
class Loaded:
    """Everything a rank will apply, read and checked before the engine is touched."""

    params: Dict[str, torch.Tensor] = field(default_factory=dict)    # name -> full, 1-D
    shards: Dict[str, torch.Tensor] = field(default_factory=dict)    # stage 3: name -> own shard
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    masters: Dict[str, torch.Tensor] = field(default_factory=dict)   # name -> slice, fp32
    states: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name -> optimizer state
    rank_json: Optional[Dict[str, Any]] = None
    rank_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    client: Dict[str, Any] = field(default_factory=dict)


def apply(parts: TrainingParts, meta: Dict[str, Any], loaded: Loaded, options: LoadOptions) -> None:
    _apply_module(parts, loaded)
    _apply_masters(parts, loaded)
    if options.optimizer and engine_state.optimizer(parts) is not None:
        _apply_optimizer(parts, meta, loaded)
    if options.scheduler:
        _apply_scheduler(parts, meta)
    if not options.module_only:
        _apply_training_state(parts, meta, options)
        _apply_rng(parts, loaded)


def _apply_module(parts: TrainingParts, loaded: Loaded) -> None:
    params = dict(engine_state.named_params(parts))
    for name, full in loaded.params.items():
        engine_state.set_param(params[name], full)
    for name, shard in loaded.shards.items():
        engine_state.set_shard(params[name], shard)
    buffers = dict(engine_state.named_buffers(parts))
    with torch.no_grad():
        for name, value in loaded.buffers.items():
            buffers[name].copy_(value.reshape(buffers[name].shape))


@torch.no_grad()
def _apply_masters(parts: TrainingParts, loaded: Loaded) -> None:
    """The optimizer's copies of the weights: the saved fp32 masters when optimizer states
    were loaded, else rebuilt from the module's (just loaded) weights, as DeepSpeed does."""
    for name, t in engine_state.trainables(parts).items():
        if not t.is_copy:
            continue
        master = loaded.masters.get(name)
        if master is None:
            master = engine_state.param_range(t.param, t.lo, t.hi).float()
        t.tensor.copy_(master.reshape(t.tensor.shape))


def _apply_optimizer(parts: TrainingParts, meta: Dict[str, Any], loaded: Loaded) -> None:
    opt = engine_state.optimizer(parts)
    saved = meta.get("optimizer")
    if saved is not None:
        for group, hyper in zip(opt.param_groups, saved["groups"]):
            for key, value in decode(hyper).items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)  # a tensor lr is updated in place, as it was built
                else:
                    group[key] = value
    for name, t in engine_state.trainables(parts).items():
        if t.tensor is None:
            continue
        if name in loaded.states:
            opt.state[t.tensor] = loaded.states[name]
        else:  # the saved optimizer had no state for it yet (it never had a gradient)
            opt.state.pop(t.tensor, None)


def _apply_scheduler(parts: TrainingParts, meta: Dict[str, Any]) -> None:
    saved, sched = meta.get("lr_scheduler"), engine_state.lr_scheduler(parts)
    if saved is None or sched is None:
        return
    state = decode(saved["state"])
    if saved["class"] is None and set(state) != set(sched.state_dict()):
        logger.warning("load_checkpoint: the checkpoint's scheduler state has the keys %s but the "
                       "engine's %s has %s; its state is not loaded.", sorted(state),
                       type(sched).__name__, sorted(sched.state_dict()))
        return
    if saved["class"] not in (None, type(sched).__name__):
        logger.warning("load_checkpoint: the checkpoint's scheduler is %s but the engine's is "
                       "%s; its state is not loaded.", saved["class"], type(sched).__name__)
        return
    sched.load_state_dict(state)


def _apply_training_state(parts: TrainingParts, meta: Dict[str, Any],
                          options: LoadOptions) -> None:
    """Counters, the loss scale (with the optimizer states) and the data position."""
    engine_state.restore_counters(parts, meta["counters"])
    if options.optimizer and meta["precision"]["loss_scaling"] == engine_state.precision(
            parts)["loss_scaling"]:
        engine_state.loss_scaler(parts).load_state_dict(meta["loss_scaler"])
    loader, position = engine_state.data_loader(parts), meta.get("data_sampler")
    if loader is not None and position is not None:
        loader.load_state_dict(position)


def _apply_rng(parts: TrainingParts, loaded: Loaded) -> None:
    """RNG states of the rank that saved them; a rank the saving world did not have keeps its
    own (there is nothing to resume for it)."""
    if loaded.rank_json is None:
        return
    rng = loaded.rank_json["rng"]
    random.setstate(decode(rng["python"]))
    state = rng["numpy"]
    np.random.set_state((state["kind"], np.array(state["keys"], dtype=np.uint32), state["pos"],
                         state["has_gauss"], state["cached_gaussian"]))
    torch.set_rng_state(loaded.rank_tensors["rng/torch"])
    device = engine_state.device_rng(parts)
    if device is not None and "rng/device" in loaded.rank_tensors:
        device.set_rng_state(loaded.rank_tensors["rng/device"])
