"""``zero_optimization``: how model states are sharded across ranks, as typed blocks.

Besides its own keys, the block reads DeepSpeed's deprecated spellings (``cpu_offload``,
``cpu_offload_param``, ``cpu_offload_use_pin_memory``,
``stage3_gather_fp16_weights_on_model_save``) and maps them onto their replacements with a
warning, so that an old config keeps training as it did under DeepSpeed. The ``stage3_*`` keys
are aliases of shorter field names, as in DeepSpeed's own model.
"""

import logging
import sys
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple

from pydantic import BeforeValidator, Field, model_validator
from typing_extensions import Annotated

from ._model import ConfigError, _ConfigModel
from ._values import _Block, _Bool, _Float, _Int, _lower, _show, _Str

# One logger for the whole package, named as users filter it: "shardtrain.config".
logger = logging.getLogger(__package__)

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
]

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
    ignore_unused_parameters: _Bool = Field(
        True, description="false: a step in which a trainable parameter got no gradient on any rank raises, "
                          "naming it (any stage)")
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
                _translate_cpu_offload(data, old, new)
        if "cpu_offload_use_pin_memory" in data:
            data.pop("cpu_offload_use_pin_memory")
            logger.warning("zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect; set "
                           "pin_memory in offload_param / offload_optimizer")
        _translate_gather_fp16(data)
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


def _translate_cpu_offload(data: Dict[str, Any], old: str, new: str) -> None:
    """``cpu_offload``/``cpu_offload_param`` true -> ``{"device": "cpu"}`` in the block it names."""
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


def _translate_gather_fp16(data: Dict[str, Any]) -> None:
    """The fp16 spelling of ``stage3_gather_16bit_weights_on_model_save`` feeds the 16-bit one."""
    old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
    if old not in data:
        return
    value = data.pop(old)
    if new in data or "gather_16bit_weights_on_model_save" in data:
        raise ConfigError(f"zero_optimization.{old} (deprecated) and zero_optimization.{new} set the same "
                          f"thing; remove {old}.")
    logger.warning("zero_optimization.%s is deprecated; use zero_optimization.%s", old, new)
    data[new] = value
