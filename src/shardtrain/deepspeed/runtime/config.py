"""``deepspeed.runtime.config``: the parsed config.

``DeepSpeedConfig(config)`` returns shardtrain's :class:`~shardtrain.ShardConfig` (the same
keys, validated, with the batch triple resolved for the current world size); it reads as a
dict too (``cfg["train_batch_size"]``, ``cfg.get("zero_optimization", {})``).
"""
from __future__ import annotations

from ... import ConfigError, ShardConfig, comm, load_config

DeepSpeedConfigError = ConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


def DeepSpeedConfig(config, mpu=None, mesh_device=None) -> ShardConfig:  # noqa: N802 - DeepSpeed's name
    """Loads and validates ``config`` (a dict, a JSON/hjson path or base64 JSON)."""
    if mpu is not None or mesh_device is not None:
        raise NotImplementedError("DeepSpeedConfig(mpu=..., mesh_device=...): model parallelism "
                                  "is not supported by shardtrain; pass neither.")
    return load_config(config, comm.get_world_size())
