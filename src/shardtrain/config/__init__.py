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

Example:
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    ...                   world_size=2)
    >>> cfg.train_batch_size, cfg.zero_optimization.stage, cfg.gradient_clipping
    (16, 0, 1.0)
"""

import base64
import binascii
import copy
import difflib
import json
import logging
import math
import os
import sys
import typing
from pathlib import Path
from typing import Any, ClassVar, Dict, FrozenSet, List, Literal, Mapping, Optional, Tuple, Union

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from typing_extensions import Annotated

logger = logging.getLogger(__name__)

__all__ = [
    "situational_notes",
    "ConfigError",
    "IMPLEMENTED_ZERO_STAGES",
    "PLANNED",
    "REMOVED_KEYS",
    "ShardConfig",
    "ZeroConfig",
    "OffloadParamConfig",
    "OffloadOptimizerConfig",
    "FP16Config",
    "BF16Config",
    "TorchAutocastConfig",
    "DataTypesConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ActivationCheckpointingConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "CSVMonitorConfig",
    "WandbConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "JSONLMonitorConfig",
    "AutotuningConfig",
    "AutotuningModelInfoConfig",
    "CheckpointConfig",
    "CheckpointParallelWriteConfig",
    "CheckpointWriterConfig",
    "config_table",
    "load_config",
]


class ConfigError(ValueError):
    """A mistake in the user's config. The message names the key, shows the value and says what to do."""


# --------------------------------------------------------------------------------------------
# Status tables. Moving a feature from "planned" to "implemented" means deleting its entry here
# (and, for ZeRO, adding the stage to IMPLEMENTED_ZERO_STAGES); nothing else has to change.
# --------------------------------------------------------------------------------------------

IMPLEMENTED_ZERO_STAGES: FrozenSet[int] = frozenset({0, 1, 2, 3})

#: Dotted key -> what the feature is. A planned key is accepted only at its default (disabled)
#: value; any other value raises ConfigError. Object-valued blocks without a model here
#: (``hybrid_engine``, ``tensor_parallel``, ...) count as disabled when they ask for nothing:
#: ``{}``, ``"enabled": false`` (whatever settings come with it), every sub-block disabled, or
#: for ``tensor_parallel`` a size of at most 1 (see :func:`_block_disabled`).
PLANNED: Dict[str, str] = {
    "zero_optimization.offload_optimizer.device": "offload to NVMe (cpu is supported)",
    "zero_optimization.offload_param.device": "offload to NVMe (cpu is supported)",
    "zero_optimization.offload_optimizer.ratio": "partial optimizer offload",
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload",
    "zero_optimization.offload_optimizer.pipeline_read": "NVMe offload pipelining",
    "zero_optimization.offload_optimizer.pipeline_write": "NVMe offload pipelining",
    "zero_optimization.offload_optimizer.fast_init": "NVMe offload",
    "zero_optimization.zero_quantized_weights": "ZeRO++ quantized weight all-gather",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ quantized frozen weights",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradient reduction",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical weight partitioning (hpZ)",
    "zero_optimization.zenflow": "ZenFlow",
    "torch_autocast.lower_precision_safe_modules": "per-module autocast gradient precision",
    "disable_allgather": "disabling the ZeRO all-gather",
    "dump_state": "printing the engine state at start-up",
    "disable_python_gc": "disabling Python's garbage collector during training",
    "fp16.fp16_master_weights_and_grads": "16-bit master weights and gradients (ZeRO 1-3)",
    "bf16.bf16_master_weights_and_grads": "16-bit master weights and gradients (ZeRO 1-3)",
    "bf16.bf16_optimizer_states": "bf16 optimizer states",
    "data_types.grad_accum_dtype": "gradient accumulation in a dtype other than the model's",
    "data_types.buffer_dtype": "casting module buffers to a given dtype",
    "data_types.keep_in_fp32_modules": "keeping named modules in fp32 under fp16/bf16",
    "wandb.enabled": "the Weights & Biases monitor",
    "comet.enabled": "the Comet monitor",
    "comms_logger.enabled": "the communication logger",
    "checkpoint.load_universal": "universal checkpoints",
    "checkpoint.parallel_write.pipeline_stage": "pipeline-parallel checkpoint writing",
    "checkpoint.writer": "the fast/decoupled checkpoint writers",
    "optimizer.legacy_fusion": "the legacy fused fp16 optimizer path",
    "sequence_parallel_size": "sequence parallelism",
    "data_parallel_size": "explicit device meshes (with sequence_parallel_size)",
    "seq_parallel_communication_data_type": "sequence parallelism",
    "use_data_before_expert_parallelism": "mixture-of-experts group topology",
    "tensor_parallel": "tensor parallelism",
    "expert_parallel": "expert parallelism",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "data_efficiency": "data efficiency (curriculum sampling, random-LTD)",
    "weight_quantization": "weight quantization",
    "datastates_ckpt": "DataStates asynchronous checkpointing",
    "autotuning.fast": "tuning ZeRO settings beyond the micro-batch size and stage (fast: false)",
    "autotuning.tuner_type": "the random and model-based tuners",
    "autotuning.mp_size": "autotuning with model parallelism",
    "timers": "throughput timers",
    "model_info": "model information for the autotuner",
}

#: Tuning keys of the ZeRO stages that are not implemented yet: planned like the rest (refused
#: at a non-default value), listed apart so that each stage's change can take its own out.
STAGE_TUNING_KEYS: Dict[str, str] = {
    "zero_optimization.load_from_fp32_weights": "ZeRO checkpoints",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "ZeRO-3 parameter fetching",
    "zero_optimization.stage3_allgather_sequential": "ZeRO-3 parameter fetching",
    "zero_optimization.ignore_unused_parameters": "refusing unused parameters (they are always allowed)",
    "zero_optimization.legacy_stage1": "the legacy stage-1 implementation",
    "zero_optimization.parameter_alignment": "aligned ZeRO partitions",
    "zero_optimization.pipeline_loading_checkpoint": "ZeRO-3 pipelined checkpoint loading",
    "zero_optimization.override_module_apply": "ZeRO-3 module.apply override",
    "zero_optimization.log_trace_cache_warnings": "ZeRO-3 trace-cache warnings",
    "zero_optimization.enable_sanity_checks": "ZeRO-3 sanity checks",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon with offload",
}
PLANNED.update(STAGE_TUNING_KEYS)

#: Values that count as disabled besides the default (the default is always accepted).
_ALSO_DISABLED: Dict[str, Tuple[Any, ...]] = {
    "sequence_parallel_size": (1,),
    "zero_optimization.offload_optimizer.device": ("cpu",),  # nvme is the planned part
    "zero_optimization.offload_param.device": ("cpu",),
}

#: Keys shardtrain accepts but does not need, because it never imposes the restriction.
NO_EFFECT: Dict[str, str] = {
    "zero_allow_untested_optimizer": "shardtrain allows any torch optimizer",
    "zero_force_ds_cpu_optimizer":
        "shardtrain's offload steps any torch optimizer on the host copies, so none is refused",
    "zero_optimization.memory_efficient_linear":
        "asks DeepSpeed to swap in a linear that saves its input, not the gathered weight; "
        "shardtrain keeps torch's linear, whose saved weight shares the gathered storage that "
        "stage 3 frees after forward (false, as the Transformers guide sets it, asks for that)",
    "bf16.immediate_grad_update":
        "times the copy of gradients into DeepSpeed's fp32 accumulation buffers; shardtrain "
        "accumulates in the model dtype (data_types.grad_accum_dtype is planned), with no such "
        "copy to move",
    "checkpoint.use_node_local_storage":
        "on one machine every rank sees the same directory; on several machines true is "
        "refused at start-up (put save_dir on storage every node sees)",
    "activation_checkpointing.partition_activations":
        "shards saved inputs across model-parallel ranks; shardtrain has no model parallelism",
    "activation_checkpointing.contiguous_memory_optimization":
        "the caching allocator already reuses checkpoint memory",
    "activation_checkpointing.number_checkpoints": "sizes the contiguous buffer (see above)",
    "activation_checkpointing.profile":
        "regions show as shardtrain.checkpoint ranges in torch.profiler traces",
    "zero_optimization.elastic_checkpoint":
        "shardtrain checkpoints always load on another world size and ZeRO stage",
    "zero_optimization.sub_group_size":
        "sizes the flat fp32 buffers DeepSpeed steps in turn; shardtrain keeps one optimizer tensor "
        "per parameter slice, so no step works on a buffer that size",
    "zero_optimization.round_robin_gradients":
        "spreads the copies of gradients to host memory over ranks; with offload each rank of "
        "shardtrain copies only its own gradient shard already",
    "zero_optimization.contiguous_gradients":
        "gradients are always reduced from contiguous flat buckets",
    "zero_optimization.use_multi_rank_bucket_allreduce":
        "stages 1-2 reduce-scatter (or all-reduce, see reduce_scatter) whole buckets",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "save_16bit_model always gathers full weights at stage 3",
    "zero_optimization.allgather_partitions":
        "updated shards are always all-gathered (a broadcast per rank gives the same result, slower)",
    "pipeline": "read only for a pipeline-parallel model (PipelineModule, planned); DeepSpeed "
                "ignores it for any other model too",
    "aio": "tunes asynchronous NVMe I/O, which only NVMe offload and the fast checkpoint writers "
           "use (both planned)",
    "autotuning.model_info.num_params":
        "shardtrain autotune always runs the profile: it needs the measured activation memory",
    "autotuning.model_info.hidden_size": "informational: the profile measures what the autotuner needs",
    "autotuning.model_info.num_layers": "informational: the profile measures what the autotuner needs",
}

