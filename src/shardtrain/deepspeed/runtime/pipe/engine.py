"""``deepspeed.runtime.pipe.engine``: the engine ``initialize`` returns for a
``PipelineModule``."""
from ....pipeline_engine import PipelineEngine

__all__ = ["PipelineEngine"]
