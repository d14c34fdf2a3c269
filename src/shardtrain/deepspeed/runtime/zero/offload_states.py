"""``deepspeed.runtime.zero.offload_states``: where a kind of model state lives now.

The moves themselves are the engine's (``engine.offload_states()``/``reload_states()``, and
the same two on ``engine.optimizer``); DeepSpeed's helpers that move a bare Adam optimizer's
states (``offload_adam_states``, ``reload_adam_states``) are refused with that pointer.

Example:
    >>> from deepspeed.runtime.zero.offload_states import get_state_devices
    >>> engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    >>> get_state_devices(engine, OffloadStateTypeEnum.optim_states)
    {device(type='cpu')}
"""
from __future__ import annotations

from typing import Any, Set

import torch

from ..._missing import unsupported_function
from .offload_config import OffloadStateTypeEnum

__all__ = ["get_state_devices", "offload_adam_states", "reload_adam_states"]


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> Set[torch.device]:
    """The devices holding ``state`` of the engine ``model``: the host while
    ``offload_states()`` has it there, the engine's device otherwise."""
    kind = str(getattr(state, "value", state))
    if kind not in {s.value for s in OffloadStateTypeEnum}:
        raise ValueError(f"get_state_devices: unknown state {state!r}; one of "
                         f"{[s.value for s in OffloadStateTypeEnum]}.")
    return {torch.device("cpu") if kind in model.offloaded_states else model.device}


_INSTEAD = "engine.offload_states() / engine.reload_states() (or the same on engine.optimizer)"
offload_adam_states = unsupported_function(
    "deepspeed.runtime.zero.offload_states.offload_adam_states",
    "moving a bare optimizer's states", _INSTEAD)
reload_adam_states = unsupported_function(
    "deepspeed.runtime.zero.offload_states.reload_adam_states",
    "moving a bare optimizer's states", _INSTEAD)