#: Keys DeepSpeed removed: dotted key -> what to use instead. Their presence alone is an error.
REMOVED_KEYS: Dict[str, str] = {
    "nebula": "",
    "compression_training": "",
    "amp": "use fp16, bf16 or torch_autocast instead",
    "quantize_training": "",
    "sparse_gradients": "",
    "eigenvalue": "",
    "sparse_attention": "",
    "elasticity": "set train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps directly",
    "graph_harvesting": "",
    "curriculum_learning": "use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "",
    "zero_optimization.mics_shard_size": "",
    "zero_optimization.mics_hierarchical_params_gather": "",
    "zero_optimization.zeropp_loco_param": "",
}

_STATUS_HONOURED = "honoured"
_STATUS_NO_EFFECT = "accepted (no effect: see notes)"
_STATUS_PLANNED = "planned (refused unless default)"
_STATUS_REMOVED = "removed (refused)"

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# --------------------------------------------------------------------------------------------
# Value types. JSON configs write sizes as 5e8, so an integer field takes an integral float;
# booleans are never numbers and numbers are never booleans (pydantic's lax mode would allow both).
# --------------------------------------------------------------------------------------------


def _int_value(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, not true/false")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError("expected an integer")


def _every_value(value: Any) -> Optional[int]:
    """``steps_per_print``: a positive count, or infinity (as Accelerate writes it) or null
    for never; infinity is stored as null."""
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return None
    return None if value is None else _int_value(value)


def _float_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return float(value)


def _bool_value(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def _str_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


_DTYPES: Dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES: Dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _dtype_value(value: Any) -> Optional[torch.dtype]:
    if value is None or value in _DTYPE_NAMES:
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        name = name[len("torch."):] if name.startswith("torch.") else name
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError("expected a dtype name such as 'fp32', 'fp16', 'bf16' (also 'float32', 'half', "
                     "'bfloat16', 'torch.bfloat16')")


def _dtype_name(value: Optional[torch.dtype]) -> Optional[str]:
    return None if value is None else _DTYPE_NAMES[value]


_Int = Annotated[int, BeforeValidator(_int_value)]
_Float = Annotated[float, BeforeValidator(_float_value)]
_Bool = Annotated[bool, BeforeValidator(_bool_value)]
_Str = Annotated[str, BeforeValidator(_str_value)]
_Dtype = Annotated[Optional[torch.dtype], BeforeValidator(_dtype_value), PlainSerializer(_dtype_name)]
_Block = Dict[str, Any]  # an object whose sub-keys shardtrain does not model (all such blocks are planned)


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _dotted(path: str, key: Union[str, int]) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    """Render a value as the user would write it in JSON."""
    if isinstance(value, torch.dtype):
        return json.dumps(_DTYPE_NAMES.get(value, str(value)))
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# --------------------------------------------------------------------------------------------
# Base model: the key checks every section shares.
# --------------------------------------------------------------------------------------------


class _ConfigModel(BaseModel):
    """Shared strictness: removed keys, unknown keys, "auto" values, deprecated aliases."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)

    #: Dotted path of this section in the config ("" for the root); used in error messages.
    config_path: ClassVar[str] = ""
    #: DeepSpeed drops "auto" values in its pydantic sections (the default applies). Its other
    #: sections keep "auto" as a value, which then fails; shardtrain says so up front.
    drops_auto: ClassVar[bool] = True
    #: Fields for which "auto" is a legitimate value.
    auto_allowed: ClassVar[FrozenSet[str]] = frozenset()
    #: Deprecated input key -> the field it feeds (None: it feeds nothing and only warns).
    deprecated_keys: ClassVar[Dict[str, Optional[str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports the type error with the key path
        data = dict(data)
        cls._reject_removed(data)
        cls._reject_unknown(data)
        data = cls._handle_auto(data)
        cls._reject_double_names(data)
        return cls._translate(data)

    @classmethod
    def _reject_removed(cls, data: Dict[str, Any]) -> None:
        for key in data:
            dotted = _dotted(cls.config_path, key) if isinstance(key, str) else ""
            if dotted in REMOVED_KEYS:
                hint = REMOVED_KEYS[dotted]
                raise ConfigError(
                    f"{dotted} was removed from DeepSpeed and is not supported by shardtrain"
                    f"{'; ' + hint if hint else ''}. Remove the key: its presence alone is an error, "
                    f"whatever its value (got {_show(data[key])}).")

    @classmethod
    def _input_keys(cls) -> Dict[str, str]:
        """Every accepted input key -> the field name it sets."""
        keys: Dict[str, str] = {}
        for name, field in cls.model_fields.items():
            keys[name] = name
            if field.alias:
                keys[field.alias] = name
        for key, target in cls.deprecated_keys.items():
            keys[key] = target or key
        return keys

    @classmethod
    def _reject_unknown(cls, data: Dict[str, Any]) -> None:
        accepted = cls._input_keys()
        problems = []
        for key in data:
            if not isinstance(key, str):
                problems.append(f"{cls.config_path or 'the config'} has a non-string key {key!r}; "
                                "config keys are strings.")
            elif key not in accepted:
                problems.append(_unknown_key_message(_dotted(cls.config_path, key), key, list(accepted)))
        if problems:
            raise ConfigError("\n".join(problems))

    @classmethod
    def _handle_auto(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        autos = [key for key, value in data.items() if _is_auto(value) and key not in cls.auto_allowed]
        if cls.drops_auto:
            for key in autos:
                logger.debug("%s is \"auto\": using its default", _dotted(cls.config_path, key))
                del data[key]
            return data
        if autos:
            raise ConfigError("\n".join(_auto_message(cls, key) for key in autos))
        return data

    @classmethod
    def _reject_double_names(cls, data: Dict[str, Any]) -> None:
        for name, field in cls.model_fields.items():
            if field.alias and field.alias != name and name in data and field.alias in data:
                raise ConfigError(
                    f"{_dotted(cls.config_path, field.alias)} and {_dotted(cls.config_path, name)} are two "
                    f"names for the same setting; give only one (got {_show(data[field.alias])} and "
                    f"{_show(data[name])}).")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """Hook for sections that map deprecated keys onto their replacements."""
        return data


def _unknown_key_message(dotted: str, key: str, candidates: List[str]) -> str:
    message = f"Unknown config key {dotted!r}"
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]!r}?"
    else:
        elsewhere = [row["key"] for row in config_table() if row["key"].rsplit(".", 1)[-1] == key][:3]
        message += f"; {key!r} exists as {', '.join(map(repr, elsewhere))}." if elsewhere else "."
    return message + (" shardtrain rejects keys it does not know instead of ignoring them: "
                      "fix the spelling or remove the key (see docs/config.md).")


def _auto_message(model: type, key: str) -> str:
    field = model.model_fields.get(key)
    kind = _kind_of(field.annotation) if field is not None else "an explicit value"
    return (f"{_dotted(model.config_path, key)} is \"auto\", but shardtrain needs {kind} here. \"auto\" is a "
            "placeholder that Hugging Face's DeepSpeed integration fills in before the engine sees the config; "
            "write the value yourself, or remove the key to use the default.")


def _kind_of(annotation: Any) -> str:
    base = _strip(annotation)
    if base in (int, float):
        return "a number"
    if base is bool:
        return "true or false"
    if base is str:
        return "a string"
    return "an explicit value"


# --------------------------------------------------------------------------------------------
# zero_optimization
# --------------------------------------------------------------------------------------------

_OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_lower)]


class OffloadParamConfig(_ConfigModel):
    """``zero_optimization.offload_param``: where partitioned parameters live (planned)."""

    config_path: ClassVar[str] = "zero_optimization.offload_param"

    device: _OffloadDevice = Field("none", description="none, cpu or nvme")
    nvme_path: Optional[_Str] = Field(None, description="NVMe directory for device nvme")
    buffer_count: _Int = Field(5, ge=0, description="number of parameter swap buffers")
    buffer_size: _Int = Field(100_000_000, ge=0, description="elements per swap buffer")
    max_in_cpu: _Int = Field(1_000_000_000, ge=0, description="parameter elements kept in CPU memory with nvme")
    pin_memory: _Bool = Field(True, description="page-locked CPU buffers")


#: Module classes that are ZeRO-3 leaves unless ``leaf_module.classes`` says otherwise:
#: mixture-of-experts blocks, whose experts differ from rank to rank (DeepSpeed's defaults).
DEFAULT_LEAF_MODULE_CLASSES: Tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def _names_value(value: Any) -> Any:
    """A list of strings; one string counts as a list of one, as in DeepSpeed."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(dict.fromkeys(value))
    raise ConfigError(f"a zero_optimization.leaf_module entry must be a string or a list of strings; "
                      f"got {_show(value)}.")


_Names = Annotated[List[str], BeforeValidator(_names_value)]


class LeafModuleConfig(_ConfigModel):
    """``zero_optimization.leaf_module``: modules that ZeRO-3 gathers whole, children included,
    with one all-gather and hooks on the module alone (see :mod:`shardtrain.zero.leaf`)."""

    config_path: ClassVar[str] = "zero_optimization.leaf_module"

    classes: _Names = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
                            description="class names (`Block` or `package.module.Block`)")
    names: _Names = Field(default_factory=list, description="module names as in `named_modules()`")
    name_suffixes: _Names = Field(default_factory=list, description="ends of module names")


class OffloadOptimizerConfig(_ConfigModel):
    """``zero_optimization.offload_optimizer``: where optimizer states live and step (planned)."""

    config_path: ClassVar[str] = "zero_optimization.offload_optimizer"

    device: _OffloadDevice = Field("none", description="none, cpu or nvme")
    nvme_path: Optional[_Str] = Field(None, description="NVMe directory for device nvme")
    buffer_count: _Int = Field(4, ge=0, description="number of optimizer swap buffers")
    pin_memory: _Bool = Field(True, description="page-locked CPU buffers")
    pipeline_read: _Bool = Field(False, description="overlap reading swapped states with the step")
    pipeline_write: _Bool = Field(False, description="overlap writing swapped states with the step")
    fast_init: _Bool = Field(False, description="fast optimizer initialisation with nvme")
    ratio: _Float = Field(1.0, ge=0.0, le=1.0, description="fraction offloaded; < 1 needs stage 3")
    super_offload: _Bool = Field(False, description="SuperOffload")
    cpuadam_cores_perc: _Float = Field(0.8, ge=0.0, le=1.0, description="share of CPU cores for CPU Adam")


class ZeroConfig(_ConfigModel):
    """``zero_optimization``: ZeRO sharding. Only the stages in IMPLEMENTED_ZERO_STAGES run today.

    Also accepts the legacy form ``"zero_optimization": true`` (stage 1; handled by ShardConfig) and
    the deprecated keys ``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory`` and
    ``stage3_gather_fp16_weights_on_model_save``, which log a warning.
    """

    config_path: ClassVar[str] = "zero_optimization"
    deprecated_keys: ClassVar[Dict[str, Optional[str]]] = {
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
        "cpu_offload_use_pin_memory": None,
        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
    }

    stage: _Int = Field(0, ge=0, le=3, description="0 = off, 1 = optimizer states, 2 = + gradients, 3 = + parameters")
    contiguous_gradients: _Bool = Field(True, description="copy gradients into one contiguous buffer")
    reduce_scatter: _Bool = Field(True, description="reduce-scatter instead of all-reduce for gradients")
    reduce_bucket_size: _Int = Field(500_000_000, gt=0, description="elements reduced at a time")
    use_multi_rank_bucket_allreduce: _Bool = Field(True, description="all-reduce merged buckets of several ranks")
    allgather_partitions: _Bool = Field(True, description="all-gather (not broadcast) updated partitions")
    allgather_bucket_size: _Int = Field(500_000_000, ge=0, description="elements all-gathered at a time")
    overlap_comm: Optional[_Bool] = Field(None,
                                          description="overlap reduction with backward; null = true only for stage 3")
    compute_grad_norm: _Bool = Field(True, description="compute the global grad norm; false only with stage 1/2")
    load_from_fp32_weights: _Bool = Field(True, description="rebuild master weights from fp32 checkpoint copies")
    elastic_checkpoint: _Bool = Field(False, description="legacy elastic checkpoints")
    offload_param: Optional[OffloadParamConfig] = Field(None, description="parameter offload")
    offload_optimizer: Optional[OffloadOptimizerConfig] = Field(None, description="optimizer offload")
    zenflow: Optional[_Block] = Field(None, description="ZenFlow settings")
    sub_group_size: _Int = Field(1_000_000_000, ge=0, description="tile size for parameter processing")
    prefetch_bucket_size: _Int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size",
                                      description="elements prefetched ahead of use (stage 3)")
    param_persistence_threshold: _Int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold",
                                             description="parameters this small are not partitioned (stage 3)")
    model_persistence_threshold: _Int = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold",
                                             description="cap on unpartitioned elements (stage 3)")
    max_live_parameters: _Int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters",
                                     description="resident parameter elements before release (stage 3)")
    max_reuse_distance: _Int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance",
                                    description="keep a parameter reused within this distance (stage 3)")
    gather_16bit_weights_on_model_save: _Bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save",
                                                     description="gather full 16-bit weights when saving (stage 3)")
    module_granularity_threshold: _Int = Field(0, ge=0, alias="stage3_module_granularity_threshold",
                                              description="modules whose parameters per layer are at most this "
                                                          "become leaves; 0 = off (stage 3)")
    use_all_reduce_for_fetch_params: _Bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params",
                                                  description="fetch parameters with all-reduce (stage 3)")
    allgather_sequential: _Bool = Field(False, alias="stage3_allgather_sequential",
                                       description="all-gather parameters one by one (stage 3)")
    ignore_unused_parameters: _Bool = Field(True, description="tolerate parameters without gradients (stage 2)")
    legacy_stage1: _Bool = Field(False, description="old stage-1 implementation")
    round_robin_gradients: _Bool = Field(False, description="round-robin gradient copies with CPU offload")
    parameter_alignment: _Bool = Field(False, description="align parameter partitions")
    zero_hpz_partition_size: _Int = Field(1, ge=0, description="ranks in the secondary weight partition (ZeRO++)")
    zero_quantized_weights: _Bool = Field(False, description="quantized weight all-gather (ZeRO++)")
    zero_quantized_nontrainable_weights: _Bool = Field(False, description="store frozen weights quantized (ZeRO++)")
    zero_quantized_gradients: _Bool = Field(False, description="quantized gradient reduction (ZeRO++)")
    memory_efficient_linear: _Bool = Field(True, description="memory-efficient linear (stage 3)")
    pipeline_loading_checkpoint: _Bool = Field(False, description="load checkpoints in pipeline mode (stage 3)")
    override_module_apply: _Bool = Field(True, description="override nn.Module.apply (stage 3)")
    log_trace_cache_warnings: _Bool = Field(False, description="log trace-cache invalidations (stage 3)")
    enable_sanity_checks: _Bool = Field(False, description="internal consistency checks")
    save_muon_momentum_buffer_in_memory: _Bool = Field(False, description="keep Muon momentum off NVMe")
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig,
                                          description="modules gathered whole, children included (stage 3)")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old in data:
                value = data.pop(old)
                if new in data:
                    raise ConfigError(f"zero_optimization.{old} (deprecated) and zero_optimization.{new} set the "
                                      f"same thing; remove {old}.")
                logger.warning("zero_optimization.%s is deprecated; use zero_optimization.%s", old, new)
                if not isinstance(value, bool):
                    raise ConfigError(f"zero_optimization.{old} must be true or false; got {_show(value)}. "
                                      f"Better, replace it with zero_optimization.{new}.")
                if value:
                    data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            data.pop("cpu_offload_use_pin_memory")
            logger.warning("zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect; set "
                           "pin_memory in offload_param / offload_optimizer")
        old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        if old in data:
            value = data.pop(old)
            if new in data or "gather_16bit_weights_on_model_save" in data:
                raise ConfigError(f"zero_optimization.{old} (deprecated) and zero_optimization.{new} set the same "
                                  f"thing; remove {old}.")
            logger.warning("zero_optimization.%s is deprecated; use zero_optimization.%s", old, new)
            data[new] = value
        return data

    @model_validator(mode="after")
    def _check(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            # DeepSpeed's dynamic default: overlapping only pays off when parameters are partitioned.
            self.overlap_comm = self.stage == 3
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ConfigError(f"zero_optimization.compute_grad_norm false is only allowed with stage 1 or 2 "
                              f"(stage is {self.stage}); remove it.")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ConfigError(f"zero_optimization.offload_optimizer.ratio {self.offload_optimizer.ratio} (partial "
                              f"offload) needs stage 3 (stage is {self.stage}); set it to 1.0.")
        return self


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------


def _loss_scale_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"fp16.loss_scale must be a finite number >= 0 (0 = dynamic loss scaling, > 0 = static "
                          f"scale); got {_show(value)}.")
    return float(value)


