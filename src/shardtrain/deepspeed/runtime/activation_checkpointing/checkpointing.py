"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``):
activation checkpointing, as :mod:`shardtrain.activation_checkpointing` provides it."""
from ....activation_checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
