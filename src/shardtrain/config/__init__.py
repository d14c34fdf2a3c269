"""Typed, strict training configuration with DeepSpeed-compatible JSON keys.

A shardtrain config is the same JSON document a DeepSpeed 0.19.8 user already has: the
same key names and the same defaults. It is loaded into pydantic models, one per concern
(:class:`ZeroConfig`, :class:`FP16Config`, ...), under one root, :class:`ShardConfig`.
JSON is only a loader into these models.

shardtrain is stricter than DeepSpeed on purpose, so a typo or an unsupported feature can
never be ignored silently:

* an unknown key, at any level, is an error (with a "did you mean" suggestion);
* a key DeepSpeed removed is an error, whatever its value;
* a feature shardtrain has not implemented yet is listed in :data:`PLANNED`; such a key is
  accepted only at its default (disabled) value.

Every user mistake raises :class:`ConfigError` naming the dotted key, showing the value and
saying what to do.

This package is the public face; its modules are private and each holds one idea:

* ``_values``: the value types every block shares (integral floats as ints, no bool/number
  mixing, dtype names) and how a value is shown in a message;
* ``_status``: the status tables (:data:`PLANNED`, :data:`REMOVED_KEYS`, keys with no effect);
* ``_model``: :class:`ConfigError` and the strict base model: removed and unknown keys with
  "did you mean", ``"auto"`` placeholders, deprecated aliases;
* one module per concern, each holding its typed blocks and their own checks: ``_zero``,
  ``_precision``, ``_optimizer``, ``_execution`` (activation checkpointing, compile),
  ``_monitoring`` (profiler, monitors, communication logger), ``_autotuning``, ``_checkpoint``;
* ``_root``: :class:`ShardConfig`, which runs the whole-config steps once every block is valid:
  ``_batch`` (the batch triple), ``_checks`` (cross-block rules, :func:`situational_notes`) and
  ``_planned`` (the planned-feature gate);
* ``_dotted``: dotted top-level keys (``"zero_optimization.reduce_bucket_size"``, as TRL writes
  them) read as the nested keys they name, before the root checks its keys;
* ``_load``: :func:`load_config`, from a dict, a JSON/hjson file or base64 JSON, and
  :func:`read_config_file`, a file's settings unvalidated;
* ``_errors``: pydantic's validation errors rewritten as one :class:`ConfigError`;
* ``_table``: :func:`config_table`, from which ``docs/config.md`` is generated.

Imports go one way: values and status tables, the base model, the blocks, the root, then the
loader, the error formatter and the table, which read the whole tree.

Example:
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    ...                   world_size=2)
    >>> cfg.train_batch_size, cfg.zero_optimization.stage, cfg.gradient_clipping
    (16, 0, 1.0)
"""

from ._autotuning import AutotuningConfig, AutotuningModelInfoConfig
from ._checkpoint import CheckpointConfig, CheckpointParallelWriteConfig, CheckpointWriterConfig
from ._checks import situational_notes
from ._execution import ActivationCheckpointingConfig, CompileConfig
from ._load import load_config, read_config_file
from ._diagnostics import DiagnosticsConfig
from ._mesh import data_parallel_world, tensor_parallel_size
from ._model import ConfigError
from ._monitoring import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    JSONLMonitorConfig,
    MLflowConfig,
    TensorBoardConfig,
    WandbConfig,
)
from ._optimizer import OptimizerConfig, SchedulerConfig
from ._precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from ._root import ShardConfig
from ._status import IMPLEMENTED_ZERO_STAGES, PLANNED, REMOVED_KEYS
from ._table import config_table
from ._zero import LeafModuleConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

# Data importable from here but outside __all__: ``zero.leaf`` compares a block's classes with
# DEFAULT_LEAF_MODULE_CLASSES; NO_EFFECT and STAGE_TUNING_KEYS complete the status tables.
from ._status import NO_EFFECT as NO_EFFECT
from ._status import STAGE_TUNING_KEYS as STAGE_TUNING_KEYS
from ._zero import DEFAULT_LEAF_MODULE_CLASSES as DEFAULT_LEAF_MODULE_CLASSES

__all__ = [
    "situational_notes",
    "data_parallel_world",
    "tensor_parallel_size",
    "ConfigError",
    "IMPLEMENTED_ZERO_STAGES",
    "PLANNED",
    "REMOVED_KEYS",
    "ShardConfig",
    "ZeroConfig",
    "OffloadParamConfig",
    "OffloadOptimizerConfig",
    "LeafModuleConfig",
    "FP16Config",
    "BF16Config",
    "TorchAutocastConfig",
    "DataTypesConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ActivationCheckpointingConfig",
    "CompileConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "CSVMonitorConfig",
    "WandbConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "JSONLMonitorConfig",
    "MLflowConfig",
    "DiagnosticsConfig",
    "AutotuningConfig",
    "AutotuningModelInfoConfig",
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
    "CheckpointWriterConfig",
    "config_table",
    "load_config",
    "read_config_file",
]

# The public classes and functions name this package as their home, as they did when it was one
# module: tracebacks print ``shardtrain.config.ConfigError`` and pickles refer to the public path,
# which stays put however the private modules are arranged.
for _name in __all__:
    _public = globals()[_name]
    if callable(_public):
        _public.__module__ = __name__
del _name, _public
