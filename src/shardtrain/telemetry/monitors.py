"""The monitors of the config: the files rank 0 writes once per optimizer step.

``jsonl_monitor`` (shardtrain's own) keeps every value of the step record on one JSON line;
``csv_monitor`` and ``tensorboard`` write DeepSpeed's layouts, one event per value, named as
DeepSpeed names them (:mod:`._events`), so that tools written for DeepSpeed's files read
these. ``wandb`` and ``mlflow`` send the same events to the trackers, with the resolved config
as the run's hyper-parameters. Every writer takes the same record from the engine's
:class:`~shardtrain.telemetry.watch.StepWatch` and has ``write(record)`` and ``close()``.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List

from ._events import events

__all__ = ["JSONLinesMonitor", "CSVMonitor", "TensorBoardMonitor", "WandbMonitor",
           "MLflowMonitor", "build_monitors", "monitoring"]


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


class WandbMonitor:
    """Weights & Biases: one run (``project``, ``group``, ``team`` as its entity) whose config is
    the resolved shardtrain config; each record's events are logged with ``Train/Samples``
    (global samples) as their x-axis, as the other monitors plot them. wandb's environment
    variables apply (``WANDB_MODE=offline`` writes the run under ``WANDB_DIR`` and sends
    nothing; ``WANDB_NAME`` names it)."""

    def __init__(self, block: Any, hyperparameters: Dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ImportError("wandb.enabled needs the wandb package: pip install "
                              "'shardtrain[wandb]' (or: pip install wandb)") from None
        self._run = wandb.init(project=block.project, group=block.group, entity=block.team,
                               config=hyperparameters)
        self._run.define_metric(SAMPLES)
        self._run.define_metric("*", step_metric=SAMPLES)

    def write(self, record: Dict[str, Any]) -> None:
        values = dict(events(record))
        if values:
            self._run.log({SAMPLES: record["samples"], **values})

    def close(self) -> None:
        self._run.finish()


class MLflowMonitor:
    """MLflow: one run in ``experiment_name`` (at ``tracking_uri``, else MLflow's default)
    whose parameters are the resolved config, flattened (``zero_optimization.stage``); each
    record's events are metrics at step = global samples."""

    def __init__(self, block: Any, hyperparameters: Dict[str, Any]):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError("mlflow.enabled needs the mlflow package: pip install "
                              "'shardtrain[mlflow]' (or: pip install mlflow-skinny)") from None
        self._client = MlflowClient(tracking_uri=block.tracking_uri)
        experiment = self._client.get_experiment_by_name(block.experiment_name)
        experiment_id = experiment.experiment_id if experiment is not None else \
            self._client.create_experiment(block.experiment_name)
        tags = {"mlflow.runName": block.run_name} if block.run_name else None
        self.run_id = self._client.create_run(experiment_id, tags=tags).info.run_id
        params = [Param(key, str(value)[:_MLFLOW_VALUE_LIMIT])
                  for key, value in sorted(_flatten(hyperparameters).items())]
        for start in range(0, len(params), _MLFLOW_BATCH):  # MLflow takes 100 per batch
            self._client.log_batch(self.run_id, params=params[start:start + _MLFLOW_BATCH])

    def write(self, record: Dict[str, Any]) -> None:
        from mlflow.entities import Metric
        stamp = int(record.get("time", 0) * 1000)
        metrics = [Metric(name, float(value), stamp, record["samples"])
                   for name, value in events(record)]
        for start in range(0, len(metrics), _MLFLOW_BATCH * 10):  # 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=metrics[start:start + _MLFLOW_BATCH * 10])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


SAMPLES = "Train/Samples"
_MLFLOW_BATCH = 100
_MLFLOW_VALUE_LIMIT = 6000  # characters of a parameter value MLflow stores


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def build_monitors(config: Any) -> List[Any]:
    """The writers the config enables (for rank 0; the others write nothing)."""
    monitors: List[Any] = []
    for block, kind in ((config.jsonl_monitor, JSONLinesMonitor), (config.csv_monitor, CSVMonitor),
                        (config.tensorboard, TensorBoardMonitor)):
        if block.enabled:
            monitors.append(kind(_log_dir(block)))
    for block, kind in ((config.wandb, WandbMonitor), (config.mlflow, MLflowMonitor)):
        if block.enabled:
            monitors.append(kind(block, config.to_dict()))
    return monitors


def monitoring(config: Any) -> bool:
    """Whether the config enables any monitor (the same answer on every rank)."""
    return any(b.enabled for b in (config.jsonl_monitor, config.csv_monitor, config.tensorboard,
                                   config.wandb, config.mlflow))