class FP16Config(_ConfigModel):
    """``fp16``: fp16 model with fp32 master weights and loss scaling."""

    config_path: ClassVar[str] = "fp16"

    enabled: _Bool = Field(False, description="train in fp16")
    auto_cast: _Bool = Field(False, description="cast floating-point forward inputs to fp16")
    loss_scale: Annotated[float, BeforeValidator(_loss_scale_value)] = Field(
        0.0, description="0 = dynamic scaling; > 0 = static scale")
    initial_scale_power: _Int = Field(16, description="dynamic scaling starts at 2**initial_scale_power")
    loss_scale_window: _Int = Field(1000, description="clean steps before the scale doubles")
    hysteresis: _Int = Field(2, description="overflows tolerated before the scale halves")
    consecutive_hysteresis: _Bool = Field(False, description="refill hysteresis on every clean step")
    min_loss_scale: _Float = Field(1.0, description="lower bound of the dynamic scale")
    fp16_master_weights_and_grads: _Bool = Field(False, description="fp16 master weights and grads (ZeRO 1-3)")

    @model_validator(mode="after")
    def _check(self) -> "FP16Config":
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ConfigError(f"fp16.{key} must be > 0 with dynamic loss scaling (fp16.loss_scale 0); "
                                      f"got {_show(getattr(self, key))}.")
        return self


