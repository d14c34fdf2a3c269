"""The names ``shardtrain.profiling`` has always offered, kept for existing code.

Measuring what training costs now lives in :mod:`shardtrain.telemetry` (activation memory,
timers, FLOPs and ``peak_flops``), choosing the micro-batch and ZeRO stage in
:mod:`shardtrain.autotune` (stage fits, the in-job probe, the memory budget, the search), and
the ``shardtrain autotune`` command in :mod:`shardtrain.cli`. This module re-exports them under
their old names; new code imports from the packages.

The command's functions (:func:`autotune_main`, ``build_autotune_parser``,
``add_autotune_parser``: :mod:`shardtrain.cli`'s) are loaded on first use, so that importing
this module does not load the command line.

Example:
    >>> from shardtrain.profiling import measure_activation_memory, peak_flops  # as before
    >>> from shardtrain.telemetry import measure_activation_memory, peak_flops  # the same objects
"""
from __future__ import annotations

from typing import Any

# AutotuneError, PEAK_TFLOPS_ENV, memory_budget_from_env and write_json were never in __all__
# but were reachable here; they still are.
from .autotune import AutotuneError as AutotuneError
from .autotune import (MEMORY_BUDGET_ENV, AutotuneResult, OutOfMemoryError, StageFit, Trial,
                       TuningProbe, autotune, format_trials, model_info_record, parse_size,
                       stage_fits)
from .autotune import memory_budget_from_env as memory_budget_from_env
from .files import write_json as write_json
from .telemetry import PEAK_TFLOPS_ENV as PEAK_TFLOPS_ENV
from .telemetry import (ActivationMemory, FlopsProfile, FlopsProfiler, ModuleCost, SavedTensorMeter,
                        Timers, measure_activation_memory, peak_flops)

__all__ = [
    "SavedTensorMeter", "ActivationMemory", "measure_activation_memory", "Timers",
    "FlopsProfiler", "FlopsProfile", "ModuleCost", "peak_flops", "OutOfMemoryError",
    "MEMORY_BUDGET_ENV", "StageFit", "stage_fits", "autotune", "AutotuneResult", "Trial",
    "autotune_main", "parse_size", "TuningProbe", "model_info_record", "format_trials",  # noqa: F822
    "add_autotune_parser",  # noqa: F822 (the command's functions are loaded on first use)
]

_COMMAND_NAMES = ("autotune_main", "build_autotune_parser", "add_autotune_parser")  # shardtrain.cli's


def __getattr__(name: str) -> Any:
    if name in _COMMAND_NAMES:
        from . import cli
        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
