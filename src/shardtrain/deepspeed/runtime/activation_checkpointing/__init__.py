"""``deepspeed.runtime.activation_checkpointing``: the package of ``deepspeed.checkpointing``."""
from . import checkpointing

__all__ = ["checkpointing"]
