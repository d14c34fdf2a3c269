"""``deepspeed.runtime.pipe.module``: the layers of a model split into pipeline stages."""
from ....errors import PipelineError
from ....pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError"]
