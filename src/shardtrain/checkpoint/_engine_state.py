"""What a checkpoint reads from the engine and writes back into it.

A checkpoint sees the engine only through :class:`shardtrain.state.TrainingParts` (what
``engine.training_parts()`` returns): the module, what the optimizer holds of each trainable
parameter, the optimizer, the scheduler, the loss scaler, the data loader, the counters, the
precision, the config and the device. This module is the one that reads those parts; every
other module of the package goes through its functions.

Stages 0-2 keep every module parameter whole on every rank. Stage 3 keeps only a shard of a
partitioned parameter (its layout record, :func:`shardtrain.layout.layout_of`, says which),
which is exactly the even shard a rank file holds; any other range is gathered through
:mod:`shardtrain.zero.values` (a collective: every rank asks for it).

On a device mesh a parameter may also be a tensor-parallel slice (``layout_of(p).tp``). A checkpoint
always describes the unsplit model (:func:`shape`, :func:`numel`), so it loads on any mesh;
this rank's own tensor is the *local* one (:func:`local_numel`, :func:`param_range`), and
:mod:`._mesh_values` moves between the two.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..log import logger
from ..state import TrainingParts
from ..layout import layout_of
from ..zero import values
from ..zero.values import is_partitioned
from ._format import dtype_name


__all__ = [
    "Trainable", "shape", "numel", "local_numel", "plain_layout", "any_tp_split",
    "zero_group", "own_shard", "param_range", "set_param", "set_shard",
    "named_params", "named_buffers", "trainables", "aliases", "any_partitioned",
    "zero_stage", "check_stage", "async_save", "global_steps", "counters", "restore_counters",
    "tag_validation", "config_dict", "model_config", "precision", "optimizer", "lr_scheduler",
    "loss_scaler",
    "data_loader", "device_rng"]


# -- parameters and buffers ---------------------------------------------------------------------

def shape(p: torch.Tensor) -> List[int]:
    """The unsplit parameter's shape (whatever stage 3 or tensor parallelism holds of it)."""
    return list(layout_of(p).full_shape)


def numel(p: torch.Tensor) -> int:
    """The unsplit parameter's element count."""
    return layout_of(p).numel


def local_numel(p: torch.Tensor) -> int:
    """The element count of this rank's tensor-parallel slice (the parameter itself without
    tensor parallelism), before stage 3 partitions it."""
    return layout_of(p).local_numel


