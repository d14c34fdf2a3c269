"""``deepspeed.accelerator.abstract_accelerator``: the accelerator class."""
from . import DeepSpeedAccelerator

__all__ = ["DeepSpeedAccelerator"]
