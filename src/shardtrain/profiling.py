"""Measuring what training costs: activation memory, FLOPs and time; and the autotuner.

* :class:`SavedTensorMeter` and :func:`measure_activation_memory`: what one micro-batch keeps
  for backward (on CUDA, the allocator's peak; on the CPU, the bytes of the tensors autograd
  saves, so it works without a GPU);
* :class:`Timers`: wall-clock timers that synchronise the device, built only when timing is on;
* :class:`FlopsProfiler`: FLOPs, parameters and forward latency per module
  (``torch.utils.flop_counter.FlopCounterMode`` does the counting) and :func:`peak_flops`,
  for model FLOPs utilisation;
* :func:`autotune` / :func:`autotune_main` (``shardtrain autotune``): profile the model, compute
  the largest micro-batch per ZeRO stage that fits a memory budget, run short trials around it
  and keep the fastest configuration.

The engine uses these through :mod:`shardtrain.monitor`, driven by the config keys
``wall_clock_breakdown``, ``flops_profiler`` and ``autotuning`` (see ``docs/monitoring.md``).

Example:
    >>> with SavedTensorMeter(model) as meter:
    ...     loss = model(x).sum()
    >>> meter.bytes                      # activation bytes this forward keeps for backward
    >>> profiler = FlopsProfiler(model)
    >>> with profiler, profiler.forward():
    ...     model(x)
    >>> profiler.result().forward_flops  # 2 * batch * in * out for one nn.Linear
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import accelerator
from ._fileio import atomic_path

__all__ = [
    "SavedTensorMeter", "ActivationMemory", "measure_activation_memory", "Timers",
    "FlopsProfiler", "FlopsProfile", "ModuleCost", "peak_flops", "OutOfMemoryError",
    "MEMORY_BUDGET_ENV", "StageFit", "stage_fits", "autotune", "AutotuneResult", "Trial",
    "autotune_main", "parse_size", "TuningProbe", "model_info_record", "format_trials",
    "add_autotune_parser",
]

#: Environment variable that gives a process a memory budget in bytes. The autotuner sets it
#: for its trials: on CUDA the allocator is capped there; on the CPU a step whose model states
#: plus activations exceed it raises :class:`OutOfMemoryError`, as a GPU would.
MEMORY_BUDGET_ENV = "SHARDTRAIN_MEMORY_BUDGET"
#: Peak dense TFLOP/s of one device, for model FLOPs utilisation when the table below does
#: not know the device (or to override it).
PEAK_TFLOPS_ENV = "SHARDTRAIN_PEAK_TFLOPS"


class OutOfMemoryError(RuntimeError):
    """A step needed more memory than the budget (``SHARDTRAIN_MEMORY_BUDGET``) allows.

    Raised on the CPU, where an oversized batch would swap instead of failing; on CUDA the
    allocator raises ``torch.cuda.OutOfMemoryError`` itself.
    """


# ==============================================================================================
# Activation memory
# ==============================================================================================


class SavedTensorMeter:
    """Counts the bytes of the tensors autograd saves for backward while it is active.

    Those tensors are a forward pass's activation memory: they stay alive until backward
    frees them. Each storage counts once (a layer's output that the next layer saves as its
    input is one tensor), and only the bytes the saved views cover (a batch sliced from a
    large tensor costs its slice). Parameters and buffers of ``module`` are left out: they are
    model states and alive anyway. Tensors saved inside a checkpointed region are not seen,
    since the checkpoint does not keep them.

    Args:
        module: the model whose parameters and buffers are not activations (optional).

    Example:
        >>> with SavedTensorMeter(model) as meter:
        ...     out = model(x)
        >>> meter.bytes
    """

    def __init__(self, module: Optional[torch.nn.Module] = None):
        self.module = module
        self.bytes = 0
        self._spans: Dict[int, List[Tuple[int, int]]] = {}
        self._excluded: set = set()
        self._hooks: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "SavedTensorMeter":
        self._spans = {}
        self._excluded = set()
        if self.module is not None:
            tensors = list(self.module.parameters()) + list(self.module.buffers())
            self._excluded = {t.untyped_storage().data_ptr() for t in tensors}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.bytes = sum(_covered(spans) for spans in self._spans.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # A parameter (or a view of one, like the transposed weight a Linear saves) is a
        # model state. At ZeRO-3 its storage moves at every gather, hence the type test.
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        if t.is_sparse or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded:
            return t
        start = t.storage_offset() * t.element_size()
        extent = 0
        if t.numel():
            extent = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        self._spans.setdefault(ptr, []).append((start, min(start + extent, storage.nbytes())))
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _covered(spans: List[Tuple[int, int]]) -> int:
    """Bytes in the union of [start, end) intervals."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """What one forward pass keeps for backward.

    Attributes:
        bytes: the measure: the allocator's peak rise during the forward on CUDA (activations
            plus the forward's temporaries), the saved-tensor bytes on the CPU.
        saved_bytes: the saved-tensor bytes (measured on both devices).
        method: ``"cuda_peak"`` or ``"saved_tensors"``.
    """

    bytes: int
    saved_bytes: int
    method: str


def measure_activation_memory(forward: Callable[[], Any],
                              module: Optional[torch.nn.Module] = None
                              ) -> Tuple[Any, ActivationMemory]:
    """Runs ``forward()`` and measures the activation memory it leaves for backward.

    Args:
        forward: runs one forward pass (of one micro-batch) and returns its output.
        module: the model, whose parameters and buffers are not activations.

    Returns:
        ``(output of forward(), ActivationMemory)``; run backward on the output as usual.

    Example:
        >>> out, mem = measure_activation_memory(lambda: model(x), model)
        >>> out.sum().backward(); mem.bytes
    """
    cuda = accelerator.is_cuda()
    if cuda:
        accelerator.synchronize()
        base = accelerator.memory_stats()["allocated"]
        accelerator.reset_peak_memory()
    with SavedTensorMeter(module) as meter:
        output = forward()
    if cuda:
        accelerator.synchronize()
        rise = max(0, accelerator.memory_stats()["peak"] - base)
        return output, ActivationMemory(rise, meter.bytes, "cuda_peak")
    return output, ActivationMemory(meter.bytes, meter.bytes, "saved_tensors")


# ==============================================================================================
# Timers
# ==============================================================================================


class Timers:
    """Named wall-clock timers whose times add up until they are read.

    Each start and stop synchronises the device, so that kernels launched asynchronously
    count in the part of the step that launched them. That costs throughput: build timers
    only when timing is asked for (``wall_clock_breakdown``).

    Args:
        synchronize: waits for the device; default :func:`shardtrain.accelerator.synchronize`.

    Example:
        >>> timers = Timers()
        >>> with timers.time("forward"):
        ...     loss = model(x)
        >>> timers.read()          # {"forward": 12.5} in milliseconds, then reset
    """

    def __init__(self, synchronize: Callable[[], None] = accelerator.synchronize):
        self._sync = synchronize
        self._started: Dict[str, float] = {}
        self._total: Dict[str, float] = {}

    def start(self, name: str) -> None:
        """Starts ``name``; does nothing if it runs already."""
        if name not in self._started:
            self._sync()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        """Stops ``name`` and adds the time since its start; does nothing if it is not running."""
        began = self._started.pop(name, None)
        if began is not None:
            self._sync()
            self._total[name] = self._total.get(name, 0.0) + time.perf_counter() - began

    def running(self, name: str) -> bool:
        return name in self._started

    def add(self, name: str, seconds: float) -> None:
        """Adds a time measured elsewhere."""
        self._total[name] = self._total.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def read(self, reset: bool = True) -> Dict[str, float]:
        """Accumulated milliseconds per name (running timers are not included)."""
        out = {name: seconds * 1000.0 for name, seconds in self._total.items()}
        if reset:
            self._total.clear()
        return out


# ==============================================================================================
# FLOPs
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """One module's share of a profiled step.

    Attributes:
        name: the module's name in ``named_modules()`` (``""`` for the model itself).
        depth: 0 for the model, 1 for its children, ...
        params: parameters it holds, its submodules' included (full sizes at ZeRO-3).
        forward_flops: FLOPs of its forward passes, submodules included.
        backward_flops: FLOPs of its backward passes, submodules included.
        forward_latency_s: seconds inside its forward passes, submodules included.
    """

    name: str
    depth: int
    params: int
    forward_flops: int
    backward_flops: int
    forward_latency_s: float


@dataclasses.dataclass(frozen=True)
class FlopsProfile:
    """FLOPs, parameters and latency of the code a :class:`FlopsProfiler` watched.

    ``forward_flops`` count what ran inside :meth:`FlopsProfiler.forward` regions,
    ``backward_flops`` everything else (backward, and the loss if computed outside the
    model). Only operations with a FLOP formula in torch count (matrix products,
    convolutions, attention): element-wise work counts zero, as in most MFU reports.
    """

    forward_flops: int
    backward_flops: int
    params: int
    forward_latency_s: float
    modules: Tuple[ModuleCost, ...]

    @property
    def total_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def table(self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
        """The per-module report: the top modules by forward FLOPs at each depth, then (with
        ``detailed``) every module down to ``module_depth`` (-1: all), as a tree."""
        lines = []
        deepest = max((m.depth for m in self.modules), default=0)
        last = deepest if module_depth < 0 else min(deepest, module_depth)
        if top_modules > 0:
            lines.append(f"Top {top_modules} module(s) by forward FLOPs at each depth:")
            for depth in range(1, last + 1):
                ranked = sorted((m for m in self.modules if m.depth == depth),
                                key=lambda m: -m.forward_flops)[:top_modules]
                names = ", ".join(f"{m.name} ({_si(m.forward_flops)}FLOPs, {_si(m.params)} params)"
                                  for m in ranked)
                lines.append(f"  depth {depth}: {names}")
        if detailed:
            lines.append(f"{'module':<40}{'params':>10}{'fwd FLOPs':>12}{'bwd FLOPs':>12}"
                         f"{'fwd latency':>13}{'% fwd FLOPs':>13}")
            for m in self.modules:
                if module_depth >= 0 and m.depth > module_depth:
                    continue
                label = ("  " * m.depth + (m.name.rsplit(".", 1)[-1] if m.name else "(model)"))[:39]
                share = 100.0 * m.forward_flops / self.forward_flops if self.forward_flops else 0.0
                lines.append(f"{label:<40}{_si(m.params):>10}{_si(m.forward_flops):>12}"
                             f"{_si(m.backward_flops):>12}{m.forward_latency_s * 1e3:>10.2f} ms"
                             f"{share:>12.1f}%")
        return "\n".join(lines)


class FlopsProfiler:
    """Counts FLOPs per module with ``torch.utils.flop_counter.FlopCounterMode`` and times
    each module's forward.

    Enter it around the code to profile (forward and backward); mark forward passes with
    :meth:`forward` so that forward and backward FLOPs are told apart. Module latencies are
    measured with forward hooks that synchronise the device; they include the counter's own
    per-operation overhead, which is small next to large matrix products.

    Args:
        module: the model.

    Example:
        >>> profiler = FlopsProfiler(model)
        >>> with profiler:
        ...     with profiler.forward():
        ...         loss = model(x).sum()
        ...     loss.backward()
        >>> p = profiler.result(); p.forward_flops, p.backward_flops
    """

    def __init__(self, module: torch.nn.Module):
        from torch.utils.flop_counter import FlopCounterMode

        self.module = module
        self._counter = FlopCounterMode(display=False, depth=None)
        self._forward: Dict[str, int] = {}
        self._before: Optional[Dict[str, int]] = None
        self._latency: Dict[str, float] = {}
        self._began: Dict[int, float] = {}
        self._handles: List[Any] = []
        self._names = {id(m): name for name, m in module.named_modules()}
        self._active = False

    def start(self) -> None:
        """Starts counting (what :meth:`__enter__` does)."""
        if self._active:
            return
        self._active = True
        self._counter.__enter__()
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))

    def stop(self) -> None:
        """Stops counting (what :meth:`__exit__` does)."""
        if not self._active:
            return
        self._active = False
        if self._before is not None:
            self.forward_end()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._counter.__exit__(None, None, None)

    def __enter__(self) -> "FlopsProfiler":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def forward_begin(self) -> None:
        self._before = self._counts()

    def forward_end(self) -> None:
        if self._before is None:
            return
        for name, count in self._counts().items():
            self._forward[name] = self._forward.get(name, 0) + count - self._before.get(name, 0)
        self._before = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Marks a forward pass: FLOPs inside count as forward FLOPs."""
        self.forward_begin()
        try:
            yield
        finally:
            self.forward_end()

    def _counts(self) -> Dict[str, int]:
        """FLOPs so far per module name (``named_modules`` names; ``"Global"`` for the total)."""
        out: Dict[str, int] = {}
        for key, per_op in self._counter.get_flop_counts().items():
            # The counter names modules "<RootClass>.<path>"; "Global" is everything.
            name = key if key == "Global" else key.partition(".")[2]
            out[name] = out.get(name, 0) + sum(per_op.values())
        return out

    def _pre_forward(self, m: torch.nn.Module, args: Any) -> None:
        accelerator.synchronize()
        self._began[id(m)] = time.perf_counter()

    def _post_forward(self, m: torch.nn.Module, args: Any, output: Any) -> None:
        began = self._began.pop(id(m), None)
        if began is not None:
            accelerator.synchronize()
            name = self._names.get(id(m), "?")
            self._latency[name] = self._latency.get(name, 0.0) + time.perf_counter() - began

    def result(self) -> FlopsProfile:
        """The profile of what ran so far."""
        total = self._counts()
        fwd = dict(self._forward)
        bwd = {name: count - self._forward.get(name, 0) for name, count in total.items()}
        latency = dict(self._latency)
        # A container that is never called (an nn.ModuleList) shows what its children cost.
        # named_modules() lists parents first, so walking it backwards sums children first.
        for name, _ in reversed(list(self.module.named_modules())):
            if name and name not in self._latency:
                for table in (fwd, bwd, latency):
                    table[name] = sum(v for k, v in table.items() if k.rpartition(".")[0] == name)
        modules = []
        for name, m in self.module.named_modules():
            modules.append(ModuleCost(
                name=name, depth=0 if not name else name.count(".") + 1,
                params=sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters()),
                forward_flops=fwd.get(name, 0), backward_flops=bwd.get(name, 0),
                forward_latency_s=latency.get(name, 0.0)))
        fwd_total = self._forward.get("Global", 0)
        return FlopsProfile(forward_flops=fwd_total, backward_flops=total.get("Global", 0) - fwd_total,
                            params=modules[0].params if modules else 0,
                            forward_latency_s=self._latency.get("", 0.0), modules=tuple(modules))


