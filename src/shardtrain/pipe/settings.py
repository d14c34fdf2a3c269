"""The ``pipeline`` config block, read when the model is a :class:`PipelineModule`.

DeepSpeed's keys: ``activation_checkpoint_interval`` (when above 0, it replaces the module's),
``use_reentrant`` (accepted: shardtrain's activation checkpointing picks torch's variant
itself), ``pipe_partitioned`` and ``grad_partitioned`` (DeepSpeed splits the
activations it sends over the tensor-parallel ranks; here each rank of a tensor-parallel group
sends its own copy to its partner of the next stage, so both are accepted and change nothing),
``partition`` (the module's own ``partition_method`` decides; DeepSpeed's engine does not read
it either), ``seed_layers``, and ``stages``: the module's ``num_stages`` decides, and
``initialize`` splits a Hugging Face causal LM given whole into that many stages. Ours: ``schedule``, the order
in which each stage runs its micro-batches (``"1f1b"``, DeepSpeed's, ``"gpipe"``,
``"interleaved"`` for a module built with ``virtual_stages`` > 1, or ``"zbv"``, the
zero-bubble V, for one built with ``virtual_stages=2, chunk_placement="v"``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .schedule import SCHEDULES

__all__ = ["PipelineSettings", "read_settings"]

_ACCEPTED = ("stages", "partition", "seed_layers", "pipe_partitioned", "grad_partitioned",
             "use_reentrant")


@dataclass(frozen=True)
class PipelineSettings:
    schedule: str = "1f1b"
    activation_checkpoint_interval: int = 0


def read_settings(block: Mapping[str, Any]) -> PipelineSettings:
    """The block's settings; a key this engine does not know, or a bad value, is refused."""
    known = set(_ACCEPTED) | {"schedule", "activation_checkpoint_interval"}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(f"pipeline: unknown key(s) {', '.join(map(repr, unknown))}; the block "
                         f"takes {', '.join(sorted(known))}.")
    schedule = str(block.get("schedule", "1f1b")).lower()
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule {block['schedule']!r} is not one of "
                         f"{', '.join(SCHEDULES)}.")
    interval = block.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ValueError(f"pipeline.activation_checkpoint_interval must be an integer >= 0, got "
                         f"{interval!r}.")
    for key in ("use_reentrant", "pipe_partitioned", "grad_partitioned", "seed_layers"):
        if key in block and block[key] is not None and not isinstance(block[key], bool):
            raise ValueError(f"pipeline.{key} must be true or false, got {block[key]!r}.")
    return PipelineSettings(schedule, interval)
