"""``deepspeed.compression``: only the attribute helpers scripts import (compression
training itself was removed from DeepSpeed 0.19.8 too)."""
from . import helper

__all__ = ["helper"]
