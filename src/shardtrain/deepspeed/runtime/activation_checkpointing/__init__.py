"""``deepspeed.runtime.activation_checkpointing``."""
from . import checkpointing

__all__ = ["checkpointing"]
