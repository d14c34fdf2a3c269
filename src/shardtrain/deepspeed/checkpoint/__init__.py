"""``deepspeed.checkpoint``: checkpoint helpers. shardtrain's checkpoints load on any world
size and ZeRO stage as they are (``engine.load_checkpoint``), so DeepSpeed's conversion
tools (universal checkpoints, reshaping) have no counterpart."""
from . import utils

__all__ = ["utils"]
