"""How large a micro-batch each ZeRO stage leaves room for, before any trial runs.

Model states follow the ZeRO formula (:func:`shardtrain.memory.zero_formula_bytes`) with the
bytes per parameter a profile run measured; activations grow linearly with the micro-batch at
the measured bytes per sample. The answer is a prediction: the search runs trials around it
rather than trusting it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Sequence

from ..memory import zero_formula_bytes

__all__ = ["StageFit", "stage_fits"]


@dataclasses.dataclass(frozen=True)
class StageFit:
    """What one ZeRO stage leaves for activations under a budget.

    Attributes:
        stage: the ZeRO stage.
        model_state_bytes: parameters, gradients and optimizer states per rank (ZeRO formula
            with the bytes per parameter the profile measured).
        max_micro_batch: the largest micro-batch whose activations fit beside them (0: none).
    """

    stage: int
    model_state_bytes: int
    max_micro_batch: int


def stage_fits(model_info: Dict[str, Any], budget: int, world_size: int,
               stages: Sequence[int], min_micro_batch: int = 1, max_micro_batch: int = 1024
               ) -> List[StageFit]:
    """The largest micro-batch per stage whose model states plus activations fit ``budget``.

    Model states follow the ZeRO formula with the measured bytes per parameter
    (``model_info["bytes_per_param"]``: p, g, K); activations grow linearly with the
    micro-batch at ``activation_mem_per_sample`` bytes per sample.

    Args:
        model_info: a model-info profile (see ``docs/monitoring.md``).
        budget: bytes per rank.
        world_size: ranks the trials run on.
        stages: the ZeRO stages to consider.
        min_micro_batch, max_micro_batch: bounds on the answer; below the minimum a stage
            does not fit (``max_micro_batch`` 0).

    Example:
        >>> stage_fits(info, budget=2**30, world_size=2, stages=[0, 3])[0].max_micro_batch
    """
    per_param = model_info["bytes_per_param"]
    trainable = model_info["trainable_num_params"]
    frozen = model_info["num_params"] - trainable
    per_sample = max(1.0, float(model_info["activation_mem_per_sample"]))
    fits = []
    for stage in stages:
        states = (zero_formula_bytes(trainable, world_size, stage, per_param["params"],
                                     per_param["grads"], per_param["optimizer"])
                  + zero_formula_bytes(frozen, world_size, stage, per_param["params"], 0, 0))
        room = budget - states
        largest = int(room // per_sample) if room > 0 else 0
        largest = min(largest, max_micro_batch)
        fits.append(StageFit(stage, int(math.ceil(states)), largest if largest >= min_micro_batch else 0))
    return fits
