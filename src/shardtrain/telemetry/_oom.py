"""Out-of-memory reports: what a person needs to read when a step runs out of memory.

Three errors count as out of memory: the device allocator's (``torch.OutOfMemoryError``,
CUDA's), the CPU allocator's (a plain ``RuntimeError`` "DefaultCPUAllocator: can't allocate
memory") and the memory budget's (:class:`~shardtrain.autotune.OutOfMemoryError`, raised on
the CPU from the measured bytes, see :mod:`._memory_probe`). When one escapes the engine's
forward, backward or step, :class:`OomReporter` builds a new error of the same kind (the
CPU allocator's becomes the budget's class, still a ``RuntimeError``) whose message says
where it happened, what this rank held, what ``shardtrain estimate`` predicts for the same
model, stage and world, and what to do; the original error is its ``__cause__``.

With ``SHARDTRAIN_MEMORY_SNAPSHOT=<dir>`` on CUDA the allocator's history is recorded from
the engine's start and each rank dumps it to ``<dir>/oom-rank<R>.pickle`` on the error.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Tuple

import torch

from .. import accelerator
from ..layout import layout_of
from ..memory import format_bytes
from ..autotune.budget import OutOfMemoryError
from ..memory import bytes_per_param, estimate_model_states
from ..zero import GATHERING
from ..state import EngineFace

#: Environment variable naming a directory: on CUDA, each rank writes its allocator's
#: recorded history there when it runs out of memory (``oom-rank<R>.pickle``).
SNAPSHOT_ENV = "SHARDTRAIN_MEMORY_SNAPSHOT"
#: Allocation events the snapshot keeps (the oldest are dropped past it).
SNAPSHOT_ENTRIES = 100_000

_CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    """The device's, the CPU allocator's or the memory budget's out-of-memory error."""
    if isinstance(error, (OutOfMemoryError, torch.OutOfMemoryError)):
        return True
    return type(error) is RuntimeError and _CPU_ALLOCATOR in str(error)


@dataclasses.dataclass
class OomFacts:
    """What the report says; each field that is None is left out of the message."""

    rank: int
    position: str                   # "step 3, micro-step 1 of 2"
    phase: str                      # forward, backward, step
    cause: str                      # the first line of the original error
    micro_batch: Optional[int]      # the leading dimension of the last forward's inputs
    configured_micro_batch: int     # train_micro_batch_size_per_gpu
    stage: int
    world: int                      # ranks ZeRO shards over
    states: Dict[str, int]          # this rank's model_state_bytes()
    predicted: int                  # shardtrain estimate's model states per rank
    predicted_how: str              # its options and formula
    gathering: Optional[str] = None         # the module whose parameters were being gathered
    activation: Optional[int] = None        # saved-activation bytes of the last micro-batch
    device: Optional[Dict[str, int]] = None  # allocated, peak, total (CUDA)
    snapshot: Optional[str] = None          # the line about the memory snapshot
    advice: List[str] = dataclasses.field(default_factory=list)


def format_report(f: OomFacts) -> str:
    """The message: a head line, then one indented line per fact."""
    batch = (f"micro-batch of {f.micro_batch}" if f.micro_batch is not None
             else "micro-batch size unknown")
    lines = [f"out of memory on rank {f.rank} at {f.position}, in {f.phase} ({batch}; "
             f"train_micro_batch_size_per_gpu is {f.configured_micro_batch})",
             f"  {f.cause}"]
    if f.gathering is not None:
        lines.append(f"  while gathering the parameters of module {f.gathering} (ZeRO stage 3)")
    s = f.states
    lines.append(f"  measured on this rank: model states {format_bytes(s['total'])} (parameters "
                 f"{format_bytes(s['params'])}, gradients {format_bytes(s['grads'])}, optimizer "
                 f"{format_bytes(s['optimizer'] + s['master'])})"
                 + (f"; activations of the last micro-batch {format_bytes(f.activation)}"
                    if f.activation is not None else ""))
    if f.device is not None:
        lines.append(f"  device: {format_bytes(f.device['allocated'])} allocated, peak "
                     f"{format_bytes(f.device['peak'])}, of {format_bytes(f.device['total'])}")
    lines.append(f"  shardtrain estimate predicts {format_bytes(f.predicted)} of model states per "
                 f"rank at stage {f.stage} over {f.world} rank{'s' if f.world > 1 else ''} "
                 f"({f.predicted_how}); activations come on top")
    if f.snapshot is not None:
        lines.append(f"  memory snapshot: {f.snapshot}")
    if f.advice:
        lines += ["  what to do:", *(f"    - {line}" for line in f.advice)]
    return "\n".join(lines)


