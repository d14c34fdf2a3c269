"""The root of the config: :class:`ShardConfig`, one typed block per concern under it.

The root owns what no block can decide alone: the legacy forms of whole blocks
(``"zero_optimization": true``, ``bfloat16``), the batch triple (which needs the world size, so
it is passed as validation context), the cross-block checks and the planned-feature gate, all
run once every block is valid. It also keeps the input as given, because DeepSpeed's
``engine.config`` is that dict and libraries read it with ``.get`` and ``[...]``.
"""

import copy
import json
import logging
from typing import Any, ClassVar, Dict, Literal, Mapping, Optional

import torch
from pydantic import BeforeValidator, Field, PrivateAttr, ValidationInfo, model_validator
from typing_extensions import Annotated

from ._autotuning import AutotuningConfig
from ._batch import _BATCH_KEYS, _resolve_batch
from ._checkpoint import CheckpointConfig
from ._checks import _check_combinations
from ._execution import ActivationCheckpointingConfig, CompileConfig
from ._diagnostics import DiagnosticsConfig
from ._dotted import unfold_dotted
from ._mesh import data_parallel_world, tensor_parallel_size
from ._model import ConfigError, _ConfigModel
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
from ._planned import _check_planned
from ._precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from ._values import _DTYPES, _Block, _Bool, _every_value, _Float, _Int, _lower, _show, _upper
from ._zero import ZeroConfig

# One logger for the whole package, named as users filter it: "shardtrain.config".
logger = logging.getLogger(__package__)

__all__ = ["ShardConfig"]


