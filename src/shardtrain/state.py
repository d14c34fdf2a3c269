"""The engine's life cycle and its training counters.

* :class:`Phase` is where the engine is in a training step, or that it was destroyed. One
  value replaces the loose flags a step would otherwise need ("inside step()", "inside
  engine.backward", "a callback is queued"); the engine moves it at the edges of forward,
  backward, step and ``destroy()``, and every question about the step in progress reads it.
* :class:`StepState` is what the optimizer step in progress has seen (``no_sync()``, the
  boundary override, the backward pass running and how many ran, the reduced gradients, the
  losses) and how the last one ended; the engine starts a new one at each update.
* :data:`live_engines` is the registry of the engines alive in this process
  (:class:`LiveEngines`): the rooms below the engine (pretrained weights, the ``deepspeed``
  tree's ``safe_get_full_*``) find the engine that trains a module or a parameter there,
  through the members :class:`RegisteredEngine` names, without importing the engine. It
  also holds the engines' lease on Python's garbage collector (``disable_python_gc``).
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
import gc
import threading
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence

import torch

__all__ = ["Phase", "BackwardPass", "StepState", "TrainState", "TrainingParts",
           "RegisteredEngine", "EngineFace", "LiveEngines", "live_engines"]


class Phase(enum.Enum):
    """Where the engine is in a training step."""

    IDLE = "idle"           # between calls: the next micro-batch may start
    FORWARD = "forward"     # inside engine(*inputs), with gradients enabled
    BACKWARD = "backward"   # a backward pass runs (engine.backward or a plain loss.backward)
    STEP = "step"           # inside engine.step()
    DESTROYED = "destroyed"  # after engine.destroy(): nothing more runs


@dataclasses.dataclass
class BackwardPass:
    """The backward pass running.

    Attributes:
        task: its autograd graph task, None until ``engine.backward``'s pass reaches an
            output hook (a plain ``loss.backward()`` is known by its task from the start).
        factor: what each output's gradient is multiplied by: 1 for ``engine.backward``,
            which scales the loss itself; the loss scale for a plain ``loss.backward()``.
    """

    task: Optional[int]
    factor: float


@dataclasses.dataclass
class StepState:
    """What the optimizer step in progress has seen, and how the last one ended.

    Attributes:
        no_sync: inside ``engine.no_sync()``: backward passes do not synchronise.
        boundary_override: ``set_gradient_accumulation_boundary``'s value (sticky), or None.
        backward: the backward pass running, or None.
        backward_calls: backward passes since the last update.
        reduced: the averaged gradients the optimizer will take, once reduced (this step;
            :class:`shardtrain.zero.strategy.ReducedGrads`).
        losses: the losses given to ``engine.backward`` (this step).
        applied: whether the last boundary ``step()`` updated the parameters.
        grad_norm: the unscaled global gradient norm of the last update (inf after an
            overflow; None when nothing needed it).
    """

    no_sync: bool = False
    boundary_override: Optional[bool] = None
    backward: Optional[BackwardPass] = None
    backward_calls: int = 0
    reduced: Any = None
    losses: List[torch.Tensor] = dataclasses.field(default_factory=list)
    applied: bool = False
    grad_norm: Optional[float] = None

    def clear_gradients(self) -> None:
        """The gradients of this step are dropped (after an update, or ``zero_grad()``)."""
        self.reduced, self.losses = None, []


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
            optimizer's slices are spread over, and the tensor-parallel one of split
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


class RegisteredEngine(Protocol):
    """What the rooms below the engine use of a live engine."""

    module: torch.nn.Module

    @property
    def strategy(self) -> Any:
        """The ZeRO strategy (``refresh_masters``, ``copy_masters_to_params``)."""

    def optimizer_slot(self, param: torch.Tensor) -> Any:
        """What this rank's optimizer holds of ``param``, or None."""


class LiveEngines:
    """The engines alive in this process (weak references: a dropped engine leaves).

    It also holds their lease on Python's cyclic garbage collector (DeepSpeed's
    ``disable_python_gc``: a collection pass over a large heap of tensors and modules can
    stall a step for tens of milliseconds at an unpredictable point): the first engine that
    joins asking for it turns the collector off, and the last of them to leave turns it back
    on if it was on before. Reference counting still frees everything without cycles;
    ``engine.collect_python_gc()`` runs one collection where the training loop chooses.
    """

    def __init__(self) -> None:
        self._engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._pausing_gc: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._gc_holders = 0
        self._gc_was_enabled = False
        self._lock = threading.Lock()

    def add(self, engine: RegisteredEngine, pause_gc: bool = False) -> None:
        """Registers ``engine``; with ``pause_gc``, it holds a lease on the collector until
        it leaves."""
        self._engines.add(engine)
        if pause_gc and engine not in self._pausing_gc:
            with self._lock:
                if self._gc_holders == 0:
                    self._gc_was_enabled = gc.isenabled()
                    gc.disable()
                self._gc_holders += 1
            self._pausing_gc.add(engine)

    def discard(self, engine: RegisteredEngine) -> None:
        """``engine`` leaves (its lease on the collector with it)."""
        self._engines.discard(engine)
        if engine in self._pausing_gc:
            self._pausing_gc.discard(engine)
            with self._lock:
                self._gc_holders -= 1
                if self._gc_holders == 0 and self._gc_was_enabled:
                    gc.enable()

    def __iter__(self) -> Iterator[RegisteredEngine]:
        return iter(list(self._engines))

    def __contains__(self, engine: object) -> bool:
        return engine in self._engines

    def of_module(self, module: torch.nn.Module) -> Optional[RegisteredEngine]:
        """The live engine that wraps ``module``, or None."""
        return next((e for e in self if e.module is module), None)

    def of_parameter(self, param: torch.Tensor) -> Optional[RegisteredEngine]:
        """The live engine that trains ``param``, or None."""
        return next((e for e in self if e.optimizer_slot(param) is not None), None)


#: The registry every engine joins when built and leaves at ``destroy()``.
live_engines = LiveEngines()


class EngineFace(Protocol):
    """The engine as telemetry and autotuning read it: counters, settings, the mesh and the
    step's outcome. Checkpoints read it through :class:`TrainingParts` instead."""

    config: Any
    module: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    mesh: Any
    device: torch.device
    global_rank: int
    world_size: int
    global_steps: int
    global_samples: int
    micro_steps: int

    @property
    def monitor(self) -> Any:
        """The step watch (telemetry)."""

    def train_batch_size(self) -> int: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def zero_optimization_stage(self) -> int: ...

    def get_lr(self) -> List[float]: ...

    def get_loss_scale(self) -> float: ...

    def get_global_grad_norm(self) -> Optional[float]: ...

    def was_step_applied(self) -> bool: ...

    def model_state_bytes(self) -> Dict[str, int]: ...

    def log_metrics(self, step: Optional[int] = None, **values: Any) -> None: ...