#: Dense peak TFLOP/s per device: (16-bit tensor cores, TF32, plain fp32), by name fragment.
#: First match wins, so the more specific names come first.
_PEAK_TFLOPS: Tuple[Tuple[str, Tuple[float, float, float]], ...] = (
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("L4", (121.0, 60.0, 30.3)),
    ("V100", (125.0, 15.7, 15.7)),
    ("T4", (65.0, 8.1, 8.1)),
)


def peak_flops(dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Peak dense FLOP/s of one device of this process for matrix products in ``dtype``.

    ``SHARDTRAIN_PEAK_TFLOPS`` (TFLOP/s) wins when set; otherwise a table of common data-centre
    GPUs is used. None when unknown (always on the CPU unless given).

    Example:
        >>> peak_flops(torch.bfloat16)     # 9.894e14 on an H100 SXM
    """
    given = os.environ.get(PEAK_TFLOPS_ENV)
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={given!r}: expected TFLOP/s as a number, "
                             f"e.g. 989.4") from None
        if value <= 0:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={given!r}: expected a positive number")
        return value * 1e12
    name = accelerator.device_name()
    for fragment, (half, tf32, fp32) in _PEAK_TFLOPS:
        if fragment in name:
            if dtype in (torch.float16, torch.bfloat16):
                return half * 1e12
            return (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32) * 1e12
    return None


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} "


# ==============================================================================================
# Model states per stage, and the largest micro-batch that fits
# ==============================================================================================


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
    from .memory import zero_formula_bytes

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


def _candidates(largest: int, count: int, low: int, high: int) -> List[int]:
    """Micro-batches to try around the predicted largest: it, one step above (the estimate may
    be cautious) and halvings below, ``count`` in all, ascending."""
    if largest < low:
        return []
    above = min(high, largest + max(1, largest // 8))
    picks = [above] if above > largest else []
    value = largest
    while value >= low and len(picks) < count:
        if value not in picks:
            picks.append(value)
        value //= 2
    return sorted(picks[:count])


# ==============================================================================================
# The engine side of autotuning: a model-info profile, or a trial
# ==============================================================================================


def model_info_record(engine: Any, activation: ActivationMemory, micro_batch: int) -> Dict[str, Any]:
    """The model-info profile of a running engine (DeepSpeed's keys first, then shardtrain's).

    Called after an optimizer step, when gradients and optimizer states exist.
    """
    params = list(engine.module.parameters())
    numel = [getattr(p, "ds_numel", p.numel()) for p in params]
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


def _bytes_per_param(engine: Any, states: Dict[str, int]) -> Dict[str, float]:
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

    def after_step(self, engine: Any, peaks: List[int], activation: Optional[ActivationMemory],
                   flops_per_step: Optional[float]) -> None:
        """Called on every rank after each optimizer step, with every rank's peak memory."""
        from . import comm
        from .log import log_dist

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


def write_json(path: str, data: Dict[str, Any]) -> None:
    """Writes ``data`` atomically (a reader never sees half a file)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def memory_budget_from_env() -> Optional[int]:
    """The budget the autotuner gave this process (``SHARDTRAIN_MEMORY_BUDGET``), if any."""
    text = os.environ.get(MEMORY_BUDGET_ENV)
    if not text:
        return None
    return parse_size(text)


def parse_size(text: str) -> int:
    """Bytes from ``"20GiB"``, ``"512MB"``, ``"1.5e9"`` or ``"4096"`` (KiB/MiB/GiB/TiB are
    powers of 1024; KB/MB/GB/TB powers of 1000).

    Example:
        >>> parse_size("2GiB")
        2147483648
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*", text)
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 20GiB, 512MiB, 8GB or a number of bytes")
    value = float(match.group(1)) * units[(match.group(2) or "B").upper()]
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value)