class BF16Config(_ConfigModel):
    """``bf16`` (older alias ``bfloat16``): bf16 model with fp32 master weights."""

    config_path: ClassVar[str] = "bf16"

    enabled: _Bool = Field(False, description="train in bf16")
    immediate_grad_update: _Bool = Field(False, description="fold gradients into fp32 as soon as they are produced")
    check_grad_overflow: _Bool = Field(True, description="skip the step when a gradient is inf/NaN")
    bf16_master_weights_and_grads: _Bool = Field(False, description="bf16 master weights and grads (ZeRO 1-3)")
    bf16_optimizer_states: _Bool = Field(False, description="bf16 optimizer states")

    @model_validator(mode="after")
    def _check(self) -> "BF16Config":
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ConfigError("bf16.bf16_optimizer_states true needs bf16.bf16_master_weights_and_grads true.")
        return self


def _default_safe_modules() -> List[str]:
    classes = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in classes]


def _safe_modules_value(value: Any) -> Any:
    if value is None:
        return _default_safe_modules()
    if not isinstance(value, list):
        raise ConfigError(f"torch_autocast.lower_precision_safe_modules must be a list of 'package.Class' strings; "
                          f"got {_show(value)}.")
    for index, entry in enumerate(value):
        if not isinstance(entry, str) or "." not in entry:
            raise ConfigError(f"torch_autocast.lower_precision_safe_modules[{index}] must be a 'package.Class' "
                              f"string such as 'torch.nn.Linear'; got {_show(entry)}.")
    return value


class TorchAutocastConfig(_ConfigModel):
    """``torch_autocast``: fp32 model, forward under ``torch.autocast``."""

    config_path: ClassVar[str] = "torch_autocast"

    enabled: _Bool = Field(False, description="run forward under torch.autocast")
    dtype: _Dtype = Field(None, description="autocast dtype; null = torch's device default (bf16 on CPU, fp16 on CUDA)")
    lower_precision_safe_modules: Annotated[List[str], BeforeValidator(_safe_modules_value)] = Field(
        default_factory=_default_safe_modules, description="module classes whose outputs may stay in low precision")


