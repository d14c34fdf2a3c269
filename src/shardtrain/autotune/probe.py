"""The engine's side of autotuning: a run the autotuner starts measures itself, then exits.

Two kinds of run, chosen by the ``autotuning`` block of the config the autotuner writes: a
model-info profile (parameters, activation memory per sample, bytes per parameter:
:func:`model_info_record`) and a trial (samples/s, latency and peak memory under a budget).
The engine's :class:`~shardtrain.telemetry.watch.StepWatch` hands the probe every rank's peak
memory after each optimizer step; rank 0 writes the JSON the autotuner waits for, and every
rank exits, as DeepSpeed's runs do.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .. import accelerator, comm
from ..log import log_dist
from ..files import write_json
from ..layout import layout_of
from .budget import MEMORY_BUDGET_ENV, OutOfMemoryError, memory_budget_from_env
from ..state import EngineFace

if TYPE_CHECKING:
    from ..telemetry.activation import ActivationMemory

__all__ = ["TuningProbe", "model_info_record"]


def model_info_record(engine: EngineFace, activation: ActivationMemory, micro_batch: int) -> Dict[str, Any]:
    """The model-info profile of a running engine (DeepSpeed's keys first, then shardtrain's).

    Called after an optimizer step, when gradients and optimizer states exist.
    """
    params = list(engine.module.parameters())
    numel = [layout_of(p).local_numel for p in params]
    states = engine.model_state_bytes()
    return {
        "num_params": sum(numel),
        "trainable_num_params": sum(n for n, p in zip(numel, params) if p.requires_grad),
        "activation_mem_per_gpu": activation.bytes,
        "rank": 0,
        "activation_mem_per_sample": activation.bytes / max(1, micro_batch),
        "activation_method": activation.method,
        "saved_tensor_bytes": activation.saved_bytes,
        "micro_batch_size": micro_batch,
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "world_size": engine.world_size,
        "stage": engine.zero_optimization_stage(),
        "model_state_bytes": states,
        "bytes_per_param": _bytes_per_param(engine, states),
        "device": accelerator.device_name(),
        "device_memory": accelerator.total_memory(),
    }


def _bytes_per_param(engine: EngineFace, states: Dict[str, int]) -> Dict[str, float]:
    """p, g and K of the ZeRO formula, as measured: each category's bytes over the elements
    it is made of, which holds at any stage and world size."""
    params = [p for p in engine.module.parameters() if p.is_floating_point()]
    p_bytes = params[0].element_size() if params else 4
    owned = sum(t.numel() for group in engine.optimizer.param_groups for t in group["params"]) \
        if engine.optimizer is not None else 0
    k = (states.get("optimizer", 0) + states.get("master", 0)) / owned if owned else 0.0
    return {"params": float(p_bytes), "grads": float(p_bytes), "optimizer": float(k)}


class TuningProbe:
    """The engine's part of autotuning, driven by the ``autotuning`` config block.

    * A model-info profile (``autotuning.model_info.profile``): every micro-batch's activation
      memory is measured; after the second optimizer step (so that the first step's one-time
      allocations, such as cuBLAS workspaces and optimizer states, are not taken for
      activations) rank 0 writes :func:`model_info_record` with the last micro-batch's
      measure to ``model_info_path``, and every rank exits.
    * A trial (``autotuning.enabled``): the steps after ``start_profile_step`` up to
      ``end_profile_step`` are timed; then rank 0 writes DeepSpeed's metrics (``latency`` in ms
      per step, ``throughput`` in samples/s, ``FLOPS_per_gpu``) plus ``peak_memory`` (the
      largest per-rank peak) to ``metric_path``, and every rank exits. Under a memory budget
      (``SHARDTRAIN_MEMORY_BUDGET``), a step whose peak exceeds it raises
      :class:`OutOfMemoryError` on every rank.

    Exiting is DeepSpeed's behaviour too: such a run exists to be measured.
    """

    #: The optimizer step after which a model-info profile is written.
    PROFILE_STEP = 2

    def __init__(self, tuning: Any, rank: int):
        self.profile = tuning.profiles_model_info
        self.trial = tuning.enabled and not self.profile
        self.rank = rank
        self.path = tuning.resolved_model_info_path() if self.profile else tuning.metric_path
        self.start, self.end = tuning.start_profile_step, tuning.end_profile_step
        self.flops_step = self.start - 1 if self.trial and tuning.metric == "flops" else None
        self.budget = memory_budget_from_env() if self.trial else None
        self.peak = 0
        self._marks: Dict[int, float] = {0: time.perf_counter()}
        if self.budget is not None:
            accelerator.limit_memory(self.budget)

    @property
    def active(self) -> bool:
        return self.profile or self.trial

    def after_step(self, engine: EngineFace, peaks: List[int], activation: Optional[ActivationMemory],
                   flops_per_step: Optional[float]) -> None:
        """Called on every rank after each optimizer step, with every rank's peak memory."""
        self.peak = max([self.peak, *peaks])
        if self.profile and engine.global_steps < self.PROFILE_STEP:
            return
        if self.profile:
            assert activation is not None, "the profile's forward was not measured"
            if self.rank == 0:
                write_json(self.path, model_info_record(engine, activation,
                                                        engine.train_micro_batch_size_per_gpu()))
            log_dist(f"autotuning: model info written to {self.path}; exiting (this run is a profile)")
            comm.barrier()
            raise SystemExit(0)
        if self.budget is not None and self.peak > self.budget:
            raise OutOfMemoryError(f"a step needed {self.peak:,} bytes on some rank, above the memory budget "
                                   f"{MEMORY_BUDGET_ENV}={self.budget:,} (model states plus activations)")
        step = engine.global_steps
        self._marks[step] = time.perf_counter()
        if step < self.end:
            return
        latency = (self._marks[self.end] - self._marks[self.start]) / (self.end - self.start)
        metrics = {"latency": latency * 1000.0, "throughput": engine.train_batch_size() / latency,
                   "FLOPS_per_gpu": flops_per_step / latency if flops_per_step else None,
                   "peak_memory": self.peak, "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                   "stage": engine.zero_optimization_stage(), "world_size": engine.world_size,
                   "steps": self.end - self.start}
        if self.rank == 0 and self.path:
            write_json(self.path, metrics)
        log_dist(f"autotuning: {metrics['throughput']:.1f} samples/s, {metrics['latency']:.1f} ms per step, "
                 f"peak {self.peak:,} bytes per rank; exiting (this run is a trial)")
        comm.barrier()
        raise SystemExit(0)
