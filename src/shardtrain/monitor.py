"""The names ``shardtrain.monitor`` has always offered, kept for existing code.

What a person watches while training runs now lives in :mod:`shardtrain.telemetry` (progress
bar, monitors, the engine's step watch, reading metrics, plots) and the ``shardtrain plot``
command in :mod:`shardtrain.cli`. This module re-exports them under their old names; new code
imports from :mod:`shardtrain.telemetry`.

The command's functions (:func:`plot_main`, ``build_plot_parser``, ``add_plot_parser``:
:mod:`shardtrain.cli`'s) are loaded on first use, so that importing this module does not load
the command line.

Example:
    >>> from shardtrain.monitor import Progress, plot_run   # as before
    >>> from shardtrain.telemetry import Progress, plot_run # the same objects
"""
from __future__ import annotations

from typing import Any

from .telemetry import (CSVMonitor, JSONLinesMonitor, Progress, StepWatch, TensorBoardMonitor,
                        build_watch, plot_run, read_metrics)

__all__ = ["Progress", "StepWatch", "build_watch", "JSONLinesMonitor", "CSVMonitor",
           "TensorBoardMonitor", "read_metrics", "plot_run",
           "plot_main", "add_plot_parser"]  # noqa: F822 (the command's functions load on first use)

_COMMAND_NAMES = ("plot_main", "build_plot_parser", "add_plot_parser")  # shardtrain.cli's


def __getattr__(name: str) -> Any:
    if name in _COMMAND_NAMES:
        from . import cli
        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