def _keep_in_fp32_value(value: Any) -> Any:
    if value == "auto" or (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        return value
    raise ConfigError(f"data_types.keep_in_fp32_modules must be \"auto\" or a list of name patterns; "
                      f"got {_show(value)}.")


class DataTypesConfig(_ConfigModel):
    """``data_types``: dtypes that differ from the precision mode's."""

    config_path: ClassVar[str] = "data_types"
    drops_auto: ClassVar[bool] = False
    auto_allowed: ClassVar[FrozenSet[str]] = frozenset({"keep_in_fp32_modules"})

    grad_accum_dtype: _Dtype = Field(None, description="gradient accumulation dtype; null = the model's")
    param_dtype: _Dtype = Field(None, description="if set, must match the fp16/bf16 mode")
    buffer_dtype: _Dtype = Field(None, description="cast buffers to this dtype; null = keep")
    keep_in_fp32_modules: Annotated[Union[str, List[str]], BeforeValidator(_keep_in_fp32_value)] = Field(
        "auto", description="modules kept in fp32 under fp16/bf16")


# --------------------------------------------------------------------------------------------
# Optimizer and scheduler
# --------------------------------------------------------------------------------------------


def _reject_auto_params(section: str, params: Any) -> None:
    if isinstance(params, Mapping):
        for key, value in params.items():
            if _is_auto(value):
                raise ConfigError(
                    f"{section}.params.{key} is \"auto\", but shardtrain needs a value here. \"auto\" is a placeholder "
                    "that Hugging Face's DeepSpeed integration fills in; write the value yourself, or remove the key "
                    "to use the default.")


class OptimizerConfig(_ConfigModel):
    """``optimizer``: the optimizer built from the config; ``params`` become its keyword arguments."""

    config_path: ClassVar[str] = "optimizer"
    drops_auto: ClassVar[bool] = False

    type: _Str = Field(description="optimizer name, e.g. AdamW (see the optimizer docs)")
    params: Dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the optimizer")
    legacy_fusion: _Bool = Field(False, description="legacy fused fp16 optimizer path")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if data.get("params", {}) is None:
            del data["params"]
        _reject_auto_params("optimizer", data.get("params"))
        return data

    @model_validator(mode="after")
    def _check(self) -> "OptimizerConfig":
        clip = self.params.get("max_grad_norm")
        if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
            raise ConfigError(f"optimizer.params.max_grad_norm {_show(clip)}: gradient clipping is not an optimizer "
                              f"parameter; remove it and set the top-level gradient_clipping to {_show(clip)} instead.")
        return self


class SchedulerConfig(_ConfigModel):
    """``scheduler``: the learning-rate scheduler; ``params`` become its keyword arguments."""

    config_path: ClassVar[str] = "scheduler"
    drops_auto: ClassVar[bool] = False

    type: _Str = Field(description="scheduler name, e.g. WarmupLR (see the scheduler docs)")
    params: Dict[str, Any] = Field(description="keyword arguments of the scheduler ({} = its defaults)")

    @classmethod
    def _translate(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        if data.get("params") is None:
            raise ConfigError("scheduler.params is missing: give the scheduler's keyword arguments, or {} to take "
                              "its defaults.")
        _reject_auto_params("scheduler", data["params"])
        return data


# --------------------------------------------------------------------------------------------
# Activation checkpointing, profiling, monitors
# --------------------------------------------------------------------------------------------


class ActivationCheckpointingConfig(_ConfigModel):
    """``activation_checkpointing``: how ``shardtrain.checkpointing.checkpoint`` behaves."""

    config_path: ClassVar[str] = "activation_checkpointing"
    drops_auto: ClassVar[bool] = False

    partition_activations: _Bool = Field(False, description="shard checkpointed activations across ranks")
    contiguous_memory_optimization: _Bool = Field(False, description="copy checkpoints into one buffer")
    cpu_checkpointing: _Bool = Field(False, description="keep checkpoints in CPU memory")
    number_checkpoints: Optional[_Int] = Field(None, description="number of checkpoints for the contiguous buffer")
    synchronize_checkpoint_boundary: _Bool = Field(False, description="synchronize at checkpoint boundaries")
    profile: _Bool = Field(False, description="time checkpointed forward/backward")


class FlopsProfilerConfig(_ConfigModel):
    """``flops_profiler``: FLOPs, parameters and latency per module at one step (see docs/monitoring.md)."""

    config_path: ClassVar[str] = "flops_profiler"
    drops_auto: ClassVar[bool] = False

    enabled: _Bool = Field(False, description="profile one step")
    recompute_fwd_factor: _Float = Field(0.0, description="extra forward passes from recomputation")
    profile_step: _Int = Field(1, ge=0, description="global step to profile (0 = the first)")
    module_depth: _Int = Field(-1, ge=-1, description="module depth shown; -1 = all")
    top_modules: _Int = Field(1, ge=0, description="number of top modules shown per depth")
    detailed: _Bool = Field(True, description="per-module breakdown")
    output_file: Optional[_Str] = Field(None, description="file for the profile; null = stdout")


class CompileConfig(_ConfigModel):
    """``compile``: ``torch.compile`` of the module once ``engine.compile()`` is called."""

    config_path: ClassVar[str] = "compile"

    enabled: _Bool = Field(False, description="compile the module (call engine.compile())")
    backend: _Str = Field("inductor", description="torch.compile backend")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description="other torch.compile arguments")


class TensorBoardConfig(_ConfigModel):
    """``tensorboard`` monitor: TensorBoard events under ``output_path/job_name`` (rank 0)."""

    config_path: ClassVar[str] = "tensorboard"

    enabled: _Bool = Field(False, description="write TensorBoard events")
    output_path: _Str = Field("", description="directory for the events (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class CSVMonitorConfig(_ConfigModel):
    """``csv_monitor``: one CSV file per metric under ``output_path/job_name`` (rank 0)."""

    config_path: ClassVar[str] = "csv_monitor"

    enabled: _Bool = Field(False, description="write CSV files")
    output_path: _Str = Field("", description="directory for the files (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class JSONLMonitorConfig(_ConfigModel):
    """``jsonl_monitor`` (shardtrain's own; DeepSpeed ignores the key): one JSON object per step
    in ``output_path/job_name/metrics.jsonl`` (rank 0); ``shardtrain plot`` reads it."""

    config_path: ClassVar[str] = "jsonl_monitor"

    enabled: _Bool = Field(False, description="write metrics.jsonl (shardtrain only)")
    output_path: _Str = Field("", description="directory for the file (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class WandbConfig(_ConfigModel):
    """``wandb`` monitor (planned)."""

    config_path: ClassVar[str] = "wandb"

    enabled: _Bool = Field(False, description="log to Weights & Biases")
    group: Optional[_Str] = Field(None, description="run group")
    team: Optional[_Str] = Field(None, description="team")
    project: _Str = Field("deepspeed", description="project")


class CometConfig(_ConfigModel):
    """``comet`` monitor (planned)."""

    config_path: ClassVar[str] = "comet"

    enabled: _Bool = Field(False, description="log to Comet")
    samples_log_interval: _Int = Field(100, description="samples between submissions")
    project: Optional[_Str] = Field(None, description="project")
    workspace: Optional[_Str] = Field(None, description="workspace")
    api_key: Optional[_Str] = Field(None, description="API key")
    experiment_name: Optional[_Str] = Field(None, description="experiment name")
    experiment_key: Optional[_Str] = Field(None, description="existing experiment key")
    online: Optional[_Bool] = Field(None, description="log to the server (else offline)")
    mode: Optional[_Str] = Field(None, description="get, create or get_or_create")


class CommsLoggerConfig(_ConfigModel):
    """``comms_logger`` (planned)."""

    config_path: ClassVar[str] = "comms_logger"

    enabled: _Bool = Field(False, description="log collective calls")
    verbose: _Bool = Field(False, description="log every call")
    prof_all: _Bool = Field(True, description="profile every operation")
    debug: _Bool = Field(False, description="include the caller")
    prof_ops: List[_Str] = Field(default_factory=list, description="operations to profile when prof_all is false")


# --------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------


class AutotuningModelInfoConfig(_ConfigModel):
    """``autotuning.model_info``: ``profile: true`` makes the run a model-info profile."""

    config_path: ClassVar[str] = "autotuning.model_info"
    drops_auto: ClassVar[bool] = False

    profile: _Bool = Field(False, description="measure parameters and activation memory, write "
                                              "model_info_path (rank 0), then exit")
    num_params: Optional[_Int] = Field(None, ge=0, description="parameter count, if known")
    hidden_size: Optional[_Int] = Field(None, ge=0, description="hidden size, if known")
    num_layers: Optional[_Int] = Field(None, ge=0, description="number of layers, if known")


class AutotuningConfig(_ConfigModel):
    """``autotuning``: what ``shardtrain autotune`` reads, and the trial and profile runs it
    starts (see docs/monitoring.md). With ``enabled`` the run is a trial: it measures steps
    ``start_profile_step``..``end_profile_step``, writes ``metric_path`` (rank 0) and exits."""

    config_path: ClassVar[str] = "autotuning"
    drops_auto: ClassVar[bool] = False

    enabled: _Bool = Field(False, description="this run is an autotuning trial: measure, write metric_path, exit")
    fast: _Bool = Field(True, description="tune only the micro-batch size per ZeRO stage")
    results_dir: _Str = Field("autotuning_results", description="where shardtrain autotune writes its results")
    exps_dir: _Str = Field("autotuning_exps", description="where shardtrain autotune writes trial configs and logs")
    overwrite: _Bool = Field(True, description="false: reuse the result of a trial that already ran")
    start_profile_step: _Int = Field(3, ge=0, description="first step of a trial's measurement")
    end_profile_step: _Int = Field(5, gt=0, description="last step of a trial's measurement; the trial exits after it")
    metric_path: Optional[_Str] = Field(None, description="JSON file a trial writes its metrics to")
    metric: Annotated[Literal["throughput", "latency", "flops"], BeforeValidator(_lower)] = Field(
        "throughput", description="what shardtrain autotune optimises")
    tuner_type: Annotated[Literal["gridsearch", "random", "model_based"], BeforeValidator(_lower)] = Field(
        "gridsearch", description="search strategy")
    tuner_early_stopping: _Int = Field(5, gt=0, description="stop after this many trials without improvement")
    tuner_num_trials: _Int = Field(50, gt=0, description="at most this many trials")
    arg_mappings: Optional[Dict[str, _Str]] = Field(
        None, description="config key -> script argument that also receives the trial's value")
    model_info: Optional[AutotuningModelInfoConfig] = Field(None, description="model-info profile settings")
    model_info_path: Optional[_Str] = Field(
        None, description="JSON file of the model-info profile; null = results_dir/profile_model_info/model_info.json")
    mp_size: _Int = Field(1, gt=0, description="model-parallel size")
    max_train_batch_size: Optional[_Int] = Field(None, gt=0, description="largest global batch tried")
    min_train_batch_size: _Int = Field(1, gt=0, description="smallest global batch tried")
    max_train_micro_batch_size_per_gpu: _Int = Field(1024, gt=0, description="largest micro-batch tried")
    min_train_micro_batch_size_per_gpu: _Int = Field(1, gt=0, description="smallest micro-batch tried")
    num_tuning_micro_batch_sizes: _Int = Field(3, gt=0, description="trials per ZeRO stage")

    @model_validator(mode="after")
    def _check(self) -> "AutotuningConfig":
        if self.start_profile_step >= self.end_profile_step:
            raise ConfigError(f"autotuning.start_profile_step ({self.start_profile_step}) must be below "
                              f"autotuning.end_profile_step ({self.end_profile_step}).")
        low, high = self.min_train_micro_batch_size_per_gpu, self.max_train_micro_batch_size_per_gpu
        if low > high:
            raise ConfigError(f"autotuning.min_train_micro_batch_size_per_gpu ({low}) is above "
                              f"autotuning.max_train_micro_batch_size_per_gpu ({high}).")
        return self

    @property
    def profiles_model_info(self) -> bool:
        """True when this run is a model-info profile."""
        return self.model_info is not None and self.model_info.profile

    def resolved_model_info_path(self) -> str:
        """Where the model-info profile is written."""
        return self.model_info_path or os.path.join(self.results_dir, "profile_model_info", "model_info.json")


# --------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------


def _tag_validation_value(value: Any) -> str:
    if isinstance(value, str) and value.upper() in ("WARN", "IGNORE", "FAIL"):
        return value.capitalize()
    raise ConfigError(f"checkpoint.tag_validation must be one of Warn, Ignore, Fail (any case); got {_show(value)}.")


class CheckpointParallelWriteConfig(_ConfigModel):
    """``checkpoint.parallel_write``."""

    config_path: ClassVar[str] = "checkpoint.parallel_write"
    drops_auto: ClassVar[bool] = False

    pipeline_stage: _Bool = Field(False, description="each pipeline stage writes its own layers")


class CheckpointWriterConfig(_ConfigModel):
    """``checkpoint.writer`` (planned)."""

    config_path: ClassVar[str] = "checkpoint.writer"
    drops_auto: ClassVar[bool] = False

    type: Annotated[Literal["FAST", "PYTHON", "MOCK"], BeforeValidator(_upper)] = Field(
        "FAST", description="FAST, PYTHON or MOCK (any case)")
    io_buffer_size: _Int = Field(64 * 1024**2, gt=0, description="bytes per I/O buffer")
    io_buffer_double: _Bool = Field(True, description="double-buffered I/O")
    io_multiplier: _Int = Field(1, gt=0, description="I/O parallelism multiplier")
    show_statistics: _Bool = Field(False, description="print write statistics")
    data_parallel: Annotated[Optional[Literal["REPLICA", "SOCKET", "MACHINE"]], BeforeValidator(_upper)] = Field(
        None, description="replica, socket or machine (any case)")
    decoupled: _Bool = Field(False, description="write in a background process")


class CheckpointConfig(_ConfigModel):
    """``checkpoint``: checkpoint saving and loading."""

    config_path: ClassVar[str] = "checkpoint"
    drops_auto: ClassVar[bool] = False

    tag_validation: Annotated[str, BeforeValidator(_tag_validation_value)] = Field(
        "Warn", description="tags differing across ranks: Warn, Ignore or Fail (any case)")
    load_universal: _Bool = Field(False, description="load a universal checkpoint")
    use_node_local_storage: _Bool = Field(False, description="every node saves to local storage")
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig,
                                                          description="parallel writing")
    checkpoint_serialization: _Bool = Field(True, description="torch.save's zipfile serialization")
    writer: Optional[CheckpointWriterConfig] = Field(None, description="alternative checkpoint writer")


# --------------------------------------------------------------------------------------------
# Root
# --------------------------------------------------------------------------------------------

_PRECISION_CHOICE = ("bf16/fp16 keep the model in 16-bit with fp32 master weights; torch_autocast keeps the model "
                     "in fp32 and runs forward under torch.autocast")


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
    prescale_gradients: _Bool = Field(False, description="divide by the world size before the all-reduce")
    gradient_predivide_factor: _Float = Field(1.0, gt=0.0,
                                              description="share of the averaging done before the all-reduce")
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = Field(
        "mean", description="mean or sum (any case)")
    communication_data_type: Annotated[Optional[Literal["fp32", "fp16", "bf16"]], BeforeValidator(_lower)] = Field(
        None, description="gradient communication dtype; null = the precision mode's")
    seq_parallel_communication_data_type: Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_lower)] = Field(
        "fp32", description="sequence-parallel gradient communication dtype")
    zero_allow_untested_optimizer: _Bool = Field(False, description="allow optimizers outside DeepSpeed's ZeRO list")
    zero_force_ds_cpu_optimizer: _Bool = Field(True, description="with ZeRO-Offload, require a DeepSpeed CPU optimizer")
    dataloader_drop_last: _Bool = Field(False, description="drop the last incomplete batch of the built dataloader")
    disable_allgather: _Bool = Field(False, description="niche flag")
    dump_state: _Bool = Field(False, description="print the engine state at start-up")
    disable_python_gc: _Bool = Field(False, description="niche flag")
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
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="communication logger")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile")
    timers: _Block = Field(default_factory=dict, description="throughput timers")
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig, description="autotuner")
    pipeline: _Block = Field(default_factory=dict, description="pipeline parallelism")
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
        world_size = (info.context or {}).get("world_size")
        if world_size is None:
            raise TypeError("ShardConfig needs the data-parallel world size: build it with "
                            "load_config(config, world_size) or model_validate(data, context={'world_size': n}).")
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
            _resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                           self.gradient_accumulation_steps, world_size))
        _check_combinations(self)
        _check_planned(self)
        if self.vocabulary_size is not None and self.vocabulary_size % 8:
            logger.warning("vocabulary_size %d is not a multiple of 8; padding it helps tensor-core kernels",
                           self.vocabulary_size)
        return self

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

    def comm_dtype(self) -> torch.dtype:
        """The dtype gradients are communicated in: ``communication_data_type``, else the precision mode's."""
        if self.communication_data_type is not None:
            return _DTYPES[self.communication_data_type]
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32


