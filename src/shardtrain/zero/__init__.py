"""ZeRO: sharding model states across data-parallel ranks.

Public: :class:`Init` (build a model already partitioned, for stage 3),
:class:`GatheredParameters` (gather partitioned parameters for a ``with`` block) and
:class:`ZeroParamStatus`. The strategies (one per stage) are the engine's machinery.
"""
from ._params import GatheredParameters, ZeroParamStatus
from .init import Init
from .stage0 import DataParallel, ReduceSettings
from .stage12 import ZeroStage1, ZeroStage2
from .stage3 import ZeroStage3

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "DataParallel", "ReduceSettings",
           "ZeroStage1", "ZeroStage2", "ZeroStage3"]
