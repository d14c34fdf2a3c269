"""ZeRO strategies: where parameters, gradients and optimizer states live, and the
collectives that move them. One strategy per stage, over shared bucketing helpers."""
from .stage0 import DataParallel, ReduceSettings
from .stage12 import ZeroStage1, ZeroStage2

__all__ = ["DataParallel", "ReduceSettings", "ZeroStage1", "ZeroStage2"]
