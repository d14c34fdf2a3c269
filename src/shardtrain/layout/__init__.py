"""Where each parameter lives: one public record, read by every room that needs it.

A parameter may be split along a dimension over a tensor-parallel group
(:class:`SplitSpec`), and its piece cut into even shards over a data-parallel group by
ZeRO-3 (:func:`shard_range`). :func:`layout_of` returns the :class:`ParamLayout` that says
both (and which stage-3 unit gathers it): checkpoints, pretrained weights, full weights,
telemetry and the ``deepspeed`` tree read a parameter's full shape, its split and its shard
there, instead of attributes on the tensor. The rooms that split parameters (``parallel/``,
``zero/``) write it with :func:`place`, which also writes DeepSpeed's ``ds_*`` attributes
for the libraries that read them.

Example:
    >>> from shardtrain.layout import layout_of
    >>> layout = layout_of(engine.module.fc1.weight)
    >>> layout.full_shape, layout.shard        # at stage 3 on 2 ranks: (64, 32), (0, 1024)
"""
from ._even import chunk_size, shard_range
from ._record import ExpertSplit, ParamLayout, layout_of, place
from ._split import SplitSpec

__all__ = ["ExpertSplit", "ParamLayout", "layout_of", "place", "SplitSpec", "chunk_size", "shard_range",
           "is_tp_split"]


def is_tp_split(param) -> bool:
    """Whether ``param`` holds one rank's tensor-parallel shard.

    Example:
        >>> [name for name, p in model.named_parameters() if is_tp_split(p)]
    """
    return layout_of(param).tp is not None
