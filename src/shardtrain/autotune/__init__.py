"""Choosing the micro-batch and ZeRO stage: the largest micro-batch that fits a memory budget
per stage, and the fastest of them.

The search runs outside the training job and the probe inside it; they talk through files.

* :mod:`~.search`: :func:`autotune` (``shardtrain autotune``): a profile run of the user's
  script, a prediction per stage, short trials around it, the fastest configuration written
  as ``best_config.json``;
* :mod:`~.fits`: :class:`StageFit` and :func:`stage_fits`, the prediction: model states by the
  ZeRO formula plus activations per sample, against the budget;
* :mod:`~.probe`: :class:`TuningProbe`, the engine's side: a profile run writes
  :func:`model_info_record`, a trial writes its samples/s, latency and peak memory, then both
  exit;
* :mod:`~.budget`: the memory budget a run is given (``SHARDTRAIN_MEMORY_BUDGET``,
  :func:`memory_budget_from_env`, :func:`parse_size`) and the :class:`OutOfMemoryError` a step
  over it raises on the CPU;
* :mod:`~.trials`: :class:`Trial`, :class:`AutotuneResult` and their table
  (:func:`format_trials`, ``trials.csv``).

The runner that starts each run and the configs it writes live in private modules; the JSON
files are written atomically by :func:`shardtrain.files.write_json`. The command line
(``shardtrain autotune``) is in :mod:`shardtrain.cli`; this package never imports it, nor
the engine.

Example:
    >>> from shardtrain.autotune import autotune, format_trials, parse_size
    >>> result = autotune("train.py", "train.json", budget=parse_size("16GiB"), stages=[0, 2])
    >>> print(format_trials(result)); result.best_config_path
"""
from .budget import MEMORY_BUDGET_ENV, OutOfMemoryError, memory_budget_from_env, parse_size
from .fits import StageFit, stage_fits
from .probe import TuningProbe, model_info_record
from .search import AutotuneError, autotune
from .trials import AutotuneResult, Trial, format_trials

__all__ = [
    "autotune", "AutotuneResult", "AutotuneError", "Trial", "format_trials", "StageFit",
    "stage_fits", "TuningProbe", "model_info_record", "MEMORY_BUDGET_ENV", "OutOfMemoryError",
    "memory_budget_from_env", "parse_size",
]
