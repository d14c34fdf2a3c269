"""``deepspeed.runtime.pipe``: the pipeline-parallel model and its topology."""
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
