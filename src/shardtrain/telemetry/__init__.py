"""What a person watches while training runs, and what the engine measures to show it.

Every module holds one idea:

* :mod:`~.progress`: :class:`Progress`, a tqdm bar with loss, throughput and ETA (rank 0);
* :mod:`~.monitors`: the config's monitors, the files rank 0 writes once per optimizer step
  (``jsonl_monitor``, and ``csv_monitor`` and ``tensorboard`` in DeepSpeed's layouts);
* :mod:`~.timers`: :class:`Timers`, the forward / backward / reduce / optimizer times of
  ``wall_clock_breakdown``;
* :mod:`~.flops`: :class:`FlopsProfiler` (FLOPs, parameters and latency per module) and
  :func:`peak_flops`, for model FLOPs utilisation;
* :mod:`~.comms`: the communication log (``comms_logger``): every collective's latency and
  bandwidth, by operation and message size;
* :mod:`~.activation`: :class:`SavedTensorMeter` and :func:`measure_activation_memory`, the
  memory a micro-batch keeps for backward, on CUDA and on the CPU;
* :mod:`~.watch`: :class:`StepWatch`, built by :func:`build_watch`: the one object the engine
  reports to at each step, which runs the parts above that the config turns on (and the
  autotuner's in-job probe, :class:`shardtrain.autotune.TuningProbe`);
* :mod:`~.metrics` and :mod:`~.plot`: :func:`read_metrics` reads a run's monitor files back,
  :func:`plot_run` draws them (``shardtrain plot``).

The config keys that drive them (``jsonl_monitor``, ``csv_monitor``, ``tensorboard``,
``wall_clock_breakdown``, ``memory_breakdown``, ``flops_profiler``, ``comms_logger``) are described in
``docs/monitoring.md``. Nothing here imports the engine or the command line: the engine hands
itself to :func:`build_watch`, and ``shardtrain plot`` lives in :mod:`shardtrain.cli`.

Example:
    >>> from shardtrain.telemetry import Progress, plot_run
    >>> with Progress(total=300, engine=engine) as bar:
    ...     for step in range(300):
    ...         ...                    # forward, engine.backward(loss), engine.step()
    ...         bar.update()           # loss and throughput come from the engine
    >>> plot_run("runs/demo")          # loss.png, lr.png, throughput.png, memory.png
"""
from .activation import ActivationMemory, SavedTensorMeter, measure_activation_memory
from .flops import PEAK_TFLOPS_ENV, FlopsProfile, FlopsProfiler, ModuleCost, peak_flops
from .metrics import read_metrics
from .monitors import CSVMonitor, JSONLinesMonitor, TensorBoardMonitor
from .plot import plot_run
from .progress import Progress
from .timers import Timers
from .watch import StepWatch, build_watch

__all__ = [
    "Progress", "JSONLinesMonitor", "CSVMonitor", "TensorBoardMonitor", "Timers",
    "FlopsProfiler", "FlopsProfile", "ModuleCost", "peak_flops", "PEAK_TFLOPS_ENV",
    "SavedTensorMeter", "ActivationMemory", "measure_activation_memory", "StepWatch",
    "build_watch", "read_metrics", "plot_run",
]
