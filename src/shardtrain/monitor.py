"""What a person watches while training runs: a progress bar, metrics files and plots.

* :class:`Progress`: a tqdm bar with loss, throughput and ETA, drawn by rank 0 on a terminal;
* the monitors of the config (``tensorboard``, ``csv_monitor`` and shardtrain's
  ``jsonl_monitor``, each ``{"enabled", "output_path", "job_name"}``): rank 0 writes loss,
  learning rate, loss scale, grad norm, samples/s, tokens/s, memory per rank and, with
  ``wall_clock_breakdown``, the step's timers, once per optimizer step;
* :func:`plot_run` / :func:`plot_main` (``shardtrain plot RUN_DIR``): PNG plots of those files.

The engine reports to a :class:`StepWatch` (built by :func:`build_watch`), which also runs the
timers, the FLOPs profiler and the autotuning probes of :mod:`shardtrain.profiling`.

Example:
    >>> with shardtrain.monitor.Progress(total=300, engine=engine) as bar:
    ...     for step in range(300):
    ...         ...                    # forward, engine.backward(loss), engine.step()
    ...         bar.update()           # loss and throughput come from the engine
    $ shardtrain plot runs/demo        # loss.png, lr.png, throughput.png, memory.png
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import accelerator, comm
from .log import log_dist, log_dist_once
from .profiling import (ActivationMemory, FlopsProfiler, SavedTensorMeter, Timers, TuningProbe,
                        _bytes, peak_flops)

__all__ = ["Progress", "StepWatch", "build_watch", "JSONLinesMonitor", "CSVMonitor",
           "TensorBoardMonitor", "read_metrics", "plot_run", "plot_main", "add_plot_parser"]


# ==============================================================================================
# Progress bar
# ==============================================================================================


class Progress:
    """A tqdm bar with loss, throughput and ETA, drawn by rank 0 only.

    Other ranks, and rank 0 when stderr is not a terminal (a log file, CI), draw nothing;
    there a plain line can be printed every ``every`` steps instead.

    Args:
        total: the number of steps.
        desc: a short label.
        enabled: force the bar on or off; default: rank 0 on a terminal.
        every: with no bar, rank 0 prints a line every this many steps (0: never).
        engine: take loss, learning rate and throughput from this engine when
            :meth:`update` is given no metrics (the loss of ``engine.backward(loss)``).

    Example:
        >>> with Progress(total=steps, engine=engine) as bar:
        ...     ...; engine.step(); bar.update()
    """

    def __init__(self, total: int, desc: str = "train", enabled: Optional[bool] = None,
                 every: int = 0, engine: Any = None):
        self.total, self.desc, self.every, self.engine = total, desc, every, engine
        self.rank0 = comm.get_rank() == 0
        tty = sys.stderr.isatty()
        self.enabled = self.rank0 and (tty if enabled is None else enabled)
        self.count = 0
        self._start = time.perf_counter()
        self._shown = 0.0
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **metrics: float) -> None:
        """Advances by ``n`` steps and shows ``metrics`` (or the engine's, when none are given)."""
        self.count += n
        line_due = (not self._bar and self.rank0 and self.every
                    and (self.count % self.every == 0 or self.count == self.total))
        # Reading the engine's loss waits for the device: do it only when something is shown.
        now = time.perf_counter()
        if not metrics and self.engine is not None and (line_due or (self._bar and now - self._shown > 0.5)):
            metrics = self.engine._watch.summary()
            self._shown = now
        text = {k: _fmt(v) for k, v in metrics.items()}
        if self._bar is not None:
            if text:
                self._bar.set_postfix(text, refresh=False)
            self._bar.update(n)
        elif line_due:
            elapsed = now - self._start
            eta = elapsed / self.count * (self.total - self.count)
            fields = " ".join(f"{k}={v}" for k, v in text.items())
            print(f"{self.desc} {self.count}/{self.total} {fields} eta={eta:.0f}s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


# ==============================================================================================
# Monitors: files written by rank 0
# ==============================================================================================

#: Record key -> DeepSpeed's event name (TensorBoard tag, CSV file). DeepSpeed's own names
#: where it has one; x-axis: global samples, as in DeepSpeed.
_EVENTS = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    "grad_norm": "Train/Samples/grad_norm",
    "samples_per_s": "Train/Samples/samples_per_sec",
    "tokens_per_s": "Train/Samples/tokens_per_sec",
    "tflops": "Train/Samples/tflops_per_rank",
    "mfu": "Train/Samples/mfu",
}
_TIMER_EVENTS = {
    "forward": "Train/Samples/elapsed_time_ms_forward",
    "backward": "Train/Samples/elapsed_time_ms_backward",
    "reduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "optimizer": "Train/Samples/elapsed_time_ms_step",
}
_PER_RANK = {"memory_allocated": "Train/Samples/memory_allocated_rank{}",
             "memory_peak": "Train/Samples/memory_peak_rank{}"}
_NOT_EVENTS = {"step", "samples", "time", "skipped"}


def _events(record: Dict[str, Any]) -> List[Tuple[str, float]]:
    """A record as (event name, value) pairs, in DeepSpeed's naming."""
    events = []
    for key, value in record.items():
        if key in _NOT_EVENTS or value is None:
            continue
        if key == "time_ms":
            events += [(_TIMER_EVENTS.get(name, f"Train/Samples/elapsed_time_ms_{name}"), ms)
                       for name, ms in value.items()]
        elif key in _PER_RANK:
            events += [(_PER_RANK[key].format(rank), v) for rank, v in enumerate(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            events.append((_EVENTS.get(key, key if "/" in key else f"Train/Samples/{key}"), value))
    return events


def _log_dir(block: Any) -> str:
    return os.path.join(block.output_path, block.job_name)


class JSONLinesMonitor:
    """``metrics.jsonl``: one JSON object per line, per optimizer step (shardtrain's monitor).

    Keys: ``step``, ``samples``, ``time`` (Unix seconds), ``loss``, ``lr``, ``loss_scale``
    (fp16), ``grad_norm``, ``skipped``, ``samples_per_s``, ``tokens_per_s``,
    ``memory_allocated`` and ``memory_peak`` (bytes, one entry per rank), ``time_ms`` (with
    ``wall_clock_breakdown``), ``tflops`` and ``mfu`` (after a FLOPs profile), and whatever
    ``engine.log_metrics`` adds. A value that is not known is absent or null.
    """

    filename = "metrics.jsonl"

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, self.filename)
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: Dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


class CSVMonitor:
    """DeepSpeed's CSV layout: one file per event, ``Train_Samples_lr.csv`` with the header
    ``step,lr`` and one ``global samples,value`` row per optimizer step."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self._started: set = set()

    def write(self, record: Dict[str, Any]) -> None:
        for name, value in _events(record):
            filename = name.replace("/", "_").replace(" ", "_") + ".csv"
            path = os.path.join(self.log_dir, filename)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    if f.tell() == 0:
                        writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([record["samples"], value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    """TensorBoard events (``torch.utils.tensorboard``) with DeepSpeed's tags, x = samples."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("tensorboard.enabled needs the tensorboard package: pip install "
                              "'shardtrain[tensorboard]' (or: pip install tensorboard)") from None
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: Dict[str, Any]) -> None:
        for name, value in _events(record):
            self._writer.add_scalar(name, value, record["samples"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _build_monitors(config: Any) -> List[Any]:
    monitors = []
    for block, kind in ((config.jsonl_monitor, JSONLinesMonitor), (config.csv_monitor, CSVMonitor),
                        (config.tensorboard, TensorBoardMonitor)):
        if block.enabled:
            monitors.append(kind(_log_dir(block)))
    return monitors


# ==============================================================================================
# The engine's reporter
# ==============================================================================================


class _MemoryProbe:
    """Memory per rank: on CUDA the allocator's counters; on the CPU the model-state bytes
    plus the largest micro-batch's saved-activation bytes of the step. With ``per_forward``
    (a model-info profile) each forward is measured on CUDA too, into ``last_forward``."""

    def __init__(self, engine: Any, per_forward: bool):
        self.engine = engine
        self.cuda = accelerator.is_cuda()
        self.per_forward = per_forward
        self.last_forward: Optional[ActivationMemory] = None
        self.activation = 0
        self._states = 0
        self._states_step = -1

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if self.cuda and not self.per_forward:
            yield
            return
        if self.cuda:  # a profile: the allocator's rise during the forward is the measure
            accelerator.synchronize()
            base = accelerator.memory_stats()["allocated"]
            accelerator.reset_peak_memory()
        with SavedTensorMeter(self.engine.module) as meter:
            yield
        if self.cuda:
            accelerator.synchronize()
            rise = max(0, accelerator.memory_stats()["peak"] - base)
            self.last_forward = ActivationMemory(rise, meter.bytes, "cuda_peak")
            return
        self.activation = max(self.activation, meter.bytes)
        self.last_forward = ActivationMemory(meter.bytes, meter.bytes, "saved_tensors")

    def read(self) -> Tuple[int, int]:
        """(allocated, peak) bytes of this rank for the step just finished; starts a new step."""
        if self.cuda:
            stats = accelerator.memory_stats()
            accelerator.reset_peak_memory()
            return stats["allocated"], stats["peak"]
        step = self.engine.global_steps
        # Model states stop changing after the first steps (optimizer states are created
        # lazily), so they are counted again only now and then.
        if self._states_step < 0 or step <= 2 or step - self._states_step >= 100:
            self._states, self._states_step = self.engine.model_state_bytes()["total"], step
        peak, self.activation = self._states + self.activation, 0
        return self._states, peak


class _FlopsWindow:
    """Runs a :class:`FlopsProfiler` over the micro-steps of one optimizer step."""

    def __init__(self, module: torch.nn.Module, step: int):
        self.module, self.step = module, step
        self.profiler: Optional[FlopsProfiler] = None
        self.done = False

    def forward_begin(self, global_steps: int) -> None:
        if self.done or global_steps != self.step:
            return
        if self.profiler is None:
            self.profiler = FlopsProfiler(self.module)
            self.profiler.start()
        self.profiler.forward_begin()

    def forward_end(self) -> None:
        if self.profiler is not None and not self.done:
            self.profiler.forward_end()

    def finish(self):
        """The profile, once the profiled step is over (else None)."""
        if self.profiler is None or self.done:
            return None
        self.profiler.stop()
        self.done = True
        return self.profiler.result()


class StepWatch:
    """Everything the engine reports per step: built from the config by :func:`build_watch`.

    The engine calls :meth:`forward`, :meth:`backward_begin` / :meth:`backward_end`,
    :meth:`step_begin`, :meth:`lap` and :meth:`after_step`. With no monitor, timer or profiler
    configured these only count samples and keep the last loss (for :class:`Progress`): no
    device synchronisation and no collective.
    """

    def __init__(self, engine: Any):
        cfg = engine.config
        self.engine = engine
        self.rank0 = engine.global_rank == 0
        # Every rank takes part in the per-step gather, rank 0 alone writes.
        self.monitoring = any(b.enabled for b in (cfg.jsonl_monitor, cfg.csv_monitor, cfg.tensorboard))
        self.monitors = _build_monitors(cfg) if self.monitoring and self.rank0 else []
        timing = cfg.wall_clock_breakdown or cfg.flops_profiler.enabled  # as in DeepSpeed
        self.timers = Timers() if timing else None
        self.tuning = TuningProbe(cfg.autotuning, engine.global_rank)
        if not self.tuning.active:
            self.tuning = None
        wants_memory = self.monitoring or cfg.memory_breakdown or self.tuning is not None
        self.memory = _MemoryProbe(engine, self.tuning is not None and self.tuning.profile) \
            if wants_memory else None
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

    def _build_flops(self, engine: Any) -> Optional[_FlopsWindow]:
        cfg = engine.config
        step = None
        if cfg.flops_profiler.enabled and self.rank0:
            step = cfg.flops_profiler.profile_step
        elif self.tuning is not None and self.tuning.flops_step is not None and self.tuning.flops_step >= 0:
            step = self.tuning.flops_step
        return _FlopsWindow(engine.module, step) if step is not None else None

    # -- forward and backward ---------------------------------------------------------------

    def forward(self, inputs: Sequence[Any], kwargs: Dict[str, Any]):
        """A context manager around the engine's forward."""
        if not torch.is_grad_enabled():
            return contextlib.nullcontext()  # evaluation: not a training micro-batch
        self._tokens += _tokens_of(inputs, kwargs)
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

    def step_begin(self) -> None:
        """The optimizer step starts (a plain ``loss.backward()`` may not have told its end)."""
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
        tokens = sum(r[2] for r in ranks)
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
            parts.append(f"memory | allocated: {_bytes(memory[0])} | peak: {_bytes(memory[1])}")
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
            record[key] = value.item() if isinstance(value, torch.Tensor) else float(value)
        self._write(record)

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
            tokens = last["tokens"] * (1 if last.get("ranks") else self.engine.world_size)
            if last.get("ranks"):
                tokens = sum(r[2] for r in last["ranks"])
            if tokens:
                out["tok_s"] = tokens / seconds
            else:
                out["samples_s"] = self.engine.train_batch_size() / seconds
        return out

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


def build_watch(engine: Any) -> StepWatch:
    """The engine's :class:`StepWatch`, from its config (monitors, timers, profilers)."""
    return StepWatch(engine)


def _tokens_of(inputs: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """Tokens in a micro-batch: the elements of the first input when it holds integer ids
    (batch x sequence); 0 when the first input is not a token tensor."""
    for x in (*inputs, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.numel() if x.dim() >= 2 and not x.is_floating_point() and not x.is_complex() else 0
    return 0


def _compute_dtype(cfg: Any) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.torch_autocast.enabled:
        return cfg.torch_autocast.dtype or (torch.float16 if accelerator.is_cuda() else torch.bfloat16)
    return torch.float32


# ==============================================================================================
# Reading monitor files, and plots
# ==============================================================================================


def read_metrics(run_dir: str) -> Tuple[List[Dict[str, Any]], str]:
    """The records of a run directory (``output_path/job_name``), merged by step.

    Reads ``metrics.jsonl`` when present (x = step); otherwise the CSV monitor's files
    (x = global samples, as DeepSpeed writes them). The monitors append, so a file may hold
    several runs: a training record of step 1 starts a new run and only the last one is kept
    (a run resumed from a checkpoint continues its steps and stays whole).

    Returns:
        ``(records sorted by x, x-axis name "step" or "samples")``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir!r} (give output_path/job_name of a monitor)")
    jsonl = path / JSONLinesMonitor.filename
    if jsonl.is_file():
        merged: Dict[int, Dict[str, Any]] = {}
        for number, line in enumerate(jsonl.read_text().splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{jsonl}:{number} is not a JSON object; is the file damaged?") from None
                if record.get("step") == 1 and "lr" in record:
                    merged = {}  # a new run
                merged.setdefault(record["step"], {}).update(record)
        return [merged[k] for k in sorted(merged)], "step"
    return _read_csv_dir(path), "samples"


def _read_csv_dir(path: Path) -> List[Dict[str, Any]]:
    names = {v.replace("/", "_") + ".csv": k for k, v in _EVENTS.items()}
    names.update({v.replace("/", "_") + ".csv": ("time_ms", k) for k, v in _TIMER_EVENTS.items()})
    merged: Dict[int, Dict[str, Any]] = {}
    files = sorted(path.glob("*.csv"))
    if not files:
        raise FileNotFoundError(f"{path} has neither {JSONLinesMonitor.filename} nor CSV monitor files")
    for file in files:
        key = names.get(file.name)
        for prefix, field in (("Train_Samples_memory_allocated_rank", "memory_allocated"),
                              ("Train_Samples_memory_peak_rank", "memory_peak")):
            if file.name.startswith(prefix):
                key = (field, int(file.stem[len(prefix):]))
        if key is None:
            continue
        with open(file, newline="") as f:
            for row in list(csv.reader(f))[1:]:
                record = merged.setdefault(int(float(row[0])), {"samples": int(float(row[0]))})
                value = float(row[1])
                if isinstance(key, tuple) and key[0] == "time_ms":
                    record.setdefault("time_ms", {})[key[1]] = value
                elif isinstance(key, tuple):
                    ranks = record.setdefault(key[0], [])
                    ranks.extend([None] * (key[1] + 1 - len(ranks)))
                    ranks[key[1]] = value
                else:
                    record[key] = value
    return [merged[k] for k in sorted(merged)]


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'shardtrain[plot]' (or: pip install matplotlib)") \
            from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    return Figure


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> List[Path]:
    """Writes PNG plots of a run's monitor files: loss, learning rate, throughput and memory
    per rank over steps (over samples when only CSV files exist).

    Args:
        run_dir: a monitor's ``output_path/job_name``.
        out_dir: where the PNGs go; default ``run_dir/plots``.

    Returns:
        The paths written (a plot with no data to show is skipped).

    Example:
        >>> plot_run("runs/demo")
        [PosixPath('runs/demo/plots/loss.png'), ...]
    """
    Figure = _require_matplotlib()
    records, x_name = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, series, ylabel in _plot_series(records, x_name):
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        for label, xs, ys, style in series:
            ax.plot(xs, ys, style, label=label, linewidth=1.2)
        ax.set_xlabel(x_name)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} ({Path(run_dir).name})")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written


def _plot_series(records: List[Dict[str, Any]], x_name: str):
    def series(key: str, label: str, style: str = "-", scale: float = 1.0):
        pts = [(r[x_name], r[key] * scale) for r in records
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and x_name in r]
        return [(label, [p[0] for p in pts], [p[1] for p in pts], style)] if pts else []

    def per_rank(key: str, label: str, style: str):
        ranks = max((len(r.get(key) or []) for r in records), default=0)
        out = []
        for rank in range(ranks):
            pts = [(r[x_name], r[key][rank] / scale) for r in records
                   if len(r.get(key) or []) > rank and r[key][rank] is not None and x_name in r]
            if pts:
                out.append((f"{label} rank {rank}", [p[0] for p in pts], [p[1] for p in pts], style))
        return out

    largest = max((v for r in records for v in (r.get("memory_peak") or []) if v), default=0)
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))
                       if largest >= s or s == 1)
    yield "loss", series("loss", "loss"), "loss"
    yield "lr", series("lr", "learning rate"), "learning rate"
    throughput = series("tokens_per_s", "tokens/s") or series("samples_per_s", "samples/s")
    yield "throughput", throughput, throughput[0][0] if throughput else ""
    yield "memory", per_rank("memory_peak", "peak", "-") + per_rank("memory_allocated", "allocated", "--"), unit


_PLOT_EXAMPLES = """\
examples:
  shardtrain plot runs/demo                # writes runs/demo/plots/{loss,lr,throughput,memory}.png
  shardtrain plot runs/demo --out figures

RUN_DIR is a monitor's output_path/job_name: it holds metrics.jsonl (jsonl_monitor) or the CSV
files of csv_monitor. Needs matplotlib (pip install 'shardtrain[plot]').
"""


def build_plot_parser(prog: str = "shardtrain plot") -> argparse.ArgumentParser:
    """The argument parser of ``shardtrain plot``."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Plots loss, learning rate, throughput and memory per rank over steps from "
                    "the monitor files of a run, as PNG files.",
        epilog=_PLOT_EXAMPLES)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a monitor's output_path/job_name")
    parser.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")
    return parser


def plot_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardtrain plot RUN_DIR``: returns the exit status.

    Example:
        >>> plot_main(["runs/demo"])
        0
    """
    parser = build_plot_parser()
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    if not written:
        print(f"{parser.prog}: error: {args.run_dir} has no values to plot yet", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def add_plot_parser(commands: Any) -> None:
    """Registers ``shardtrain plot`` on the ``shardtrain`` command's subcommands; every
    argument is handed to :func:`plot_main` as it is (``--help`` included)."""
    sub = commands.add_parser("plot", help="PNG plots of a run's monitor files",
                              add_help=False, prefix_chars="\0")  # no option is parsed here
    sub.add_argument("argv", nargs=argparse.REMAINDER)
    sub.set_defaults(handler=lambda args: plot_main(args.argv), subparser=sub)