class OomReporter:
    """Turns an out-of-memory error escaping the engine into a report (:meth:`report`);
    starts the CUDA allocator's history when ``SHARDTRAIN_MEMORY_SNAPSHOT`` is set."""

    def __init__(self, engine: EngineFace):
        self.engine = engine
        self.snapshot_dir = os.environ.get(SNAPSHOT_ENV) or None
        self.recording = bool(self.snapshot_dir) and accelerator.record_memory_history(SNAPSHOT_ENTRIES)

    def report(self, error: BaseException, phase: str, micro_batch: Optional[int],
               activation: Optional[int], counters: Optional[Tuple[int, int]] = None
               ) -> Optional[BaseException]:
        """The error to raise instead of ``error``; None when ``error`` is not out of
        memory, or is already a report (an engine inside another engine's forward).
        ``counters`` are (global steps, micro-steps) where the step began, when they have
        advanced since (default: the engine's now)."""
        if not is_out_of_memory(error) or getattr(error, "shardtrain_report", False):
            return None
        text = format_report(self.facts(error, phase, micro_batch, activation, counters))
        kind = type(error) if isinstance(error, (OutOfMemoryError, torch.OutOfMemoryError)) \
            else OutOfMemoryError
        out = kind(text)
        out.shardtrain_report = True  # type: ignore[attr-defined]
        return out

    def facts(self, error: BaseException, phase: str, micro_batch: Optional[int],
              activation: Optional[int], counters: Optional[Tuple[int, int]] = None) -> OomFacts:
        e = self.engine
        gas = e.gradient_accumulation_steps()
        steps, micro = counters or (e.global_steps, e.micro_steps)
        predicted, how = predicted_model_states(e)
        stats = accelerator.memory_stats()
        return OomFacts(
            rank=e.global_rank,
            position=f"step {steps + 1}, micro-step {micro % gas + 1} of {gas}",
            phase=phase, cause=(str(error).strip().splitlines() or [type(error).__name__])[0],
            micro_batch=micro_batch, configured_micro_batch=e.train_micro_batch_size_per_gpu(),
            stage=e.zero_optimization_stage(), world=e.mesh.zero.size(),
            states=e.model_state_bytes(), predicted=predicted, predicted_how=how,
            gathering=gathered_module(error, e.module), activation=activation,
            device=dict(stats, total=accelerator.total_memory()) if stats else None,
            snapshot=self._snapshot(), advice=advice(e))

    def _snapshot(self) -> Optional[str]:
        if not self.snapshot_dir:
            return None
        if not self.recording:
            return (f"{SNAPSHOT_ENV} is set, but snapshots record the CUDA allocator: none is "
                    f"written on the CPU")
        path = os.path.join(self.snapshot_dir, f"oom-rank{self.engine.global_rank}.pickle")
        try:
            os.makedirs(self.snapshot_dir, exist_ok=True)
            accelerator.dump_memory_snapshot(path)
        except OSError as err:
            return f"could not write {path}: {err.strerror or err}"
        return f"{path} (open it at https://pytorch.org/memory_viz to see what held the memory)"


def gathered_module(error: BaseException, module: torch.nn.Module) -> Optional[str]:
    """The module whose stage-3 parameter group was being gathered when ``error`` was
    raised (the gather names it on the error; None outside a gather)."""
    name = getattr(error, GATHERING, None)
    if name is None:
        return None
    if name == "(root)":
        return f"(the root module, {type(module).__name__})"
    try:
        return f"{name!r} ({type(module.get_submodule(name)).__name__})"
    except AttributeError:
        return repr(name)


def predicted_model_states(engine: EngineFace) -> Tuple[int, str]:
    """What ``shardtrain estimate`` predicts for this rank's model states: its formula with
    the engine's parameter dtype and optimizer, over the ranks ZeRO shards over. Returns
    ``(bytes, how)``."""
    params = list({id(p): p for p in engine.module.parameters()}.values())
    floats = [p for p in params if p.is_floating_point()]
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        floats[0].dtype if floats else torch.float32, "fp32")
    optimizer = "sgd" if type(engine.optimizer).__name__.lower().startswith("sgd") else "adam"
    cfg = engine.config
    accum = cfg.data_types.grad_accum_dtype
    b = bytes_per_param(dtype, optimizer, "fp32" if accum == torch.float32 else None,
                        bool(cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads))

    def numel(p: torch.nn.Parameter) -> int:
        return layout_of(p).local_numel

    trainable = sum(numel(p) for p in params if p.requires_grad)
    frozen = sum(numel(p) for p in params if not p.requires_grad)
    persistent = sum(numel(p) for p in params if layout_of(p).persistent)
    total = estimate_model_states(trainable, frozen, persistent, engine.mesh.zero.size(),
                                  engine.zero_optimization_stage(), b)["total"]
    how = (f"--dtype {dtype} --optimizer {optimizer}: p = {b.p}, g = {b.g}, K = {b.k} bytes "
           f"per parameter, {trainable + frozen:,} parameters")
    return total, how


def advice(engine: EngineFace) -> List[str]:
    """What to try, most direct first, leaving out what is already on."""
    stage = engine.zero_optimization_stage()
    out = ["lower train_micro_batch_size_per_gpu (raise gradient_accumulation_steps to keep "
           "the batch size)",
           "wrap the model's blocks in shardtrain.checkpointing.checkpoint (activation "
           "checkpointing): activations are recomputed in backward instead of kept"]
    if stage < 3:
        out.append(f"raise zero_optimization.stage (now {stage}) to shard more of the model "
                   f"states across ranks")
    if stage > 0 and engine.config.zero_optimization.offload_optimizer is None:
        out.append("offload the optimizer states to the host (zero_optimization.offload_optimizer)")
    out.append("`shardtrain estimate` shows the model states of every stage; `shardtrain "
               "autotune` finds the largest micro-batch that fits")
    return out