class ShardConfig(_ConfigModel):
    """The whole training config, validated and with the batch triple resolved.

    Build it with :func:`load_config`. The batch keys are always ints afterwards;
    ``zero_optimization.overlap_comm`` is always a bool. ``raw`` is the input as given and
    :meth:`to_dict` the resolved config (both JSON-able, for checkpoints).

    Example:
        >>> cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        ...                    "bf16": {"enabled": True}}, world_size=2)
        >>> cfg.gradient_accumulation_steps, cfg.comm_dtype()
        (4, torch.bfloat16)
    """

    drops_auto: ClassVar[bool] = False
    deprecated_keys: ClassVar[Dict[str, Optional[str]]] = {"bfloat16": "bf16", "allgather_size": None}

    # Batch triple: resolved by the post-validation step; None on input means "derive it".
    train_batch_size: _Int = Field(None, description="global samples per optimizer step")
    train_micro_batch_size_per_gpu: _Int = Field(None, description="samples per forward/backward on one rank")
    gradient_accumulation_steps: _Int = Field(None, description="micro-batches per optimizer step")
    managed_gradient_accumulation: _Bool = Field(True, description="false: every step() is a boundary")
    steps_per_print: Annotated[Optional[int], BeforeValidator(_every_value)] = Field(
        None, gt=0, description="log progress every N steps; null or Infinity = never")
    wall_clock_breakdown: _Bool = Field(False, description="per-step forward/backward/reduce/optimizer timers, "
                                                       "logged every steps_per_print steps (rank 0)")
    memory_breakdown: _Bool = Field(False, description="memory per rank in the steps_per_print log")
    gradient_clipping: _Float = Field(1.0, ge=0.0, description="global-norm clip threshold; 0 disables")
    nonfinite_gradients: Annotated[Optional[Literal["skip", "apply", "error"]], BeforeValidator(_lower)] = Field(
        None, description="a step whose gradients hold inf/NaN: skip it (the default; counted in skipped_steps), "
                          "apply it, or raise an error (shardtrain only)")
    prescale_gradients: _Bool = Field(False, description="divide by the world size before the all-reduce")
    gradient_predivide_factor: _Float = Field(1.0, gt=0.0,
                                              description="share of the averaging done before the all-reduce")
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = Field(
        "mean", description="mean or sum (any case)")
    communication_data_type: Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(_lower)] = Field(
        None, description="gradient communication dtype; null = the precision mode's")
    seq_parallel_communication_data_type: Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_lower)] = Field(
        "fp32", description="gradient communication dtype with sequence parallelism (replaces communication_data_type)")
    zero_allow_untested_optimizer: _Bool = Field(False, description="allow optimizers outside DeepSpeed's ZeRO list")
    zero_force_ds_cpu_optimizer: _Bool = Field(True, description="with ZeRO-Offload, require a DeepSpeed CPU optimizer")
    dataloader_drop_last: _Bool = Field(False, description="drop the last incomplete batch of the built dataloader")
    disable_allgather: _Bool = Field(False, description="niche flag")
    dump_state: _Bool = Field(False, description="rank 0 logs engine.state_report() at start-up")
    disable_python_gc: _Bool = Field(
        False, description="Python's cyclic garbage collector off while the engine lives (collect_python_gc() runs it)")
    vocabulary_size: Optional[_Int] = Field(None, gt=0, description="warns if not a multiple of 8")
    log_level: Annotated[Optional[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]],
                         BeforeValidator(_upper)] = Field(None, description="shardtrain logger level")
    use_data_before_expert_parallelism: _Bool = Field(False, description="MoE group topology")
    sequence_parallel_size: Optional[_Int] = Field(None, gt=0, description="sequence-parallel group size")
    data_parallel_size: Optional[_Int] = Field(None, gt=0, description="data-parallel size of the device mesh")

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO sharding")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 training")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 training")
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig, description="autocast training")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="dtype overrides")
    optimizer: Optional[OptimizerConfig] = Field(None, description="optimizer built from the config")
    scheduler: Optional[SchedulerConfig] = Field(None, description="scheduler built from the config")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="activation checkpointing")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description="FLOPs profiler")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard monitor")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="CSV monitor")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases monitor")
    comet: CometConfig = Field(default_factory=CometConfig, description="Comet monitor")
    jsonl_monitor: JSONLMonitorConfig = Field(default_factory=JSONLMonitorConfig,
                                              description="JSON-lines monitor (shardtrain only)")
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig, description="MLflow monitor (shardtrain only)")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="communication logger")
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig,
                                           description="collective timeouts and divergence check (shardtrain only)")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile")
    timers: _Block = Field(default_factory=dict, description="throughput timers")
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig, description="autotuner")
    pipeline: _Block = Field(default_factory=dict, description=(
        "pipeline parallelism: read by a PipelineModule's engine (schedule, "
        "activation_checkpoint_interval; unknown keys refused there); stages > 1 splits a "
        "Hugging Face causal LM into stages (refused for other models)"))
    tensor_parallel: _Block = Field(default_factory=dict, description="tensor parallelism")
    expert_parallel: _Block = Field(default_factory=dict, description="expert parallelism")
    hybrid_engine: _Block = Field(default_factory=dict, description="hybrid engine")
    data_efficiency: _Block = Field(default_factory=dict, description="data efficiency")
    aio: _Block = Field(default_factory=dict, description="asynchronous I/O")
    weight_quantization: _Block = Field(default_factory=dict, description="weight quantization")
    datastates_ckpt: _Block = Field(default_factory=dict, description="DataStates checkpointing")
    model_info: _Block = Field(default_factory=dict, description="model information for the autotuner")

    _raw: Dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: Any) -> "ShardConfig":
        cfg = handler(data)
        if isinstance(data, Mapping):
            cfg._raw = copy.deepcopy(dict(data))
        return cfg

    @classmethod
    def _unfold(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return unfold_dotted(cls, data)

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if "bfloat16" in data:
            if "bf16" in data:
                raise ConfigError("bf16 and bfloat16 are both given; bfloat16 is an older name for bf16. "
                                  "Keep only bf16.")
            data["bf16"] = data.pop("bfloat16")
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            logger.warning("\"zero_optimization\": %s is a deprecated form; write {\"stage\": %d} instead",
                           json.dumps(zero), int(zero))
            data["zero_optimization"] = {"stage": int(zero)}
            if zero:
                data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size", 500_000_000)
        if "allgather_size" in data:
            raise ConfigError(f"allgather_size (got {_show(data['allgather_size'])}) is only read with the legacy "
                              "\"zero_optimization\": true form; set zero_optimization.allgather_bucket_size instead.")
        for key in _BATCH_KEYS:
            if key in data and data[key] is None:
                del data[key]  # null means "not given": the batch arithmetic derives it
        return data

    @model_validator(mode="after")
    def _finish(self, info: ValidationInfo) -> "ShardConfig":
        context = info.context or {}
        world_size = context.get("world_size")
        if world_size is None:
            raise TypeError("ShardConfig needs the world size: build it with "
                            "load_config(config, world_size) or model_validate(data, context={'world_size': n}).")
        dp = context.get("data_parallel_world_size") or data_parallel_world(
            world_size, self.tensor_parallel_size(), self.sequence_parallel_size or 1, self.data_parallel_size)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
            _resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                           self.gradient_accumulation_steps, dp))
        _check_combinations(self)
        _check_planned(self)
        if self.vocabulary_size is not None and self.vocabulary_size % 8:
            logger.warning("vocabulary_size %d is not a multiple of 8; padding it helps tensor-core kernels",
                           self.vocabulary_size)
        return self

    def tensor_parallel_size(self) -> int:
        """Ranks each layer is split over (``tensor_parallel.autotp_size``; 1: none)."""
        return tensor_parallel_size(self.tensor_parallel)

    @property
    def raw(self) -> Dict[str, Any]:
        """The config exactly as the user gave it (a copy)."""
        return copy.deepcopy(self._raw)

    # DeepSpeed's ``engine.config`` is the config dict as given: libraries read it with
    # ``engine.config.get("zero_optimization", {})`` and ``engine.config["train_batch_size"]``.
    def _as_given(self) -> Dict[str, Any]:
        given = dict(self._raw)
        for key in _BATCH_KEYS:  # resolved, never "auto" or missing
            given[key] = getattr(self, key)
        return given

    def get(self, key: str, default: Any = None) -> Any:
        """The value of top-level ``key`` as the config gave it (the batch keys resolved)."""
        return self._as_given().get(key, default)

    def __getitem__(self, key: str) -> Any:
        given = self._as_given()
        if key not in given:
            raise KeyError(f"{key!r} is not in the config (it takes its default: "
                           f"see engine.config.{key} for the resolved value)")
        return given[key]

    def __contains__(self, key: object) -> bool:
        return key in self._as_given()

    def to_dict(self) -> Dict[str, Any]:
        """The resolved config as plain JSON data; ``load_config`` accepts it back unchanged."""
        return self.model_dump(mode="json", by_alias=True)

    def comm_dtype(self, sequence_parallel: bool = False) -> torch.dtype:
        """The dtype gradients are communicated in: with ``sequence_parallel`` (more than one
        rank per sequence), ``seq_parallel_communication_data_type`` (fp32 by default: the
        sum runs over every slice of every sequence); else ``communication_data_type``, else
        the precision mode's."""
        if sequence_parallel:
            return _DTYPES[self.seq_parallel_communication_data_type]
        if self.communication_data_type is not None:
            return _DTYPES[self.communication_data_type]
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32