# --------------------------------------------------------------------------------------------
# Batch triple (DeepSpeed's rules, floor divisions, checks in DeepSpeed's order)
# --------------------------------------------------------------------------------------------


def _resolve_batch(tb: Optional[int], mb: Optional[int], gas: Optional[int], ws: int) -> Tuple[int, int, int]:
    """Derive the missing batch keys and check TB == MB * GAS * ws.

    The first matching rule applies: all three given; TB and MB; TB and GAS; MB and GAS; only TB;
    only MB. ``how`` records each derivation so an error can show where a number came from.
    """
    how: Dict[str, str] = {}
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = (tb // mb) // ws
        how["gas"] = f"train_batch_size {tb} // train_micro_batch_size_per_gpu {mb} // world_size {ws}"
    elif tb is not None and gas is not None:
        mb = (tb // ws) // gas
        how["mb"] = f"train_batch_size {tb} // world_size {ws} // gradient_accumulation_steps {gas}"
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
        how["tb"] = f"train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {gas} * world_size {ws}"
    elif tb is not None:
        gas, mb = 1, tb // ws
        how["mb"] = f"train_batch_size {tb} // world_size {ws}"
    elif mb is not None:
        tb, gas = mb * ws, 1
        how["tb"] = f"train_micro_batch_size_per_gpu {mb} * world_size {ws}"
    else:
        given = " (gradient_accumulation_steps alone is not enough)" if gas is not None else ""
        raise ConfigError(
            f"Neither train_batch_size nor train_micro_batch_size_per_gpu is set{given}. Give "
            "train_micro_batch_size_per_gpu (samples per forward/backward on one rank), train_batch_size (samples "
            "per optimizer step over all ranks), or both; gradient_accumulation_steps is derived when missing.")

    for name, short, value in (("train_batch_size", "tb", tb), ("train_micro_batch_size_per_gpu", "mb", mb),
                               ("gradient_accumulation_steps", "gas", gas)):
        if value <= 0:
            origin = f" (derived as {how[short]}, floor division)" if short in how else ""
            advice = _batch_advice(short, tb, mb, gas, ws)
            raise ConfigError(f"{name} {value}{origin} has to be greater than 0. {advice}")

    if tb != mb * gas * ws:
        origin = "".join(f"; {key} derived as {text}" for key, text in
                         (("gradient_accumulation_steps", how.get("gas")),
                          ("train_micro_batch_size_per_gpu", how.get("mb"))) if text)
        raise ConfigError(
            f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {gas} "
            f"* world_size {ws} (= {mb * gas * ws}){origin}. {_consistent_advice(tb, mb, gas, ws, how)}")
    return tb, mb, gas


def _batch_advice(short: str, tb: int, mb: int, gas: int, ws: int) -> str:
    if short == "mb" and tb > 0 and gas > 0:
        return (f"Make train_batch_size at least world_size * gradient_accumulation_steps = {ws * gas}, or set "
                "train_micro_batch_size_per_gpu.")
    if short == "gas" and tb > 0 and mb > 0:
        return f"Make train_batch_size at least train_micro_batch_size_per_gpu * world_size = {mb * ws}."
    return "Set every batch key to a positive integer."


def _consistent_advice(tb: int, mb: int, gas: int, ws: int, how: Dict[str, str]) -> str:
    if "gas" in how:
        unit, what = mb * ws, f"train_micro_batch_size_per_gpu * world_size = {mb * ws}"
    elif "mb" in how:
        unit, what = gas * ws, f"gradient_accumulation_steps * world_size = {gas * ws}"
    else:
        return (f"Set train_batch_size to {mb * gas * ws}, or give only two of the three keys and let "
                "shardtrain derive the third.")
    lower = (tb // unit) * unit
    options = " or ".join(str(value) for value in (lower, lower + unit) if value > 0)
    return f"train_batch_size must be a multiple of {what}: use {options}."


# --------------------------------------------------------------------------------------------
# Cross-section checks and the planned-feature gate
# --------------------------------------------------------------------------------------------


def _check_combinations(cfg: ShardConfig) -> None:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one 16-bit mode.")
    if cfg.torch_autocast.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        mode = "fp16" if cfg.fp16.enabled else "bf16"
        raise ConfigError(f"torch_autocast.enabled and {mode}.enabled are both true; choose one: {_PRECISION_CHOICE}.")
    if cfg.gradient_allreduce_op == "sum":
        users = [name for name, active in (
            ("zero_optimization.stage 3", cfg.zero_optimization.stage == 3),
            ("zero_optimization.zenflow", cfg.zero_optimization.zenflow is not None),
            ) if active]
        if users:
            raise ConfigError(f"gradient_allreduce_op \"sum\" cannot be used with {users[0]}; set "
                              "gradient_allreduce_op to \"mean\" (the default).")
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None:
        mode = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
        if param_dtype != mode:
            raise ConfigError(f"data_types.param_dtype {_show(param_dtype)} does not match the precision mode "
                              f"({_show(mode)}); remove it or make it {_show(mode)}.")


def situational_notes(cfg: ShardConfig, nodes: int) -> List[str]:
    """Keys that are valid but change nothing in this configuration, as DeepSpeed accepts
    them: one warning line each, saying why. Raises ConfigError for the combinations that
    cannot work here (node-local checkpoints across machines)."""
    zero, notes = cfg.zero_optimization, []
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append("zero_optimization.offload_optimizer has no effect at ZeRO stage 0: there are no "
                     "sharded optimizer states to move to host memory (DeepSpeed ignores it too); set "
                     "zero_optimization.stage to 1, 2 or 3 to offload them.")
    if zero.offload_param is not None and zero.offload_param.device != "none" and zero.stage != 3:
        notes.append(f"zero_optimization.offload_param has no effect at ZeRO stage {zero.stage}: "
                     "parameters are partitioned only at stage 3 (DeepSpeed ignores it too); use "
                     "offload_optimizer at stages 1-2, or stage 3.")
    if cfg.checkpoint.use_node_local_storage:
        if nodes > 1:
            raise ConfigError(f"checkpoint.use_node_local_storage is true and the job spans {nodes} "
                              "machines: shardtrain writes one checkpoint directory that every rank "
                              "reads on load; put save_dir on storage every node sees and set it to "
                              "false.")
        notes.append("checkpoint.use_node_local_storage has no effect on one machine: every rank "
                     "writes to the same directory.")
    return notes


def _check_planned(cfg: ShardConfig) -> None:
    problems = []
    for key, feature in PLANNED.items():
        found, value = _value_at(cfg, key)
        if not found:
            continue
        if key == "zero_optimization.stage":
            if value not in IMPLEMENTED_ZERO_STAGES:
                allowed = " or ".join(str(stage) for stage in sorted(IMPLEMENTED_ZERO_STAGES))
                problems.append(f"{key} {value} is not implemented yet in shardtrain (planned); remove it or set it "
                                f"to {allowed}. Feature: {feature}.")
            continue
        default = _default_at(key)
        disabled = value == default or value in _ALSO_DISABLED.get(key, ()) or _block_disabled(key, value)
        if not disabled:
            problems.append(f"{key} is not implemented yet in shardtrain (planned); remove it or set it to "
                            f"{_show(default)}. Got {_show(value)}{_PLANNED_HINTS.get(key, '')}; feature: {feature}.")
    if problems:
        raise ConfigError("\n".join(problems))


def _block_disabled(key: str, value: Any) -> bool:
    """Whether a planned object block asks for nothing, so that DeepSpeed would not run the feature
    either: ``{}``, ``"enabled": false`` whatever settings come with it (``hybrid_engine``,
    ``data_efficiency``, ...), only disabled sub-blocks (``timers.throughput``), or a tensor-parallel
    size of at most 1."""
    if not isinstance(value, dict):
        return False
    if not value or value.get("enabled") is False:
        return True
    if key == "tensor_parallel":
        sizes = (value.get("autotp_size", 0), (value.get("tp") or {}).get("tp_size", 1))
        return all(isinstance(size, int) and not isinstance(size, bool) and size <= 1 for size in sizes)
    if "enabled" not in value and all(isinstance(sub, dict) for sub in value.values()):
        return all(_block_disabled("", sub) for sub in value.values())
    return False


_PLANNED_HINTS: Dict[str, str] = {
    "zero_optimization.offload_optimizer.device": " (the deprecated zero_optimization.cpu_offload true also sets it)",
    "zero_optimization.offload_param.device": " (the deprecated zero_optimization.cpu_offload_param true also sets it)",
}


def _value_at(cfg: BaseModel, dotted: str) -> Tuple[bool, Any]:
    """Follow a dotted key through the models; (False, None) when a parent block is absent."""
    node: Any = cfg
    for key in dotted.split("."):
        if node is None:
            return False, None
        node = getattr(node, _field_name(type(node), key))
    return True, node


def _default_at(dotted: str) -> Any:
    model: Any = ShardConfig
    *parents, last = dotted.split(".")
    for key in parents:
        model = _submodel(model.model_fields[_field_name(model, key)].annotation)
    field = model.model_fields[_field_name(model, last)]
    return field.get_default(call_default_factory=True)


def _field_name(model: type, key: str) -> str:
    return model._input_keys()[key]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]", ShardConfig], world_size: int) -> ShardConfig:
    """Load, validate and resolve a training config.

    Args:
        config: one of
            - a dict (used as is; it is not modified),
            - a path (``str`` or ``Path``) to a JSON file; repeated keys are an error,
            - a url-safe base64 string of JSON (as DeepSpeed's launcher passes configs),
            - a :class:`ShardConfig`, which is re-resolved from its ``raw`` input.
        world_size: the data-parallel world size used for the batch arithmetic.

    Returns:
        The validated :class:`ShardConfig`, with the batch triple resolved.

    Raises:
        ConfigError: for any mistake in the config; the message names the key and says what to do.
        TypeError: when ``config`` is none of the accepted forms.

    Example:
        >>> load_config({"train_batch_size": 32}, world_size=2).train_micro_batch_size_per_gpu
        16
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    raw = _read(config)
    try:
        return ShardConfig.model_validate(raw, context={"world_size": world_size})
    except ValidationError as error:
        raise _config_error(error) from None


def _read(config: Any) -> Dict[str, Any]:
    if isinstance(config, ShardConfig):
        return config.raw
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, os.PathLike):
        return _read_file(Path(config))
    if isinstance(config, str):
        if os.path.isfile(config):
            return _read_file(Path(config))
        decoded = _decode_base64(config)
        if decoded is not None:
            return decoded
        raise ConfigError(f"Config file not found: {config!r} (looked for {os.path.abspath(config)!r}). A string "
                          "config must be the path of an existing JSON file or url-safe base64-encoded JSON.")
    raise TypeError(f"config must be a dict, a path (str or Path) to a JSON file, or a url-safe base64 string of JSON; "
                    f"got {type(config).__name__}.")


def _read_file(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"Config file not found: {str(path)!r} (looked for {str(path.absolute())!r}).")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Cannot read config file {str(path)!r}: {error}") from None
    try:
        data = _parse_json(text)
    except json.JSONDecodeError as error:
        data = _parse_hjson(text, path, error)
    except ConfigError as error:
        raise ConfigError(f"Config file {str(path)!r}: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a JSON object; got {type(data).__name__}.")
    return data


def _decode_base64(text: str) -> Optional[Dict[str, Any]]:
    """The JSON object encoded in ``text``, or None when ``text`` is not base64 JSON at all."""
    try:
        payload = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        data = _parse_json(payload.decode("utf-8"))
    except ConfigError:
        raise  # valid base64 JSON with a mistake in it (duplicate keys)
    except (binascii.Error, ValueError):
        return None  # not base64, not UTF-8 or not JSON
    return data if isinstance(data, dict) else None


def _parse_hjson(text: str, path: Path, json_error: json.JSONDecodeError) -> Any:
    """DeepSpeed reads config files as hjson: comments, trailing commas, unquoted keys."""
    import hjson  # a dependency; imported only for files that are not plain JSON

    try:
        return _parse_json(text, loads=hjson.loads)
    except ConfigError as error:
        raise ConfigError(f"Config file {str(path)!r}: {error}") from None
    except hjson.HjsonDecodeError as error:
        raise ConfigError(f"Config file {str(path)!r} is neither JSON nor hjson: as JSON, "
                          f"{json_error.msg} at line {json_error.lineno}, column {json_error.colno}; "
                          f"as hjson, {error.msg} at line {error.lineno}, column {error.colno}.") from None


def _parse_json(text: str, loads=json.loads) -> Any:
    duplicates: List[str] = []

    def pairs_to_dict(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
        result: Dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                duplicates.append(key)
            result[key] = value
        return result

    data = loads(text, object_pairs_hook=pairs_to_dict)
    if duplicates:
        raise ConfigError(f"Duplicate keys in the config: {sorted(set(duplicates))}. JSON keeps only the last one; "
                          "remove the others.")
    return data


# --------------------------------------------------------------------------------------------
# pydantic errors -> ConfigError
# --------------------------------------------------------------------------------------------


def _config_error(error: ValidationError) -> ConfigError:
    messages: List[str] = []
    for item in error.errors():
        cause = (item.get("ctx") or {}).get("error")
        message = str(cause) if isinstance(cause, ConfigError) else _describe(item)
        if message not in messages:
            messages.append(message)
    if len(messages) == 1:
        return ConfigError(messages[0])
    return ConfigError(f"{len(messages)} problems in the config:\n" + "\n".join(f"- {m}" for m in messages))


def _describe(item: Dict[str, Any]) -> str:
    path = ""
    for part in item["loc"]:
        path = _dotted(path, part)
    kind, text = item["type"], item["msg"]
    if kind == "missing":
        return f"{path} is required; add it to the config."
    if kind == "extra_forbidden":
        return f"Unknown config key {path!r}; fix the spelling or remove it (see docs/config.md)."
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path} must be a JSON object ({{...}}); got {_show(item['input'])}."
    if text.startswith("Value error, "):
        text = text[len("Value error, "):]
    elif kind == "literal_error":
        text = "expected " + text[len("Input should be "):]
    else:
        text = text[0].lower() + text[1:]
    default = _default_for_loc(item["loc"])
    hint = f" Fix the value, or remove the key to use the default ({default})." if default else " Fix the value."
    return f"{path}: {text}; got {_show(item['input'])}.{hint}"


def _default_for_loc(loc: Tuple[Any, ...]) -> Optional[str]:
    model: Any = ShardConfig
    field = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model._input_keys():
            return None
        field = model.model_fields[model._input_keys()[part]]
        model = _submodel(field.annotation)
    if field is None or field.is_required():
        return None
    return _show(_jsonable_default(field))


# --------------------------------------------------------------------------------------------
# The key table (docs/config.md is generated from it)
# --------------------------------------------------------------------------------------------


def _strip(annotation: Any) -> Any:
    """The base type of an annotation, without Annotated/Optional wrappers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is Union and type(None) in typing.get_args(annotation):
            rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            annotation = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return annotation


def _submodel(annotation: Any) -> Optional[type]:
    base = _strip(annotation)
    return base if isinstance(base, type) and issubclass(base, _ConfigModel) else None


def _type_name(annotation: Any) -> str:
    nullable = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin is Union and type(None) in typing.get_args(annotation):
            nullable = True
            annotation = _strip(annotation)
        else:
            break
    origin = typing.get_origin(annotation)
    if annotation is torch.dtype:
        name = "dtype string"
    elif origin is Literal:
        name = " | ".join(json.dumps(arg) for arg in typing.get_args(annotation))
    elif origin is Union:
        name = "\"auto\" | list[str]"
    elif origin in (list, List):
        name = f"list[{_type_name(typing.get_args(annotation)[0])}]"
    elif origin in (dict, Dict) or _submodel(annotation) is not None:
        name = "object"
    else:
        name = getattr(annotation, "__name__", str(annotation))
    return f"{name} | null" if nullable else name


def _jsonable_default(field: Any) -> Any:
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return {}
    if isinstance(default, torch.dtype):
        return _DTYPE_NAMES[default]
    return default


def _status(dotted: str) -> str:
    if dotted in REMOVED_KEYS:
        return _STATUS_REMOVED
    if dotted in PLANNED:
        return _STATUS_PLANNED
    if dotted in NO_EFFECT:
        return _STATUS_NO_EFFECT
    return _STATUS_HONOURED


def config_table() -> List[Dict[str, str]]:
    """One row per accepted (or explicitly refused) config key, in config order.

    Each row has ``key`` (dotted), ``default`` (as JSON; DeepSpeed 0.19.8's), ``type``, ``status``
    (honoured / accepted with no effect / planned / removed) and ``notes``. ``docs/config.md`` is
    generated from it (``_table_markdown()``) and a test keeps the two in step.
    """
    rows: List[Dict[str, str]] = []
    _table_rows(ShardConfig, "", rows)
    for key, hint in REMOVED_KEYS.items():
        rows.append({"key": key, "default": "", "type": "any", "status": _STATUS_REMOVED,
                     "notes": hint or "removed from DeepSpeed; no replacement"})
    return rows


def _table_rows(model: Any, prefix: str, rows: List[Dict[str, str]]) -> None:
    for name, field in model.model_fields.items():
        key = field.alias or name
        dotted = _dotted(prefix, key)
        if dotted in _BATCH_KEYS:
            default = "null (derived)"
        elif field.is_required():
            default = "required"
        else:
            default = json.dumps(_jsonable_default(field))
        notes = PLANNED.get(dotted) or NO_EFFECT.get(dotted) or field.description or ""
        row = {"key": dotted, "default": default, "type": _type_name(field.annotation),
               "status": _status(dotted), "notes": notes}
        rows.append({**row, **_SPECIAL_ROWS.get(dotted, {})})
        if field.alias and field.alias != name:
            rows.append({"key": _dotted(prefix, name), "default": default, "type": _type_name(field.annotation),
                         "status": _status(dotted), "notes": f"same as `{dotted}`"})
        sub = _submodel(field.annotation)
        if sub is not None:
            _table_rows(sub, dotted, rows)
    for key, target in model.deprecated_keys.items():
        dotted = _dotted(prefix, key)
        replacement = f"`{_dotted(prefix, model.model_fields[target].alias or target)}`" if target else "nothing"
        row = {"key": dotted, "default": "", "type": "as replacement" if target else "bool",
               "status": _STATUS_HONOURED, "notes": f"deprecated: feeds {replacement}; logs a warning"}
        rows.append({**row, **_SPECIAL_ROWS.get(dotted, {})})


_SPECIAL_ROWS: Dict[str, Dict[str, str]] = {
    "zero_optimization": {"type": "object | bool", "notes": "ZeRO; the legacy `true`/`false` means stage 1/0"},
    "checkpoint.tag_validation": {"type": '"Warn" | "Ignore" | "Fail"'},
    "allgather_size": {"type": "int", "default": "500000000",
                       "notes": "read only with the legacy `\"zero_optimization\": true` form (stage 1)"},
    "bfloat16": {"type": "object", "notes": "older name of `bf16`, read only when `bf16` is absent"},
}


def _table_markdown() -> str:
    lines = ["| key | default | type | status | notes |", "|---|---|---|---|---|"]
    for row in config_table():
        cells = [f"`{row['key']}`", f"`{row['default']}`" if row["default"] else "",
                 row["type"].replace("|", "\\|"), row["status"], row["notes"].replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
