"""The engine's life cycle and its training counters.

* :class:`Phase` is where the engine is in a training step. One value replaces the loose
  flags a step would otherwise need ("inside step()", "inside engine.backward", "a callback
  is queued"); the engine moves it at the edges of forward, backward and step, and every
  question about the step in progress reads it.
* :class:`TrainState` holds the counters DeepSpeed's engine exposes (``global_steps``,
  ``global_samples``, ``skipped_steps``, ``micro_steps``) as one stateful part, with
  ``state_dict``/``load_state_dict`` as ``torch.distributed.checkpoint`` expects of its parts.
* :class:`TrainingParts` is every stateful part of an engine, as checkpoints see them
  (``engine.training_parts()``): checkpoints read and restore the engine through it alone,
  as torchtitan's checkpointer holds a dict of stateful parts.

Example:
    >>> engine.train_state.state_dict()
    {'global_steps': 12, 'global_samples': 240, 'skipped_steps': 0, 'micro_steps': 48}
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

__all__ = ["Phase", "TrainState", "TrainingParts"]


class Phase(enum.Enum):
    """Where the engine is in a training step."""

    IDLE = "idle"           # between calls: the next micro-batch may start
    FORWARD = "forward"     # inside engine(*inputs), with gradients enabled
    BACKWARD = "backward"   # a backward pass runs (engine.backward or a plain loss.backward)
    STEP = "step"           # inside engine.step()


@dataclasses.dataclass
class TrainState:
    """How far training has come; saved in checkpoints and restored on load.

    Attributes:
        global_steps: optimizer steps taken (skipped fp16 overflow steps included).
        global_samples: samples consumed by those steps, over all ranks.
        skipped_steps: steps skipped on an fp16 overflow.
        micro_steps: ``engine.step()`` calls (one per micro-batch).
    """

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0

    def state_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: Mapping[str, Any], gradient_accumulation_steps: int) -> None:
        """Restores the counters. ``micro_steps`` is the next micro-step's place in the
        accumulation cycle: it is kept when the checkpoint was saved with the same
        ``gradient_accumulation_steps``; with another one the cycle restarts at the step."""
        self.global_steps = int(state["global_steps"])
        self.global_samples = int(state["global_samples"])
        self.skipped_steps = int(state["skipped_steps"])
        gas = gradient_accumulation_steps
        same_gas = int(state.get("gradient_accumulation_steps", gas)) == gas
        self.micro_steps = int(state["micro_steps"]) if same_gas else self.global_steps * gas


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """The stateful parts of an engine (references, not copies).

    Attributes:
        module: the model.
        optimizer: the optimizer (None when the engine has none).
        slots: what this rank's optimizer holds of each trainable parameter
            (:class:`shardtrain.zero.strategy.ParamSlot`).
        lr_scheduler, loss_scaler, dataloader: objects with ``state_dict``/``load_state_dict``
            (each may be None, but the loss scaler).
        train_state: the counters.
        precision: the precision policy (:class:`shardtrain.precision.Precision`).
        config: the resolved config.
        zero_stage: the ZeRO stage.
        gradient_accumulation_steps: the current value.
        device: where the model lives.
        mesh: the device mesh (:class:`shardtrain.comm.Mesh`): the data-parallel group the
            optimizer's slices are spread over, and the tensor-parallel one of ``tp_split``
            parameters.
    """

    module: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    slots: Sequence[Any]
    lr_scheduler: Any
    loss_scaler: Any
    dataloader: Any
    train_state: TrainState
    precision: Any
    config: Any
    zero_stage: int
    gradient_accumulation_steps: int
    device: torch.device
    mesh: Any = None
