"""``deepspeed.runtime.config``: the parsed config, and DeepSpeed 0.19.8's names for optimizer
types and config keys.

``DeepSpeedConfig(config)`` returns shardtrain's :class:`~shardtrain.ShardConfig` (the same
keys, validated, with the batch triple resolved for the current world size); it reads as a
dict too (``cfg["train_batch_size"]``, ``cfg.get("zero_optimization", {})``).

The constants are DeepSpeed's values: the optimizer ``type`` names (``ADAM_OPTIMIZER`` is
``"adam"``; shardtrain builds ``adam``, ``adamw`` and ``adagrad`` and refuses the others by
name), the Adam parameters ``torch_adam`` and ``adam_w_mode``, and, as in DeepSpeed, every
name of ``deepspeed.runtime.constants``.

Example:
    >>> from deepspeed.runtime.config import ADAM_OPTIMIZER, OPTIMIZER, TYPE
    >>> config[OPTIMIZER] = {TYPE: ADAM_OPTIMIZER, "params": {"lr": 1e-3}}
"""
from __future__ import annotations

from ... import ConfigError, ShardConfig, comm, load_config
from .._constants import constant_names
from .constants import *  # noqa: F403 - DeepSpeed's config module re-exports them all
from .constants import ValidationMode

DeepSpeedConfigError = ConfigError

TENSOR_CORE_ALIGN_SIZE = 8
EXPERT_PARALLEL = "expert_parallel"

# -- the optimizer ``type`` names DeepSpeed builds itself ------------------------------------------
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER,
                        MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER,
                        MUON_OPTIMIZER]

# -- Adam's parameters beyond torch's: torch's own implementation, and decoupled weight decay -----
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError", "ValidationMode", *constant_names(globals())]


def DeepSpeedConfig(config, mpu=None, mesh_device=None) -> ShardConfig:  # noqa: N802 - DeepSpeed's name
    """Loads and validates ``config`` (a dict, a JSON/hjson path or base64 JSON); with an
    ``mpu``, the batch arithmetic counts its data-parallel ranks."""
    if mesh_device is not None:
        raise NotImplementedError("DeepSpeedConfig(mesh_device=...): set the mesh in the config "
                                  "(tensor_parallel.autotp_size, sequence_parallel_size) instead.")
    dp = mpu.get_data_parallel_world_size() if mpu is not None else None
    return load_config(config, comm.get_world_size(), data_parallel_world_size=dp)
