"""``deepspeed.runtime.pipe.dualpipev``: DeepSpeed's DualPipeV model and engine.

``DualPipeVModule`` is a :class:`~shardtrain.pipe.PipelineModule` cut into two chunks a stage
placed as a V (``virtual_stages=2, chunk_placement="v"``: stage r holds parts r and
``2 stages - 1 - r``, so the first stage reads the data and computes the loss, and a tied
embedding and head share one module there), which is DualPipeV's placement. ``initialize``
trains it with shardtrain's zero-bubble V schedule (``pipeline.schedule: "zbv"``, chosen when
the config names none): the same placement and the same losses, the order of its actions
shardtrain's own ([parallelism.md](../../../../../docs/parallelism.md#pipeline-parallelism)).
``DualPipeVEngine`` is the engine it returns.
"""
from typing import Any

from ....pipe import PipelineModule
from ....pipeline_engine import PipelineEngine

__all__ = ["DualPipeVModule", "DualPipeVEngine"]

DualPipeVEngine = PipelineEngine


class DualPipeVModule(PipelineModule):
    """A PipelineModule of two chunks a stage placed as a V (DeepSpeed's arguments)."""

    def __init__(self, *args: Any, **kwargs: Any):
        for key in ("virtual_stages", "chunk_placement"):
            if key in kwargs:
                raise TypeError(f"DualPipeVModule places two chunks a stage as a V itself: "
                                f"drop {key}=.")
        super().__init__(*args, virtual_stages=2, chunk_placement="v", **kwargs)
