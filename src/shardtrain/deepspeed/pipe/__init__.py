"""``deepspeed.pipe``: DeepSpeed's pipeline-parallel model classes, shardtrain's
(:mod:`shardtrain.pipe`); ``DualPipeVModule`` is not provided."""
from ...pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec"]
