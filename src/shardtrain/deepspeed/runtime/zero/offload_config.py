"""``deepspeed.runtime.zero.offload_config``: the offload devices and the kinds of model state, as
DeepSpeed 0.19.8 names them.

The enums are ``str``, so ``OffloadDeviceEnum.cpu`` stands wherever the config takes ``"cpu"``
(``offload_optimizer.device``, ``offload_param.device``; ``"nvme"`` is refused there as a
planned feature). ``OffloadStateTypeEnum`` names what ``engine.offload_states(include=...)``
moves (and ``engine.optimizer.offload_states``, as OpenRLHF calls it). The pydantic config
classes are not provided:
``DeepSpeedConfig(config)`` checks the offload blocks.

Example:
    >>> from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    >>> config["zero_optimization"]["offload_optimizer"] = {"device": OffloadDeviceEnum.cpu}
"""
from __future__ import annotations

from enum import Enum

from ..._missing import unsupported_class

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "DeepSpeedZeroOffloadParamConfig",
           "DeepSpeedZeroOffloadOptimizerConfig"]


class OffloadDeviceEnum(str, Enum):
    """Where ZeRO keeps what it offloads."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of model state DeepSpeed's ``offload_states`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


_INSTEAD = ("deepspeed.runtime.config.DeepSpeedConfig(config), which checks the whole config "
            "with its zero_optimization.offload_param / offload_optimizer blocks")
DeepSpeedZeroOffloadParamConfig = unsupported_class(
    "deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig",
    "DeepSpeed's pydantic config classes", _INSTEAD)
DeepSpeedZeroOffloadOptimizerConfig = unsupported_class(
    "deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeed's pydantic config classes", _INSTEAD)
