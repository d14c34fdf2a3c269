"""What a checkpoint reads from the engine and writes back into it: the one module that knows
where the engine keeps it.

Every other module of the package reaches the engine through these functions, so that the
engine's side of a checkpoint is this short list: the module and its parameters, the strategy's
view of what the optimizer updates, the optimizer, the scheduler, the loss scaler, the data
loader, the counters, the precision, the config and the device.

Stages 0-2 keep every module parameter whole on every rank. Stage 3 keeps only a shard of a
partitioned parameter (the full shape in ``ds_shape``), which is exactly the even shard a rank
file holds; any other range is gathered (a collective: every rank asks for it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..zero._params import GatheredParameters, is_partitioned
from ..zero._shards import shard_range
from ._format import dtype_name

if TYPE_CHECKING:  # annotations only: nothing here imports the engine at run time
    from ..engine import Engine

__all__ = [
    "Trainable", "shape", "numel", "own_shard", "param_range", "set_param", "set_shard",
    "named_params", "named_buffers", "trainables", "aliases", "any_partitioned",
    "zero_stage", "check_stage", "global_steps", "counters", "restore_counters",
    "tag_validation", "config_dict", "precision", "optimizer", "lr_scheduler", "loss_scaler",
    "data_loader", "device_rng"]


# -- parameters and buffers ---------------------------------------------------------------------

def shape(p: torch.Tensor) -> List[int]:
    return list(getattr(p, "ds_shape", p.shape))


def numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def own_shard(p: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``[lo, hi)`` of this rank's shard of a partitioned parameter; None for one kept whole."""
    if not is_partitioned(p):
        return None
    return shard_range(p.ds_numel, comm.get_world_size(), comm.get_rank())


def param_range(engine: "Engine", p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the full flattened parameter (a view where possible)."""
    del engine
    own = own_shard(p)
    if own is None:
        return p.detach().reshape(-1)[lo:hi]
    if (lo, hi) == own:
        return p.ds_tensor[: hi - lo]
    with GatheredParameters([p]):
        return p.ds_full.reshape(-1)[lo:hi].clone()


@torch.no_grad()
def set_param(engine: "Engine", p: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the full parameter ``full`` (1-D, any dtype) into the module (at stage 3,
    into this rank's shard of it)."""
    del engine
    own = own_shard(p)
    if own is None:
        p.data.copy_(full.reshape(p.shape))
        return
    lo, hi = own
    p.ds_tensor[: hi - lo].copy_(full.reshape(-1)[lo:hi])


@torch.no_grad()
def set_shard(engine: "Engine", p: torch.Tensor, shard: torch.Tensor) -> None:
    """Writes this rank's shard (1-D) of a partitioned parameter."""
    del engine
    p.ds_tensor[: shard.numel()].copy_(shard)


@dataclass
class Trainable:
    """A trainable parameter and what the optimizer holds of it on this rank."""

    name: str
    param: torch.nn.Parameter
    lo: int          # [lo, hi): the optimizer's slice of the flattened parameter on this rank
    hi: int
    tensor: Optional[torch.Tensor]  # the optimizer's tensor (None when the slice is empty)

    @property
    def has_master(self) -> bool:
        """An fp32 master of a 16-bit parameter: the only copy that holds more than the
        module's own weights (and so the only one saved)."""
        return self.tensor is not None and self.param.dtype != torch.float32

    def is_copy(self, engine: "Engine") -> bool:
        """The optimizer updates a copy of the slice (a master, or a host copy when the
        optimizer is offloaded), not the parameter's own memory: a load must set it too."""
        if self.tensor is None:
            return False
        own = param_range(engine, self.param, self.lo, self.hi)
        return not (self.tensor.device == own.device and self.tensor.dtype == own.dtype
                    and self.tensor.data_ptr() == own.data_ptr())


def named_params(engine: "Engine") -> List[Tuple[str, torch.nn.Parameter]]:
    return list(engine.module.named_parameters())  # tied weights appear once


def named_buffers(engine: "Engine") -> List[Tuple[str, torch.Tensor]]:
    persistent = set(engine.module.state_dict(keep_vars=True))  # non-persistent ones are not
    return [(n, b) for n, b in engine.module.named_buffers() if n in persistent]


def trainables(engine: "Engine") -> Dict[str, Trainable]:
    view = engine._strategy.view
    index = {id(p): i for i, p in enumerate(view.params)}
    out = {}
    for name, p in named_params(engine):
        if id(p) in index:
            i = index[id(p)]
            lo, hi = view.slices[i]
            out[name] = Trainable(name, p, lo, hi, view.tensors[i])
    return out


def aliases(engine: "Engine") -> Dict[str, str]:
    """state_dict names that are another name's tensor (tied weights) -> that name."""
    canon = {id(t): n for n, t in named_params(engine) + named_buffers(engine)}
    return {k: canon[id(v)] for k, v in engine.module.state_dict(keep_vars=True).items()
            if canon.get(id(v), k) != k}


def any_partitioned(engine: "Engine") -> bool:
    return any(is_partitioned(p) for p in engine.module.parameters())


# -- training state -----------------------------------------------------------------------------

def zero_stage(engine: "Engine") -> int:
    return engine.zero_optimization_stage()


def check_stage(engine: "Engine", what: str) -> None:
    if engine.zero_optimization_stage() not in (0, 1, 2, 3):
        raise NotImplementedError(f"{what} at ZeRO stage {engine.zero_optimization_stage()} "
                                  "is not supported.")


def global_steps(engine: "Engine") -> int:
    return engine.global_steps


def counters(engine: "Engine") -> Dict[str, int]:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps()}


def restore_counters(engine: "Engine", saved: Dict[str, Any]) -> None:
    """The counters of :func:`counters`, as a checkpoint saved them."""
    engine.global_steps = int(saved["global_steps"])
    engine.global_samples = int(saved["global_samples"])
    engine.skipped_steps = int(saved["skipped_steps"])
    gas = engine.gradient_accumulation_steps()
    # The next micro-step's place in the accumulation cycle; a new gas restarts the cycle.
    same_gas = int(saved.get("gradient_accumulation_steps", gas)) == gas
    engine.micro_steps = int(saved["micro_steps"]) if same_gas else engine.global_steps * gas


def tag_validation(engine: "Engine") -> str:
    return engine.config.checkpoint.tag_validation


def config_dict(engine: "Engine") -> Dict[str, Any]:
    return engine.config.to_dict()


def precision(engine: "Engine") -> Dict[str, Any]:
    """The dtypes of the run, and whether it scales the loss (fp16)."""
    policy = engine._precision
    autocast = policy.autocast_dtype
    return {"param_dtype": dtype_name(policy.param_dtype),
            "autocast_dtype": dtype_name(autocast) if autocast is not None else None,
            "loss_scaling": torch.float16 in (policy.param_dtype, autocast)}


def optimizer(engine: "Engine") -> Optional[torch.optim.Optimizer]:
    return engine.optimizer


def lr_scheduler(engine: "Engine") -> Any:
    return engine.lr_scheduler


def loss_scaler(engine: "Engine") -> Any:
    return engine.loss_scaler


def data_loader(engine: "Engine") -> Any:
    return engine.training_dataloader


def device_rng(engine: "Engine") -> Any:
    """The device's RNG module, or None where torch's CPU generator is the only one."""
    module = torch.get_device_module(engine.device)
    return module if hasattr(module, "get_rng_state") else None