# ==============================================================================================
# shardtrain autotune
# ==============================================================================================


@dataclasses.dataclass
class Trial:
    """One trial run of the autotuner.

    Attributes:
        name: its directory name under ``exps_dir``.
        stage, micro_batch: what it tried.
        status: ``ok``, ``oom`` (out of memory, or over the budget), ``timeout`` or ``error``.
        samples_per_s, latency_ms, flops_per_s: measured (None unless ``ok``).
        peak_memory: the largest per-rank peak in bytes (None if unknown).
        detail: the end of the output, for a failed trial.
    """

    name: str
    stage: int
    micro_batch: int
    status: str = "not run"
    samples_per_s: Optional[float] = None
    latency_ms: Optional[float] = None
    flops_per_s: Optional[float] = None
    peak_memory: Optional[int] = None
    detail: str = ""

    def value(self, metric: str) -> Optional[float]:
        """The metric, oriented so that larger is better."""
        if self.status != "ok":
            return None
        if metric == "latency":
            return -self.latency_ms if self.latency_ms else None
        if metric == "flops":
            return self.flops_per_s
        return self.samples_per_s


@dataclasses.dataclass
class AutotuneResult:
    """What :func:`autotune` found.

    Attributes:
        best: the chosen trial (None when no trial fitted).
        best_config_path: the JSON config of the best trial.
        trials: every trial, in the order they ran.
        fits: the predicted largest micro-batch per stage.
        model_info: the profile.
        budget: bytes per rank.
        table_path: the table of trials (CSV) under ``results_dir``.
    """

    best: Optional[Trial]
    best_config_path: Optional[str]
    trials: List[Trial]
    fits: List[StageFit]
    model_info: Dict[str, Any]
    budget: int
    table_path: str


