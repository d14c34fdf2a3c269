"""``deepspeed.runtime.sequence_parallel``: the tiled compute of DeepSpeed's long-sequence
training (ALST), in :mod:`.ulysses_sp`."""
from . import ulysses_sp

__all__ = ["ulysses_sp"]
