"""Pipeline parallelism: a model as a list of layers split into stages across ranks
(:class:`PipelineModule`), the process topologies DeepSpeed scripts describe their mesh with,
how layers are cut into stages (``partition``), and the order each stage runs its
micro-batches in (``schedule``). ``shardtrain.initialize`` wraps a ``PipelineModule`` in a
:class:`~shardtrain.pipeline_engine.PipelineEngine`, whose ``train_batch()`` runs the
schedule ([parallelism.md](../../docs/parallelism.md#pipeline-parallelism)).
"""
from __future__ import annotations

from .hf import causal_lm_loss, split_causal_lm
from .module import LayerSpec, PipelineModule, TiedLayerSpec, TiedWeight
from .partition import partition_balanced, partition_uniform
from .schedule import SCHEDULES, bubble_fraction, eval_actions, train_actions
from .settings import PipelineSettings, read_settings
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "PipelineModule", "LayerSpec", "TiedLayerSpec", "TiedWeight", "ProcessTopology",
    "PipeDataParallelTopology", "PipeModelDataParallelTopology", "partition_uniform",
    "partition_balanced", "SCHEDULES", "train_actions", "eval_actions", "bubble_fraction",
    "PipelineSettings", "read_settings", "split_causal_lm", "causal_lm_loss",
]
