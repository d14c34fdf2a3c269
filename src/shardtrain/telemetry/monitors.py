"""The monitors of the config: the files rank 0 writes once per optimizer step.

``jsonl_monitor`` (shardtrain's own) keeps every value of the step record on one JSON line;
``csv_monitor`` and ``tensorboard`` write DeepSpeed's layouts, one event per value, named as
DeepSpeed names them (:mod:`._events`), so that tools written for DeepSpeed's files read
these. Every writer takes the same record from the engine's
:class:`~shardtrain.telemetry.watch.StepWatch` and has ``write(record)`` and ``close()``.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List

from ._events import events

__all__ = ["JSONLinesMonitor", "CSVMonitor", "TensorBoardMonitor", "build_monitors"]


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
        for name, value in events(record):
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
        for name, value in events(record):
            self._writer.add_scalar(name, value, record["samples"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def build_monitors(config: Any) -> List[Any]:
    """The writers the config enables (for rank 0; the others write nothing)."""
    monitors = []
    for block, kind in ((config.jsonl_monitor, JSONLinesMonitor), (config.csv_monitor, CSVMonitor),
                        (config.tensorboard, TensorBoardMonitor)):
        if block.enabled:
            monitors.append(kind(_log_dir(block)))
    return monitors
