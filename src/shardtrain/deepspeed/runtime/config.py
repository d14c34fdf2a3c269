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
    """Loads and validates ``config`` (a dict, a JSON/hjson path or base64 JSON); with an
    ``mpu``, the batch arithmetic counts its data-parallel ranks."""
    if mesh_device is not None:
        raise NotImplementedError("DeepSpeedConfig(mesh_device=...): set the mesh in the config "
                                  "(tensor_parallel.autotp_size, sequence_parallel_size) instead.")
    dp = mpu.get_data_parallel_world_size() if mpu is not None else None
    return load_config(config, comm.get_world_size(), data_parallel_world_size=dp)
