"""``diagnostics`` (shardtrain's own block; DeepSpeed ignores it): how long a collective may
wait before the ranks report who is missing, and whether the ranks compare the collectives
they issue while training (see docs/troubleshooting.md)."""

from typing import Annotated, ClassVar, Literal, Optional

from pydantic import BeforeValidator, Field, model_validator

from ._model import ConfigError, _ConfigModel
from ._values import _Float

__all__ = ["DiagnosticsConfig"]


def _lower(value):
    return value.lower() if isinstance(value, str) else value


class DiagnosticsConfig(_ConfigModel):
    """``diagnostics``: collective timeouts and the divergence check (shardtrain only)."""

    config_path: ClassVar[str] = "diagnostics"

    collective_timeout: _Float = Field(
        300.0, gt=0, description="seconds a collective may wait inside training steps after the "
                                 "first; SHARDTRAIN_COLLECTIVE_TIMEOUT wins (shardtrain only)")
    slow_collective_timeout: Optional[_Float] = Field(
        None, gt=0, description="seconds for the first step and outside training steps "
                                "(checkpoint I/O, evaluation); null = the process group's timeout "
                                "(DEEPSPEED_TIMEOUT minutes, 10 by default) (shardtrain only)")
    divergence_check: Annotated[Literal["off", "step", "collective"], BeforeValidator(_lower)] = Field(
        "off", description="compare the ranks' collectives: off, step (one small all-gather per "
                           "optimizer step) or collective (before each one: debugging); "
                           "SHARDTRAIN_DIVERGENCE_CHECK wins (shardtrain only)")

    @model_validator(mode="after")
    def _check(self) -> "DiagnosticsConfig":
        slow = self.slow_collective_timeout
        if slow is not None and slow < self.collective_timeout:
            raise ConfigError(
                f"diagnostics.slow_collective_timeout ({slow:g} s) is below "
                f"diagnostics.collective_timeout ({self.collective_timeout:g} s): the first step "
                "and checkpoint I/O get the longer bound. Raise slow_collective_timeout or "
                "lower collective_timeout.")
        return self
