"""What a search produces: its trials, its result, and the table of them.

A :class:`Trial` holds what one short run measured; an :class:`AutotuneResult` the chosen
trial and everything that led to it. The same rows go to ``trials.csv`` (:func:`write_table`)
and to the terminal (:func:`format_trials`).
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..memory import format_bytes
from .fits import StageFit

__all__ = ["Trial", "AutotuneResult", "format_trials", "write_table"]


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


_TABLE_FIELDS = ("name", "stage", "micro_batch", "status", "samples_per_s", "latency_ms",
                 "flops_per_s", "peak_memory")


def write_table(trials: List[Trial], path: Path) -> None:
    """Writes one CSV row per trial (an unknown value is an empty cell)."""
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
                     f"{(format_bytes(t.peak_memory) if t.peak_memory is not None else '-'):>12}{mark}")
    return "\n".join(lines)


def _num(value: Optional[float], fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"
