"""``deepspeed.runtime.pipe.topology``: ranks on named axes (``PipelineParallelGrid`` is the
engine's ``mpu`` here: ``engine.mpu``)."""
from ....pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology"]