class AutotuneError(RuntimeError):
    """The autotuner cannot go on: a bad argument, or a profile run that failed."""


#: Tolerance within which two trials count as equally fast (DeepSpeed's autotuner uses 5%);
#: then the larger micro-batch wins, then the lower stage.
_TIE = 0.05
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def autotune(script: str, config: str, script_args: Sequence[str] = (), budget: Optional[int] = None,
             stages: Optional[Sequence[int]] = None, metric: Optional[str] = None, nproc: int = 1,
             results_dir: Optional[str] = None, exps_dir: Optional[str] = None, timeout: float = 600.0,
             config_arg: str = "--config", log: Callable[[str], None] = print) -> AutotuneResult:
    """Finds the fastest micro-batch and ZeRO stage for ``script`` within a memory budget.

    1. A profile run of the script (``autotuning.model_info.profile``) measures the parameters,
       the model-state bytes per parameter and the activation memory per sample.
    2. Per stage, the largest micro-batch whose model states (ZeRO formula) plus activations
       fit ``budget`` is computed.
    3. Short trials (``autotuning.enabled``) run around it; each writes samples/s and peak
       memory. A trial that runs out of memory (on the CPU: whose measured model states plus
       activations exceed the budget) stops, and the stage's larger micro-batches are skipped.
    4. The fastest trial that fits becomes ``results_dir/best_config.json``; every trial is
       listed in ``results_dir/trials.csv``.

    The script must take its config path from the ``config_arg`` option (``--config`` by
    default; ``--deepspeed_config`` for DeepSpeed scripts) and call ``engine.step()``.

    Args:
        script: the training script.
        config: its JSON config; the ``autotuning`` block sets defaults for what follows.
        script_args: more arguments for the script.
        budget: bytes per rank; default the device's memory (CUDA), or the host's available
            memory shared by ``nproc`` processes (CPU).
        stages: ZeRO stages to try; default 0, 1, 2, 3.
        metric: ``throughput``, ``latency`` or ``flops``; default ``autotuning.metric``.
        nproc: processes per trial (through torchrun when above 1).
        results_dir, exps_dir: default ``autotuning.results_dir`` / ``exps_dir``.
        timeout: seconds per run before it is stopped.
        config_arg: the script's option that takes the config path.
        log: where progress lines go.

    Returns:
        An :class:`AutotuneResult`.

    Example:
        >>> result = autotune("train.py", "train.json", budget=parse_size("16GiB"), stages=[0, 2])
        >>> result.best.micro_batch, result.best_config_path
    """
    from .config import ConfigError, load_config

    try:
        cfg = load_config(config, world_size=nproc)
    except ConfigError as err:
        raise AutotuneError(f"--config {config}: {err}") from None
    tuning = cfg.autotuning
    metric = metric or tuning.metric
    stages = list(stages) if stages is not None else [0, 1, 2, 3]
    results = Path(results_dir or tuning.results_dir)
    exps = Path(exps_dir or tuning.exps_dir)
    results.mkdir(parents=True, exist_ok=True)
    budget = budget or _default_budget(nproc)
    runner = _Runner(script, list(script_args), config_arg, nproc, timeout, exps, tuning.arg_mappings)

    info = _profile(runner, cfg, results, log)
    fits = stage_fits(info, budget, nproc, stages, tuning.min_train_micro_batch_size_per_gpu,
                      _max_micro_batch(tuning, cfg.gradient_accumulation_steps, nproc))
    for fit in fits:
        log(f"stage {fit.stage}: model states {_bytes(fit.model_state_bytes)} per rank; largest "
            f"micro-batch within {_bytes(budget)}: {fit.max_micro_batch or 'none'}")
    trials = _run_trials(runner, cfg, fits, budget, metric, log)
    best = _choose(trials, metric)
    table = results / "trials.csv"
    _write_table(trials, table)
    best_path = None
    if best is not None:
        best_path = str(results / "best_config.json")
        write_json(best_path, _tuned_config(cfg.raw, best.stage, best.micro_batch,
                                            cfg.gradient_accumulation_steps, nproc))
    return AutotuneResult(best, best_path, trials, fits, info, budget, str(table))


