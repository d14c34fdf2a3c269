"""The engine's per-step watch: what is measured and reported at every step, in one object.

The engine tells the watch where a step is (forward, backward, the optimizer step, after it)
and never asks what is configured. :func:`build_watch` builds the watch from the config with
only the parts that are on: the monitors (:mod:`.monitors`), the timers of
``wall_clock_breakdown`` (:mod:`.timers`), the FLOPs profile of one step (:mod:`.flops`),
memory per rank, and the autotuner's in-job probe (:class:`shardtrain.autotune.TuningProbe`).

With none of them on, the watch only counts tokens and keeps the last losses for
:class:`~.progress.Progress`: no device synchronisation and no collective. With a monitor
on, every rank joins one small all-gather per step (loss, tokens, memory) and rank 0 writes.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import accelerator, comm
from ..memory import format_bytes
from ..autotune.budget import memory_budget_from_env
from ..autotune.probe import TuningProbe
from ..log import log_dist, log_dist_once
from ._flops_window import FlopsWindow
from ._memory_probe import MemoryProbe
from ._oom import OomReporter
from . import comms
from .flops import peak_flops
from .monitors import build_monitors, monitoring
from .timers import Timers
from ..state import EngineFace

__all__ = ["StepWatch", "build_watch"]


class StepWatch:
    """Everything the engine reports per step: built from the config by :func:`build_watch`.

    The engine calls :meth:`forward`, :meth:`backward_begin` / :meth:`backward_end`,
    :meth:`step_begin`, :meth:`lap` and :meth:`after_step`. With no monitor, timer or profiler
    configured these only count samples and keep the last loss (for :class:`Progress`): no
    device synchronisation and no collective.
    """

    def __init__(self, engine: EngineFace):
        cfg = engine.config
        self.engine = engine
        self.rank0 = engine.global_rank == 0
        # Every rank takes part in the per-step gather, rank 0 alone writes.
        self.monitoring = monitoring(cfg)
        self.monitors = build_monitors(cfg) if self.monitoring and self.rank0 else []
        timing = cfg.wall_clock_breakdown or cfg.flops_profiler.enabled  # as in DeepSpeed
        self.timers = Timers() if timing else None
        self.tuning = TuningProbe(cfg.autotuning, engine.global_rank)
        if not self.tuning.active:
            self.tuning = None
        # A memory budget caps the CUDA allocator; on the CPU the probe holds its measures to it.
        budget = memory_budget_from_env()
        if budget is not None:
            accelerator.limit_memory(budget)
        wants_memory = (self.monitoring or cfg.memory_breakdown or self.tuning is not None
                        or (budget is not None and not accelerator.is_cuda()))
        self.memory = MemoryProbe(engine, self.tuning is not None and self.tuning.profile, budget) \
            if wants_memory else None
        self.oom = OomReporter(engine)
        logged = cfg.comms_logger
        if logged.enabled:  # process-wide, as DeepSpeed's: read by deepspeed.comm.log_summary()
            comms.configure(True, logged.prof_all, logged.prof_ops, logged.verbose, logged.debug)
        self.micro_batch: Optional[int] = None  # the last forward's, for out-of-memory reports
        self.step_counters: Optional[Tuple[int, int]] = None  # (steps, micro-steps) at step_begin
        self.flops = self._build_flops(engine)
        self.flops_per_step: Optional[float] = None
        self.peak = peak_flops(_compute_dtype(cfg))
        self._losses: List[torch.Tensor] = []
        self._tokens = 0
        self._last = time.perf_counter()
        self._lap_mark = 0.0
        self._window: Dict[str, float] = {}
        self._window_steps = 0
        self.last: Dict[str, Any] = {}
        if cfg.wall_clock_breakdown and not cfg.steps_per_print:
            log_dist_once("wall_clock_breakdown is on but steps_per_print is not set: the timers go to "
                          "the monitors only; set steps_per_print to log them.", level=20)

    def _build_flops(self, engine: EngineFace) -> Optional[FlopsWindow]:
        cfg = engine.config
        step = None
        if cfg.flops_profiler.enabled and self.rank0:
            step = cfg.flops_profiler.profile_step
        elif self.tuning is not None and self.tuning.flops_step is not None and self.tuning.flops_step >= 0:
            step = self.tuning.flops_step
        return FlopsWindow(engine.module, step) if step is not None else None

    # -- forward and backward ---------------------------------------------------------------

    def forward(self, inputs: Sequence[Any], kwargs: Dict[str, Any]):
        """A context manager around the engine's forward."""
        if not torch.is_grad_enabled():
            return contextlib.nullcontext()  # evaluation: not a training micro-batch
        self._tokens += _tokens_of(inputs, kwargs)
        self.micro_batch = _batch_of(inputs, kwargs)
        if self.timers is None and self.memory is None and self.flops is None:
            return contextlib.nullcontext()
        return self._measured_forward()

    @contextlib.contextmanager
    def _measured_forward(self) -> Iterator[None]:
        if self.timers is not None:
            self.timers.start("forward")
        if self.flops is not None:
            self.flops.forward_begin(self.engine.global_steps)
        try:
            with self.memory.forward() if self.memory is not None else contextlib.nullcontext():
                yield
        finally:
            if self.flops is not None:
                self.flops.forward_end()
            if self.timers is not None:
                self.timers.stop("forward")

    def backward_begin(self, loss: Optional[torch.Tensor] = None) -> None:
        """Backward starts; ``loss`` is the loss ``engine.backward`` was given (if any)."""
        if loss is not None:
            self._losses.append(loss.detach())
        if self.timers is not None:
            self.timers.start("backward")

    def backward_end(self) -> None:
        if self.timers is not None:
            self.timers.stop("backward")

    # -- the optimizer step -----------------------------------------------------------------

    def out_of_memory(self, error: BaseException, phase: str) -> Optional[BaseException]:
        """The error to raise instead of ``error`` when it is an out-of-memory error that
        escaped ``phase`` (forward, backward, step): a report of where and at which
        micro-batch it happened, what this rank held and what to do; else None."""
        last = self.memory.last_forward if self.memory is not None else None
        counters = self.step_counters if phase == "step" else None
        return self.oom.report(error, phase, self.micro_batch, last.saved_bytes if last else None,
                               counters)

    def step_begin(self) -> None:
        """The optimizer step starts (a plain ``loss.backward()`` may not have told its end)."""
        # The counters advance before after_step(): a report from there names this step.
        self.step_counters = (self.engine.global_steps, self.engine.micro_steps)
        if self.timers is not None:
            self.timers.stop("backward")
            accelerator.synchronize()
            self._lap_mark = time.perf_counter()

    def lap(self, name: str) -> None:
        """Charges the time since the last mark to ``name`` (``reduce``, ``optimizer``)."""
        if self.timers is not None:
            accelerator.synchronize()
            now = time.perf_counter()
            self.timers.add(name, now - self._lap_mark)
            self._lap_mark = now

    def after_step(self) -> None:
        """After each optimizer step (counters advanced): records, logs, profiles."""
        engine = self.engine
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        times = self.timers.read() if self.timers is not None else {}
        profile = self.flops.finish() if self.flops is not None else None
        if profile is not None:
            self.flops_per_step = (profile.forward_flops * (1.0 + engine.config.flops_profiler.recompute_fwd_factor)
                                   + profile.backward_flops)
            if engine.config.flops_profiler.enabled:
                self._report_flops(profile, seconds, times)
        memory = self.memory.read() if self.memory is not None else None
        ranks = self._gather(memory) if (self.monitoring or self.tuning is not None) else None
        self.last = {"seconds": seconds, "losses": self._losses, "tokens": self._tokens,
                     "ranks": ranks}
        if self.monitoring and self.rank0:
            self._write(self._record(seconds, times, ranks))
        self._log_timers(times, memory)
        self._losses, self._tokens = [], 0
        if self.tuning is not None:
            activation = self.memory.last_forward if self.memory is not None else None
            self.tuning.after_step(engine, [int(r[4]) for r in ranks], activation, self.flops_per_step)

    def _gather(self, memory: Optional[Tuple[int, int]]) -> List[List[float]]:
        """Per rank: [loss sum, losses, tokens, allocated, peak] (one small all-gather)."""
        device = self.engine.device
        loss = torch.stack(self._losses).float().sum() if self._losses else torch.zeros((), device=device)
        row = torch.stack([loss.to(device=device, dtype=torch.float64),
                           *(torch.tensor(float(v), dtype=torch.float64, device=device)
                             for v in (len(self._losses), self._tokens, *(memory or (0, 0))))])
        world = self.engine.world_size
        if world == 1:
            return [row.tolist()]
        out = torch.empty(world * row.numel(), dtype=row.dtype, device=device)
        comm.all_gather(out, row)
        return out.view(world, -1).tolist()

    def _record(self, seconds: float, times: Dict[str, float], ranks: List[List[float]]) -> Dict[str, Any]:
        engine, cfg = self.engine, self.engine.config
        counted = sum(r[1] for r in ranks)
        tokens = sum(r[2] for r in ranks) / self.engine.mesh.tp.size()  # a tp group shares its tokens
        lrs = engine.get_lr()
        record: Dict[str, Any] = {
            "step": engine.global_steps, "samples": engine.global_samples, "time": time.time(),
            "loss": sum(r[0] for r in ranks) / counted if counted else None,
            "lr": lrs[0] if lrs else None, "grad_norm": engine.get_global_grad_norm(),
            "skipped": not engine.was_step_applied(),
            "samples_per_s": engine.train_batch_size() / seconds if seconds > 0 else None,
            "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
            "memory_allocated": [int(r[3]) for r in ranks], "memory_peak": [int(r[4]) for r in ranks],
        }
        if cfg.fp16.enabled:
            record["loss_scale"] = engine.get_loss_scale()
        if times:
            record["time_ms"] = times
        if self.flops_per_step and seconds > 0:
            achieved = self.flops_per_step / seconds
            record["tflops"] = achieved / 1e12
            record["mfu"] = achieved / self.peak if self.peak else None
        return record

    def _write(self, record: Dict[str, Any]) -> None:
        for monitor in self.monitors:
            monitor.write(record)

    def _log_timers(self, times: Dict[str, float], memory: Optional[Tuple[int, int]]) -> None:
        cfg = self.engine.config
        if not (cfg.wall_clock_breakdown or cfg.memory_breakdown) or not cfg.steps_per_print:
            return
        for name, ms in times.items():
            self._window[name] = self._window.get(name, 0.0) + ms
        self._window_steps += 1
        if self.engine.global_steps % cfg.steps_per_print:
            return
        parts = []
        if cfg.wall_clock_breakdown:
            n = self._window_steps
            parts.append("time (ms, mean per step) | " + " | ".join(
                f"{name}: {self._window.get(name, 0.0) / n:.2f}"
                for name in ("forward", "backward", "reduce", "optimizer")))
        if cfg.memory_breakdown and memory is not None:
            parts.append(f"memory | allocated: {format_bytes(memory[0])} | peak: {format_bytes(memory[1])}")
        log_dist(f"step={self.engine.global_steps} " + " ; ".join(parts), ranks=[0])
        self._window, self._window_steps = {}, 0

    def _report_flops(self, profile: Any, seconds: float, times: Dict[str, float]) -> None:
        cfg = self.engine.config.flops_profiler
        achieved = self.flops_per_step / seconds if seconds > 0 else 0.0
        mfu = (f"MFU {100 * achieved / self.peak:.1f}% of {self.peak / 1e12:.1f} TFLOP/s" if self.peak
               else "MFU unknown (set SHARDTRAIN_PEAK_TFLOPS to the device's peak TFLOP/s)")
        parts = ", ".join(f"{k} {v:.1f} ms" for k, v in times.items())
        text = "\n".join([
            f"FLOPs profile of step {cfg.profile_step + 1} (rank 0; the step ran under the counter, "
            f"so its times are inflated):",
            f"  parameters          {profile.params:,}",
            f"  forward FLOPs       {profile.forward_flops:,}",
            f"  backward FLOPs      {profile.backward_flops:,}",
            f"  FLOPs per step      {self.flops_per_step:,.0f} (forward x {1 + cfg.recompute_fwd_factor:g} + backward)",
            f"  step time           {seconds * 1e3:.1f} ms ({parts or 'wall_clock_breakdown off'})",
            f"  achieved            {achieved / 1e12:.4f} TFLOP/s per rank; {mfu}",
            profile.table(cfg.module_depth, cfg.top_modules, cfg.detailed)])
        if cfg.output_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.output_file)), exist_ok=True)
            Path(cfg.output_file).write_text(text + "\n")
            log_dist(f"FLOPs profile written to {cfg.output_file}", ranks=[0])
        else:
            log_dist(text, ranks=[0])

    # -- user values and summaries -----------------------------------------------------------

    def log_metrics(self, step: Optional[int], values: Dict[str, Any]) -> None:
        """Writes ``values`` to the monitors as a record of its own (rank 0)."""
        if not self.monitors:
            return
        record: Dict[str, Any] = {"step": self.engine.global_steps if step is None else int(step),
                                  "samples": self.engine.global_samples, "time": time.time()}
        for key, value in values.items():
            record[key] = _number(value)
        self._write(record)

    @property
    def enabled(self) -> bool:
        """A monitor is configured (the same answer on every rank; rank 0 writes)."""
        return self.monitoring

    def write_events(self, event_list: Sequence[Tuple[str, Any, int]]) -> None:
        """DeepSpeed's ``engine.monitor.write_events``: each ``(name, value, x)`` is written
        as a record of its own at global samples ``x`` (rank 0; a name without ``/``
        becomes ``Train/Samples/<name>``).

        Example:
            >>> engine.monitor.write_events([("Eval/Samples/loss", 1.83, engine.global_samples)])
        """
        for name, value, x in event_list:
            if self.monitors:
                self._write({"step": self.engine.global_steps, "samples": int(x),
                             "time": time.time(), name: _number(value)})

    def summary(self) -> Dict[str, float]:
        """Loss (this rank's last step), learning rate and throughput, for a progress bar."""
        out: Dict[str, float] = {}
        last = self.last
        if last.get("ranks"):
            counted = sum(r[1] for r in last["ranks"])
            if counted:
                out["loss"] = sum(r[0] for r in last["ranks"]) / counted
        elif last.get("losses"):
            out["loss"] = torch.stack(last["losses"]).float().mean().item()
        lrs = self.engine.get_lr()
        if lrs:
            out["lr"] = lrs[0]
        seconds = last.get("seconds")
        if seconds:
            # every rank of a tensor-parallel group reads the same tokens; sequence-parallel
            # ranks each read their slice
            sizes = self.engine.mesh.sizes
            tokens = last["tokens"] * sizes["dp"] * sizes["sp"]
            if last.get("ranks"):
                tokens = sum(r[2] for r in last["ranks"]) / sizes["tp"]
            if tokens:
                out["tok_s"] = tokens / seconds
            else:
                out["samples_s"] = self.engine.train_batch_size() / seconds
        return out

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


def build_watch(engine: EngineFace) -> StepWatch:
    """The engine's :class:`StepWatch`, from its config (monitors, timers, profilers)."""
    return StepWatch(engine)


def _number(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _tokens_of(inputs: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """Tokens in a micro-batch: the elements of the first input when it holds integer ids
    (batch x sequence); 0 when the first input is not a token tensor."""
    for x in (*inputs, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.numel() if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex() else 0
    return 0


def _batch_of(inputs: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[int]:
    """The micro-batch size: the leading dimension of the first tensor input."""
    for x in (*inputs, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return int(x.shape[0]) if x.dim() else None
    return None


def _compute_dtype(cfg: Any) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.torch_autocast.enabled:
        return cfg.torch_autocast.dtype or (torch.float16 if accelerator.is_cuda() else torch.bfloat16)
    return torch.float32
