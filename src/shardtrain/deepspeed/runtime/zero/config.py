"""``deepspeed.runtime.zero.config``: the ZeRO stage enum and the block's key, as DeepSpeed 0.19.8
names them.

``ZeroStageEnum`` is an ``int``, so it stands wherever a stage number does (a config's
``"stage"``, a comparison with ``engine.zero_optimization_stage()``), and scripts that allow it
for ``torch.load`` (``torch.serialization.add_safe_globals([ZeroStageEnum])``) find it.
DeepSpeed's pydantic config class is not provided: ``DeepSpeedConfig(config)`` checks the
``zero_optimization`` block and holds it as ``.zero_optimization``.

Example:
    >>> from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION, ZeroStageEnum
    >>> config[ZERO_OPTIMIZATION] = {"stage": ZeroStageEnum.gradients}
"""
from __future__ import annotations

from enum import Enum

from ..._missing import unsupported_class

__all__ = ["ZERO_OPTIMIZATION", "ZeroStageEnum", "DeepSpeedZeroConfig"]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what each one shards; ``max_stage`` is another name for ``weights``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


DeepSpeedZeroConfig = unsupported_class(
    "deepspeed.runtime.zero.config.DeepSpeedZeroConfig", "DeepSpeed's pydantic config classes",
    "deepspeed.runtime.config.DeepSpeedConfig(config), which checks the whole config and holds "
    "the block as .zero_optimization")