def _max_micro_batch(tuning: Any, gas: int, nproc: int) -> int:
    largest = tuning.max_train_micro_batch_size_per_gpu
    if tuning.max_train_batch_size:
        largest = min(largest, tuning.max_train_batch_size // (gas * nproc))
    return largest


def _default_budget(nproc: int) -> int:
    device = accelerator.total_memory()
    if device:
        return device
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // max(1, nproc)
    except OSError:
        pass
    raise AutotuneError("cannot tell how much memory this machine has; give --memory-budget")


class _Runner:
    """Starts the user's script with a generated config, under a time limit."""

    def __init__(self, script: str, args: List[str], config_arg: str, nproc: int, timeout: float,
                 exps: Path, arg_mappings: Optional[Dict[str, str]]):
        self.script, self.args, self.config_arg = script, args, config_arg
        self.nproc, self.timeout, self.exps = nproc, timeout, exps
        self.arg_mappings = arg_mappings or {}

    def run(self, name: str, config: Dict[str, Any], env: Dict[str, str]) -> Tuple[int, str, Path]:
        """Runs one experiment; returns (exit status, the end of its output, its directory).
        Status 124 means it ran past the time limit and was stopped."""
        folder = self.exps / name
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "config.json"
        write_json(str(config_path), config)
        argv = self._argv(str(config_path.resolve()), config)
        log_path = folder / "output.log"
        with open(log_path, "w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            # A session of its own, so that a stuck run and all its workers stop together.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            try:
                status = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = 124
        return status, _tail(log_path), folder

    def _argv(self, config_path: str, config: Dict[str, Any]) -> List[str]:
        args = list(self.args)
        if self.config_arg in args:  # the script's own config option: point it at the trial's
            index = args.index(self.config_arg)
            args[index + 1: index + 2] = [config_path]
        else:
            args += [self.config_arg, config_path]
        for key, flag in self.arg_mappings.items():
            value = config.get(key)
            if value is not None:
                args += [flag, str(value)]
        if self.nproc == 1:
            return [sys.executable, self.script, *args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.nproc), "--", self.script, *args]


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def _base_config(raw: Dict[str, Any], stage: int, micro_batch: int, gas: int) -> Dict[str, Any]:
    """The user's config with the micro-batch and stage set, monitors and profilers off."""
    config = copy.deepcopy(raw)
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = gas
    zero = config.get("zero_optimization")
    config["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
    for key in ("tensorboard", "csv_monitor", "jsonl_monitor", "flops_profiler"):
        if isinstance(config.get(key), dict):
            config[key] = {**config[key], "enabled": False}
    return config


def _tuned_config(raw: Dict[str, Any], stage: int, micro_batch: int, gas: int, nproc: int) -> Dict[str, Any]:
    """The best configuration: the user's config with the chosen micro-batch and stage."""
    config = copy.deepcopy(raw)
    config.pop("autotuning", None)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = gas
    config["train_batch_size"] = micro_batch * gas * nproc
    zero = config.get("zero_optimization")
    config["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
    return config


def _profile(runner: _Runner, cfg: Any, results: Path, log: Callable[[str], None]) -> Dict[str, Any]:
    path = (results / "profile_model_info" / "model_info.json").resolve()
    if path.exists():
        path.unlink()
    config = _base_config(cfg.raw, cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu,
                          cfg.gradient_accumulation_steps)
    config["autotuning"] = {"enabled": False, "model_info_path": str(path), "model_info": {"profile": True}}
    log(f"profile run: micro-batch {cfg.train_micro_batch_size_per_gpu}, stage "
        f"{cfg.zero_optimization.stage}, {runner.nproc} process(es)")
    status, tail, _ = runner.run("profile_model_info", config, {})
    if not path.exists():
        oom = any(marker in tail for marker in _OOM_MARKERS)
        hint = (" It ran out of memory: lower train_micro_batch_size_per_gpu in the config." if oom
                else "")
        raise AutotuneError(f"the profile run wrote no {path} (exit status {status}).{hint} Its output "
                            f"ends with:\n{tail}")
    info = json.loads(path.read_text())
    log(f"profile: {info['num_params']:,} parameters, {_bytes(info['activation_mem_per_sample'])} of "
        f"activations per sample ({info['activation_method']}), bytes per parameter "
        f"{info['bytes_per_param']}")
    return info


def _run_trials(runner: _Runner, cfg: Any, fits: List[StageFit], budget: int, metric: str,
                log: Callable[[str], None]) -> List[Trial]:
    tuning = cfg.autotuning
    trials: List[Trial] = []
    best: Optional[float] = None
    stale = 0
    for fit in fits:
        sizes = _candidates(fit.max_micro_batch, tuning.num_tuning_micro_batch_sizes,
                            tuning.min_train_micro_batch_size_per_gpu,
                            _max_micro_batch(tuning, cfg.gradient_accumulation_steps, runner.nproc))
        for micro_batch in sizes:
            if len(trials) >= tuning.tuner_num_trials or stale >= tuning.tuner_early_stopping:
                return trials
            trial = _trial(runner, cfg, fit.stage, micro_batch, budget, metric)
            trials.append(trial)
            log(f"trial {trial.name}: {trial.status}" + (
                f", {trial.samples_per_s:.1f} samples/s, peak {_bytes(trial.peak_memory)}"
                if trial.status == "ok" else ""))
            value = trial.value(metric)
            if value is not None and (best is None or value > best + abs(best) * _TIE):
                best, stale = value, 0
            else:
                stale += 1
            if trial.status == "oom":
                break  # larger micro-batches at this stage need more memory still
    return trials


def _trial(runner: _Runner, cfg: Any, stage: int, micro_batch: int, budget: int, metric: str) -> Trial:
    tuning = cfg.autotuning
    trial = Trial(f"z{stage}_mbs{micro_batch}", stage, micro_batch)
    metrics = (runner.exps / trial.name / "metrics.json").resolve()
    if not tuning.overwrite and metrics.exists():
        return _read_trial(trial, metrics, budget, 0, "")
    if metrics.exists():
        metrics.unlink()
    config = _base_config(cfg.raw, stage, micro_batch, cfg.gradient_accumulation_steps)
    config["autotuning"] = {"enabled": True, "start_profile_step": tuning.start_profile_step,
                            "end_profile_step": tuning.end_profile_step, "metric_path": str(metrics),
                            "metric": metric}
    status, tail, _ = runner.run(trial.name, config, {MEMORY_BUDGET_ENV: str(budget)})
    return _read_trial(trial, metrics, budget, status, tail)


def _read_trial(trial: Trial, metrics: Path, budget: int, status: int, tail: str) -> Trial:
    if metrics.exists():
        data = json.loads(metrics.read_text())
        trial.samples_per_s, trial.latency_ms = data["throughput"], data["latency"]
        trial.flops_per_s, trial.peak_memory = data.get("FLOPS_per_gpu"), data.get("peak_memory")
        over = trial.peak_memory is not None and trial.peak_memory > budget
        trial.status = "oom" if over else "ok"
        trial.detail = f"peak {trial.peak_memory} > budget {budget}" if over else ""
    elif status == 124:
        trial.status, trial.detail = "timeout", tail
    elif any(marker in tail for marker in _OOM_MARKERS):
        trial.status, trial.detail = "oom", tail
    else:
        trial.status, trial.detail = "error", tail
    return trial


def _choose(trials: List[Trial], metric: str) -> Optional[Trial]:
    """The best trial; within 5% of the best value the larger micro-batch, then the lower
    stage, wins (a bigger batch is as fast within noise and needs fewer steps)."""
    scored = [(t.value(metric), t) for t in trials if t.value(metric) is not None]
    if not scored:
        return None
    top = max(value for value, _ in scored)
    margin = abs(top) * _TIE
    close = [t for value, t in scored if value >= top - margin]
    return max(close, key=lambda t: (t.micro_batch, -t.stage))


_TABLE_FIELDS = ("name", "stage", "micro_batch", "status", "samples_per_s", "latency_ms",
                 "flops_per_s", "peak_memory")


def _write_table(trials: List[Trial], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_TABLE_FIELDS)
        for t in trials:
            writer.writerow([getattr(t, name) if getattr(t, name) is not None else ""
                             for name in _TABLE_FIELDS])


def format_trials(result: AutotuneResult) -> str:
    """The table of trials, as ``shardtrain autotune`` prints it."""
    lines = [f"{'stage':>5} {'micro-batch':>11} {'status':>8} {'samples/s':>10} {'latency':>10} "
             f"{'peak memory':>12}"]
    for t in result.trials:
        mark = " <- best" if t is result.best else ""
        lines.append(f"{t.stage:>5} {t.micro_batch:>11} {t.status:>8} "
                     f"{_num(t.samples_per_s, '.1f'):>10} {_num(t.latency_ms, '.1f', ' ms'):>10} "
                     f"{(_bytes(t.peak_memory) if t.peak_memory is not None else '-'):>12}{mark}")
    return "\n".join(lines)


def _num(value: Optional[float], fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_AUTOTUNE_EXAMPLES = """\
examples:
  shardtrain autotune train.py --config train.json
  shardtrain autotune train.py --config train.json --memory-budget 20GiB --stages 0,2,3 --nproc 8
  shardtrain autotune train.py --config ds.json --config-arg --deepspeed_config -- --epochs 1

The script runs with --config <generated.json> (--config-arg names another option) and must
call engine.step(). A profile run measures activations and bytes per parameter; then, per stage,
short trials run around the largest micro-batch that fits the budget. Results go to
autotuning.results_dir (best_config.json, trials.csv); trial configs and logs to exps_dir.
"""


def build_autotune_parser(prog: str = "shardtrain autotune") -> argparse.ArgumentParser:
    """The argument parser of ``shardtrain autotune``."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        usage="%(prog)s SCRIPT --config CONFIG [options] [-- SCRIPT_ARGS...]",
        description="Finds the largest micro-batch that fits a memory budget for each ZeRO stage, "
                    "times short trials around it and writes the fastest configuration.",
        epilog=_AUTOTUNE_EXAMPLES)
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("--config", required=True, metavar="CONFIG", help="the script's JSON config")
    parser.add_argument("--memory-budget", type=_size_arg, metavar="SIZE",
                        help="memory per rank, e.g. 20GiB (default: the device's memory; on the CPU, "
                             "the available host memory shared by --nproc processes)")
    parser.add_argument("--stages", type=_stages_arg, default=[0, 1, 2, 3], metavar="LIST",
                        help="ZeRO stages to try, e.g. 0,2,3 (default: 0,1,2,3)")
    parser.add_argument("--metric", choices=("throughput", "latency", "flops"),
                        help="what to optimise (default: autotuning.metric, else throughput)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes per trial, started through torchrun when above 1 (default: 1)")
    parser.add_argument("--results-dir", metavar="DIR", help="default: autotuning.results_dir")
    parser.add_argument("--exps-dir", metavar="DIR", help="default: autotuning.exps_dir")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="time limit per run (default: 600)")
    parser.add_argument("--config-arg", default="--config", metavar="OPTION",
                        help="the script's option for the config path (default: --config)")
    return parser


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _stages_arg(text: str) -> List[int]:
    try:
        stages = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        stages = []
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"expected ZeRO stages 0-3 separated by commas, got {text!r}")
    return sorted(set(stages))


def autotune_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardtrain autotune``: returns the exit status (0 when a configuration was found).

    Arguments after ``--`` go to the script.

    Example:
        >>> autotune_main(["train.py", "--config", "train.json", "--memory-budget", "8GiB"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    own, script_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = build_autotune_parser()
    args = parser.parse_args(own)
    if not Path(args.script).is_file():
        parser.error(f"script not found: {args.script!r}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    try:
        result = autotune(args.script, args.config, script_args, args.memory_budget, args.stages,
                          args.metric, args.nproc, args.results_dir, args.exps_dir, args.timeout,
                          args.config_arg, log=lambda line: print(line, flush=True))
    except AutotuneError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    print(format_trials(result))
    print(f"trials: {result.table_path}")
    if result.best is None:
        print(f"{parser.prog}: no trial fitted {_bytes(result.budget)}; raise --memory-budget or try "
              f"more stages", file=sys.stderr)
        return 1
    print(f"best: stage {result.best.stage}, micro-batch {result.best.micro_batch} -> "
          f"{result.best_config_path}")
    return 0


def add_autotune_parser(commands: Any) -> None:
    """Registers ``shardtrain autotune`` on the ``shardtrain`` command's subcommands.

    Every argument is handed to :func:`autotune_main` as it is (``--help`` included), because
    the options follow SCRIPT and the script's own arguments follow ``--``.
    """
    sub = commands.add_parser("autotune", help="largest micro-batch that fits, fastest ZeRO stage",
                              add_help=False, prefix_chars="\0")  # no option is parsed here
    sub.add_argument("argv", nargs=argparse.REMAINDER)
    sub.set_defaults(handler=lambda args: autotune_main(args.argv), subparser=sub)
