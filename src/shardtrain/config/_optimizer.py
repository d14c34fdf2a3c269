"""The ``optimizer`` and ``scheduler`` blocks: a type name and the keyword arguments to build it with.

The blocks check the shape and the values that can never be right (``"auto"``, clipping given as
an optimizer parameter); whether ``type`` names a real optimizer or scheduler and whether
``params`` fit its signature is :mod:`shardtrain.optim`'s check, where the object is built.
"""

from typing import Any, ClassVar, Dict, Mapping

from pydantic import Field, model_validator

from ._model import ConfigError, _ConfigModel
from ._values import _Bool, _is_auto, _show, _Str

__all__ = ["OptimizerConfig", "SchedulerConfig"]


def _reject_auto_params(section: str, params: Any) -> None:
    if isinstance(params, Mapping):
        for key, value in params.items():
            if _is_auto(value):
                raise ConfigError(
                    f"{section}.params.{key} is \"auto\", but shardtrain needs a value here. \"auto\" is a placeholder "
                    "that Hugging Face's DeepSpeed integration fills in; write the value yourself, or remove the key "
                    "to use the default.")


class OptimizerConfig(_ConfigModel):
    """``optimizer``: the optimizer built from the config; ``params`` become its keyword arguments."""

    config_path: ClassVar[str] = "optimizer"
    drops_auto: ClassVar[bool] = False

    type: _Str = Field(description="optimizer name, e.g. AdamW or Muon (docs/optimizers.md)")
    params: Dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the optimizer")
    legacy_fusion: _Bool = Field(False, description="legacy fused fp16 optimizer path")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if data.get("params", {}) is None:
            del data["params"]
        _reject_auto_params("optimizer", data.get("params"))
        return data

    @model_validator(mode="after")
    def _check(self) -> "OptimizerConfig":
        clip = self.params.get("max_grad_norm")
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
            raise ConfigError(f"optimizer.params.max_grad_norm {_show(clip)}: gradient clipping is not an optimizer "
                              f"parameter; remove it and set the top-level gradient_clipping to {_show(clip)} instead.")
        return self


class SchedulerConfig(_ConfigModel):
    """``scheduler``: the learning-rate scheduler; ``params`` become its keyword arguments."""

    config_path: ClassVar[str] = "scheduler"
    drops_auto: ClassVar[bool] = False

    type: _Str = Field(description="scheduler name, e.g. WarmupLR (see the scheduler docs)")
    params: Dict[str, Any] = Field(description="keyword arguments of the scheduler ({} = its defaults)")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if data.get("params") is None:
            raise ConfigError("scheduler.params is missing: give the scheduler's keyword arguments, or {} to take "
                              "its defaults.")
        _reject_auto_params("scheduler", data["params"])
        return data
