"""``deepspeed.runtime``: the engine, ZeRO, schedules and optimizer base, by DeepSpeed's paths.
The submodules are imported here, as DeepSpeed does, so that attribute paths such as
``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` work after ``import deepspeed``."""
from . import (activation_checkpointing, base_optimizer, config, constants, engine, lr_schedules,
               sequence_parallel, utils, zero)

__all__ = ["activation_checkpointing", "base_optimizer", "config", "constants", "engine", "lr_schedules",
           "sequence_parallel", "utils", "zero"]
