"""The precision blocks: ``fp16``, ``bf16`` (older name ``bfloat16``), ``torch_autocast`` and
``data_types``.

Each block checks only its own keys (dynamic loss scaling needs a positive window, bf16 optimizer
states need bf16 master weights); which blocks may be enabled together is a whole-config rule,
checked once the root is built (``_checks``).
"""

import math
from typing import Any, ClassVar, FrozenSet, List, Union

import torch
from pydantic import BeforeValidator, Field, model_validator
from typing_extensions import Annotated

from ._model import ConfigError, _ConfigModel
from ._values import _Bool, _Dtype, _Float, _Int, _show

__all__ = ["BF16Config", "DataTypesConfig", "FP16Config", "TorchAutocastConfig"]


def _loss_scale_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"fp16.loss_scale must be a finite number >= 0 (0 = dynamic loss scaling, > 0 = static "
                          f"scale); got {_show(value)}.")
    return float(value)


class FP16Config(_ConfigModel):
    """``fp16``: fp16 model with fp32 master weights and loss scaling."""

    config_path: ClassVar[str] = "fp16"

    enabled: _Bool = Field(False, description="train in fp16")
    auto_cast: _Bool = Field(False, description="cast floating-point forward inputs to fp16")
    loss_scale: Annotated[float, BeforeValidator(_loss_scale_value)] = Field(
        0.0, description="0 = dynamic scaling; > 0 = static scale")
    initial_scale_power: _Int = Field(16, description="dynamic scaling starts at 2**initial_scale_power")
    loss_scale_window: _Int = Field(1000, description="clean steps before the scale doubles")
    hysteresis: _Int = Field(2, description="overflows tolerated before the scale halves")
    consecutive_hysteresis: _Bool = Field(False, description="refill hysteresis on every clean step")
    min_loss_scale: _Float = Field(1.0, description="lower bound of the dynamic scale")
    fp16_master_weights_and_grads: _Bool = Field(False, description="fp16 master weights and grads (ZeRO 1-3)")

    @model_validator(mode="after")
    def _check(self) -> "FP16Config":
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ConfigError(f"fp16.{key} must be > 0 with dynamic loss scaling (fp16.loss_scale 0); "
                                      f"got {_show(getattr(self, key))}.")
        return self


class BF16Config(_ConfigModel):
    """``bf16`` (older alias ``bfloat16``): bf16 model with fp32 master weights."""

    config_path: ClassVar[str] = "bf16"

    enabled: _Bool = Field(False, description="train in bf16")
    immediate_grad_update: _Bool = Field(False, description="fold gradients into fp32 as soon as they are produced")
    check_grad_overflow: _Bool = Field(True, description="skip the step when a gradient is inf/NaN")
    bf16_master_weights_and_grads: _Bool = Field(False, description="bf16 master weights and grads (ZeRO 1-3)")
    bf16_optimizer_states: _Bool = Field(False, description="bf16 optimizer states")

    @model_validator(mode="after")
    def _check(self) -> "BF16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ConfigError("bf16.bf16_optimizer_states true needs bf16.bf16_master_weights_and_grads true.")
        return self


def _default_safe_modules() -> List[str]:
    classes = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in classes]


def _safe_modules_value(value: Any) -> Any:
    if value is None:
        return _default_safe_modules()
    if not isinstance(value, list):
        raise ConfigError(f"torch_autocast.lower_precision_safe_modules must be a list of 'package.Class' strings; "
                          f"got {_show(value)}.")
    for index, entry in enumerate(value):
        if not isinstance(entry, str) or "." not in entry:
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules[{index}] must be a 'package.Class' "
                              f"string such as 'torch.nn.Linear'; got {_show(entry)}.")
    return value


class TorchAutocastConfig(_ConfigModel):
    """``torch_autocast``: fp32 model, forward under ``torch.autocast``."""

    config_path: ClassVar[str] = "torch_autocast"

    enabled: _Bool = Field(False, description="run forward under torch.autocast")
    dtype: _Dtype = Field(None, description="autocast dtype; null = torch's device default (bf16 on CPU, fp16 on CUDA)")
    lower_precision_safe_modules: Annotated[List[str], BeforeValidator(_safe_modules_value)] = Field(
        default_factory=_default_safe_modules, description="module classes whose outputs may stay in low precision")


def _keep_in_fp32_value(value: Any) -> Any:
    if value == "auto" or (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        return value
    raise ConfigError(f"data_types.keep_in_fp32_modules must be \"auto\" or a list of name patterns; "
                      f"got {_show(value)}.")


class DataTypesConfig(_ConfigModel):
    """``data_types``: dtypes that differ from the precision mode's."""

    config_path: ClassVar[str] = "data_types"
    drops_auto: ClassVar[bool] = False
    auto_allowed: ClassVar[FrozenSet[str]] = frozenset({"keep_in_fp32_modules"})

    grad_accum_dtype: _Dtype = Field(None, description="gradient accumulation dtype; null = the model's")
    param_dtype: _Dtype = Field(None, description="if set, must match the fp16/bf16 mode")
    buffer_dtype: _Dtype = Field(None, description="cast buffers to this dtype; null = keep")
    keep_in_fp32_modules: Annotated[Union[str, List[str]], BeforeValidator(_keep_in_fp32_value)] = Field(
        "auto", description="modules kept in fp32 under fp16/bf16")