def own_shard(p: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``[lo, hi)`` of this rank's shard of a partitioned parameter; None for one kept whole."""
    return layout_of(p).shard if is_partitioned(p) else None


def param_range(p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of this rank's flattened (local) parameter (a view where possible)."""
    return values.read_range(p, lo, hi)


def set_param(p: torch.Tensor, full: torch.Tensor) -> None:
    """Writes this rank's whole (local) parameter ``full`` (1-D, any dtype) into the module
    (at stage 3, into this rank's shard of it)."""
    values.write_whole(p, full)


def set_shard(p: torch.Tensor, shard: torch.Tensor) -> None:
    """Writes this rank's shard (1-D) of a partitioned parameter."""
    values.write_shard(p, shard)


@dataclass
class Trainable:
    """A trainable parameter and what the optimizer holds of it on this rank."""

    name: str
    param: torch.nn.Parameter
    lo: int          # [lo, hi): the optimizer's slice of the flattened parameter on this rank
    hi: int
    tensor: Optional[torch.Tensor]  # the optimizer's tensor (None when the slice is empty)
    is_copy: bool    # the optimizer updates a copy of the slice: a load must set it too
    sharded: bool = False  # [lo, hi) is this rank's even shard over the data-parallel group

    @property
    def has_master(self) -> bool:
        """An fp32 master of a 16-bit parameter: the only copy that holds more than the
        module's own weights (and so the only one saved). bf16 masters updated in place
        (``bf16_master_weights_and_grads``) are the weights: none."""
        return self.tensor is not None and self.param.dtype != torch.float32 \
            and self.tensor.dtype == torch.float32


def named_params(parts: TrainingParts) -> List[Tuple[str, torch.nn.Parameter]]:
    return list(parts.module.named_parameters())  # tied weights appear once


def named_buffers(parts: TrainingParts) -> List[Tuple[str, torch.Tensor]]:
    persistent = set(parts.module.state_dict(keep_vars=True))  # non-persistent ones are not
    return [(n, b) for n, b in parts.module.named_buffers() if n in persistent]


def trainables(parts: TrainingParts) -> Dict[str, Trainable]:
    slots = {id(slot.param): slot for slot in parts.slots}
    return {name: Trainable(name, p, slot.lo, slot.hi, slot.tensor, slot.is_copy, slot.sharded)
            for name, p in named_params(parts) for slot in [slots.get(id(p))] if slot is not None}


def writers(parts: TrainingParts) -> comm.Group:
    """The ranks that hold this rank's parameters and write their even shards: the world,
    or with pipeline stages the ranks of this rank's stage (each stage writes its layers)."""
    mesh = parts.mesh
    return mesh.stage if mesh is not None and mesh.sizes.get("pp", 1) > 1 else comm.WORLD


def pipelined(parts: TrainingParts) -> bool:
    return writers(parts) is not comm.WORLD


def model_names(parts: TrainingParts) -> Optional[set]:
    """With pipeline stages, the saved names of every stage's parameters and buffers (a
    collective: each stage holds other layers); None without stages."""
    if not pipelined(parts):
        return None
    mine = [saved for name, p in named_params(parts) for saved in saved_names(name, p)]
    mine += [name for name, _ in named_buffers(parts)]
    return {name for names in comm.all_gather_object(mine) for name in names}


def plain_layout(parts: TrainingParts) -> bool:
    """Whether this rank's optimizer slices are the checkpoint's even shards over the ranks
    that write them (the world, or a pipeline stage): no tensor-parallel slice, and the
    optimizer's slices spread over every one of those ranks (not a data-parallel group of
    a mesh)."""
    mesh = parts.mesh
    spread = mesh is None or mesh.zero.size() == writers(parts).size()
    return spread and not any_tp_split(parts) and not any_split_expert(parts)


def any_split_expert(parts: TrainingParts) -> bool:
    return any(layout_of(p).expert is not None for p in parts.module.parameters())


def saved_names(name: str, p: torch.Tensor) -> List[str]:
    """The names a parameter's values have in the checkpoint, which describes the unsplit
    model: its own name, or for a split expert the name of the expert it is on each rank of
    its expert-parallel group (in that rank order)."""
    split = layout_of(p).expert
    if split is None or split.stacked:
        return [name]
    return [split.global_name(name, r) for r in range(split.ep_size)]


def saved_name(name: str, p: torch.Tensor) -> str:
    """The checkpoint's name for this rank's parameter ``name``."""
    split = layout_of(p).expert
    return name if split is None else split.global_name(name)


def any_tp_split(parts: TrainingParts) -> bool:
    return any(layout_of(p).tp is not None for p in parts.module.parameters())


def zero_group(parts: TrainingParts, p: Optional[torch.Tensor] = None) -> comm.Group:
    """The group the optimizer's slices (of ``p``) are spread over: a split expert's, its
    expert-data-parallel group."""
    groups = layout_of(p).expert_groups if p is not None else None
    if groups is not None:
        return groups[1]
    return parts.mesh.zero if parts.mesh is not None else comm.WORLD


def aliases(parts: TrainingParts) -> Dict[str, str]:
    """state_dict names that are another name's tensor (tied weights) -> that name."""
    canon = {id(t): n for n, t in named_params(parts) + named_buffers(parts)}
    return {k: canon[id(v)] for k, v in parts.module.state_dict(keep_vars=True).items()
            if canon.get(id(v), k) != k}


def any_partitioned(parts: TrainingParts) -> bool:
    return any(is_partitioned(p) for p in parts.module.parameters())


# -- training state -----------------------------------------------------------------------------

def zero_stage(parts: TrainingParts) -> int:
    return parts.zero_stage


def check_stage(parts: TrainingParts, what: str) -> None:
    if parts.zero_stage not in (0, 1, 2, 3):
        raise NotImplementedError(f"{what} at ZeRO stage {parts.zero_stage} is not supported.")


def global_steps(parts: TrainingParts) -> int:
    return parts.train_state.global_steps


def counters(parts: TrainingParts) -> Dict[str, int]:
    return dict(parts.train_state.state_dict(),
                gradient_accumulation_steps=parts.gradient_accumulation_steps)


def restore_counters(parts: TrainingParts, saved: Dict[str, Any]) -> None:
    """The counters of :func:`counters`, as a checkpoint saved them."""
    parts.train_state.load_state_dict(saved, parts.gradient_accumulation_steps)


def async_save(parts: TrainingParts) -> bool:
    return bool(parts.config.checkpoint.async_save)


def tag_validation(parts: TrainingParts) -> str:
    return parts.config.checkpoint.tag_validation


def config_dict(parts: TrainingParts) -> Dict[str, Any]:
    return parts.config.to_dict()


def model_config(parts: TrainingParts) -> Optional[Dict[str, Any]]:
    """The model's own configuration, as ``save_pretrained`` writes it to config.json: the
    ``config.to_dict()`` of a Hugging Face model (a ``PretrainedConfig``), with
    ``architectures`` naming the model's class. None for a model without ``config.to_dict``,
    or (with a warning) one whose configuration JSON cannot hold."""
    to_dict = getattr(getattr(parts.module, "config", None), "to_dict", None)
    config = to_dict() if callable(to_dict) else None
    if not isinstance(config, dict):
        return None
    # a pipeline stage of a Hugging Face model names the model's class
    architecture = getattr(parts.module, "hf_architecture", None) or type(parts.module).__name__
    config = dict(config, architectures=[architecture])
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as error:
        logger.warning("save_checkpoint: the model's config.to_dict() is not JSON (%s); the "
                       "checkpoint does not record it, and an export of it writes no "
                       "config.json.", error)
        return None


def precision(parts: TrainingParts) -> Dict[str, Any]:
    """The dtypes of the run, and whether it scales the loss (fp16)."""
    policy = parts.precision
    autocast = policy.autocast_dtype
    return {"param_dtype": dtype_name(policy.param_dtype),
            "autocast_dtype": dtype_name(autocast) if autocast is not None else None,
            "loss_scaling": policy.scales_loss}


def optimizer(parts: TrainingParts) -> Optional[torch.optim.Optimizer]:
    return parts.optimizer


def lr_scheduler(parts: TrainingParts) -> Any:
    return parts.lr_scheduler


def loss_scaler(parts: TrainingParts) -> Any:
    return parts.loss_scaler


def data_loader(parts: TrainingParts) -> Any:
    return parts.dataloader


def device_rng(parts: TrainingParts) -> Any:
    """The device's RNG module, or None where torch's CPU generator is the only one."""
    module = torch.get_device_module(parts.device)
    return module if hasattr(module, "get_rng_state") else None
