"""``deepspeed.checkpoint``: checkpoint helpers, and DeepSpeed's names for the keys of its
checkpoint files (``constants``). shardtrain's checkpoints load on any world size and ZeRO
stage as they are (``engine.load_checkpoint``), so DeepSpeed's conversion tools (universal
checkpoints, reshaping) have no counterpart."""
from . import constants, utils

__all__ = ["constants", "utils"]
