"""DeepSpeed's constants in the alias tree, in one process: every module-level constant of
DeepSpeed 0.19.8 that the alias carries exists with DeepSpeed's value and type, is exported by
``import *``, pickles, and builds configs that shardtrain validates and trains with.

The tables below are DeepSpeed 0.19.8's values, recorded from its modules (DeepSpeed is not
installed where these tests run): the module-level constants of ``deepspeed/runtime/config.py``
(besides the ``deepspeed/runtime/constants.py`` names it re-exports), ``runtime/constants.py``
(without its ``*_FORMAT`` help texts), ``runtime/lr_schedules.py``, ``checkpoint/constants.py``,
``runtime/zero/config.py``, and the members of the ZeRO and offload enums.
"""
from __future__ import annotations

import enum
import importlib
import inspect
import pickle
from typing import Any, Dict

import pytest
import torch

import shardtrain
import shardtrain.deepspeed as deepspeed
from shardtrain.deepspeed._constants import constant_names
from shardtrain.deepspeed.runtime import config as C
from shardtrain.deepspeed.runtime import lr_schedules as L
from shardtrain.deepspeed.runtime.zero.config import ZeroStageEnum
from shardtrain.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

# -- DeepSpeed 0.19.8's values ---------------------------------------------------------------------

RUNTIME_CONFIG = {
    "TENSOR_CORE_ALIGN_SIZE": 8, "EXPERT_PARALLEL": "expert_parallel",
    "ADAGRAD_OPTIMIZER": "adagrad", "ADAM_OPTIMIZER": "adam", "ADAMW_OPTIMIZER": "adamw",
    "LAMB_OPTIMIZER": "lamb", "MUADAM_OPTIMIZER": "muadam", "MUADAMW_OPTIMIZER": "muadamw",
    "MUSGD_OPTIMIZER": "musgd", "LION_OPTIMIZER": "lion", "MUON_OPTIMIZER": "muon",
    "DEEPSPEED_OPTIMIZERS": ["adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"],
    "TORCH_ADAM_PARAM": "torch_adam", "ADAM_W_MODE": "adam_w_mode", "ADAM_W_MODE_DEFAULT": True,
}

RUNTIME_CONSTANTS = {
    "ROUTE_TRAIN": "train", "ROUTE_EVAL": "eval", "ROUTE_PREDICT": "predict",
    "ROUTE_ENCODE": "encode", "TRAIN_BATCH_SIZE": "train_batch_size",
    "TRAIN_BATCH_SIZE_DEFAULT": None, "OPTIMIZER": "optimizer", "OPTIMIZER_TYPE_DEFAULT": None,
    "OPTIMIZER_PARAMS": "params", "TYPE": "type", "LEGACY_FUSION": "legacy_fusion",
    "LEGACY_FUSION_DEFAULT": False, "SCHEDULER": "scheduler", "SCHEDULER_TYPE_DEFAULT": None,
    "SCHEDULER_PARAMS": "params", "MAX_GRAD_NORM": "max_grad_norm",
    "ZERO_ALLOW_UNTESTED_OPTIMIZER": "zero_allow_untested_optimizer",
    "ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT": False,
    "ZERO_FORCE_DS_CPU_OPTIMIZER": "zero_force_ds_cpu_optimizer",
    "ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT": True, "STEPS_PER_PRINT": "steps_per_print",
    "STEPS_PER_PRINT_DEFAULT": None,
    "TRAIN_MICRO_BATCH_SIZE_PER_GPU": "train_micro_batch_size_per_gpu",
    "TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT": None,
    "GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "GRADIENT_ACCUMULATION_STEPS_DEFAULT": None,
    "MANAGED_GRADIENT_ACCUMULATION": "managed_gradient_accumulation",
    "MANAGED_GRADIENT_ACCUMULATION_DEFAULT": True, "BFLOAT16": "bf16", "BFLOAT16_OLD": "bfloat16",
    "BFLOAT16_ENABLED": "enabled", "BFLOAT16_ENABLED_DEFAULT": False,
    "CHECK_OVERFLOW": "check_overflow", "BFLOAT16_CHECK_OVERFLOW_DEFAULT": False,
    "BFLOAT16_IMMEDIATE_GRAD_UPDATE": "immediate_grad_update",
    "BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT": True,
    "BFLOAT16_MASTER_WEIGHTS_AND_GRADS": "bf16_master_weights_and_grads",
    "BFLOAT16_MASTER_WEIGHTS_AND_GRADS_DEFAULT": False,
    "BFLOAT16_OPTIMIZER_STATES": "bf16_optimizer_states",
    "BFLOAT16_OPTIMIZER_STATES_DEFAULT": False, "DDP_BFLOAT16": "ddp_bf16", "FP16": "fp16",
    "FP16_ENABLED": "enabled", "FP16_ENABLED_DEFAULT": False, "FP16_LOSS_SCALE": "loss_scale",
    "FP16_LOSS_SCALE_DEFAULT": 0, "FP16_AUTO_CAST": "auto_cast", "FP16_AUTO_CAST_DEFAULT": False,
    "FP16_INITIAL_SCALE_POWER": "initial_scale_power", "FP16_INITIAL_SCALE_POWER_DEFAULT": 16,
    "FP16_LOSS_SCALE_WINDOW": "loss_scale_window", "FP16_LOSS_SCALE_WINDOW_DEFAULT": 1000,
    "FP16_HYSTERESIS": "hysteresis", "FP16_HYSTERESIS_DEFAULT": 2,
    "FP16_CONSECUTIVE_HYSTERESIS": "consecutive_hysteresis",
    "FP16_CONSECUTIVE_HYSTERESIS_DEFAULT": False, "FP16_MIN_LOSS_SCALE": "min_loss_scale",
    "FP16_MIN_LOSS_SCALE_DEFAULT": 1,
    "FP16_MASTER_WEIGHTS_AND_GRADS": "fp16_master_weights_and_grads",
    "FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT": False, "TORCH_AUTOCAST": "torch_autocast",
    "TORCH_AUTOCAST_ENABLED": "enabled", "TORCH_AUTOCAST_ENABLED_DEFAULT": False,
    "TORCH_AUTOCAST_DTYPE": "dtype",
    "TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES": "lower_precision_safe_modules",
    "GRADIENT_CLIPPING": "gradient_clipping", "GRADIENT_CLIPPING_DEFAULT": 1.0,
    "COMMUNICATION_DATA_TYPE": "communication_data_type", "COMMUNICATION_DATA_TYPE_DEFAULT": None,
    "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE": "seq_parallel_communication_data_type",
    "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT": "fp32",
    "PRESCALE_GRADIENTS": "prescale_gradients", "PRESCALE_GRADIENTS_DEFAULT": False,
    "GRADIENT_PREDIVIDE_FACTOR": "gradient_predivide_factor",
    "GRADIENT_PREDIVIDE_FACTOR_DEFAULT": 1.0, "GRADIENT_ALLREDUCE_OP": "gradient_allreduce_op",
    "GRADIENT_ALLREDUCE_OP_MEAN": "mean", "GRADIENT_ALLREDUCE_OP_SUM": "sum",
    "GRADIENT_ALLREDUCE_OP_DEFAULT": "mean", "GRADIENT_ALLREDUCE_OP_SUPPORTED": ("mean", "sum"),
    "DISABLE_ALLGATHER": "disable_allgather", "DISABLE_ALLGATHER_DEFAULT": False,
    "DUMP_STATE": "dump_state", "DUMP_STATE_DEFAULT": False,
    "DISABLE_PYTHON_GC": "disable_python_gc", "DISABLE_PYTHON_GC_DEFAULT": False,
    "VOCABULARY_SIZE": "vocabulary_size", "VOCABULARY_SIZE_DEFAULT": None,
    "WALL_CLOCK_BREAKDOWN": "wall_clock_breakdown", "WALL_CLOCK_BREAKDOWN_DEFAULT": False,
    "MEMORY_BREAKDOWN": "memory_breakdown", "MEMORY_BREAKDOWN_DEFAULT": False,
    "CHECKPOINT": "checkpoint", "CHECKPOINT_TAG_VALIDATION": "tag_validation",
    "CHECKPOINT_TAG_VALIDATION_DEFAULT": "WARN",
    "CHECKPOINT_TAG_VALIDATION_MODES": ["WARN", "IGNORE", "FAIL"],
    "LOAD_UNIVERSAL_CHECKPOINT": "load_universal", "LOAD_UNIVERSAL_CHECKPOINT_DEFAULT": False,
    "USE_NODE_LOCAL_STORAGE_CHECKPOINT": "use_node_local_storage",
    "USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT": False,
    "CHECKPOINT_PARALLEL_WRITE": "parallel_write",
    "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE": "pipeline_stage",
    "CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT": False, "DATA_TYPES": "data_types",
    "GRAD_ACCUM_DTYPE": "grad_accum_dtype", "GRAD_ACCUM_DTYPE_DEFAULT": None,
    "PARAM_DTYPE": "param_dtype", "PARAM_DTYPE_DEFAULT": None, "BUFFER_DTYPE": "buffer_dtype",
    "BUFFER_DTYPE_DEFAULT": None, "KEEP_IN_FP32_MODULES": "keep_in_fp32_modules",
    "KEEP_IN_FP32_MODULES_DEFAULT": "auto", "DATALOADER_DROP_LAST": "dataloader_drop_last",
    "DATALOADER_DROP_LAST_DEFAULT": False, "PIPE_REPLICATED": "ds_pipe_replicated",
    "DATA_PARALLEL_GROUP": "data_parallel_group", "GLOBAL_RANK": "global_rank",
    "USE_DATA_BEFORE_EXPERT_PARALLEL": "use_data_before_expert_parallelism",
    "USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT": False, "LOG_LEVEL": "log_level",
    "LOG_LEVEL_DEFAULT": None,
}

LR_SCHEDULES = {
    "LR_SCHEDULE": "lr_schedule", "LR_RANGE_TEST": "LRRangeTest", "ONE_CYCLE": "OneCycle",
    "WARMUP_LR": "WarmupLR", "WARMUP_DECAY_LR": "WarmupDecayLR",
    "WARMUP_COSINE_LR": "WarmupCosineLR",
    "VALID_LR_SCHEDULES": ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"],
    "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr",
    "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate",
    "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
    "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase", "EDGE_VALUE": "edge_value",
    "MID_VALUE": "mid_value", "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
    "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count",
    "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
    "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count", "DECAY_STEP_SIZE": "decay_step_size",
    "CYCLE_MIN_LR": "cycle_min_lr", "CYCLE_MAX_LR": "cycle_max_lr",
    "DECAY_LR_RATE": "decay_lr_rate", "CYCLE_MIN_MOM": "cycle_min_mom",
    "CYCLE_MAX_MOM": "cycle_max_mom", "DECAY_MOM_RATE": "decay_mom_rate",
    "WARMUP_MIN_LR": "warmup_min_lr", "WARMUP_MAX_LR": "warmup_max_lr",
    "WARMUP_NUM_STEPS": "warmup_num_steps", "WARMUP_TYPE": "warmup_type", "WARMUP_LOG_RATE": "log",
    "WARMUP_LINEAR_RATE": "linear", "WARMUP_MIN_RATIO": "warmup_min_ratio",
    "COS_MIN_RATIO": "cos_min_ratio", "TOTAL_NUM_STEPS": "total_num_steps",
}

CHECKPOINT_CONSTANTS = {
    "OPTIMIZER_STATE_DICT": "optimizer_state_dict", "FP32_GROUPS": "fp32_groups",
    "FP32_FLAT_GROUPS": "fp32_flat_groups", "BASE_OPTIMIZER_STATE": "base_optimizer_state",
    "BASE_OPTIMIZER_STATE_STEP": "base_optimizer_state_step",
    "SINGLE_PARTITION_OF_FP32_GROUPS": "single_partition_of_fp32_groups",
    "PARAM_GROUPS": "param_groups", "GROUP_PADDINGS": "group_paddings",
    "PARAM_ALIGNMENT_PADDINGS": "param_alignment_paddings", "PARTITION_COUNT": "partition_count",
    "ZERO_STAGE": "zero_stage", "CLIP_GRAD": "clip_grad", "FP32_WEIGHT_KEY": "fp32",
    "LOSS_SCALER": "loss_scaler", "PARAM": "param", "PARAM_SHAPES": "param_shapes",
    "BUFFER_NAMES": "buffer_names", "FROZEN_PARAM_SHAPES": "frozen_param_shapes",
    "FROZEN_PARAM_FRAGMENTS": "frozen_param_fragments", "MODEL_FILE_PREFIX": "mp_rank_",
    "ZERO_FILE_PREFIX": "zero_pp_rank_", "OPTIM_FILE_SUFFIX": "_optim_states.pt",
    "MODEL_FILE_SUFFIX": "_model_states.pt", "LAYER_FILE_PREFIX": "layer_",
    "BF16_ZERO_FILE_PREFIX": "bf16_zero_pp_rank_", "FP16_ZERO_FILE_PREFIX": "fp16_zero_pp_rank_",
    "CHECKPOINT_PARALLEL_DIMS": "checkpoint_parallel_dimensions",
    "CHECKPOINT_PP_DEGREE": "pp_degree", "CHECKPOINT_TP_DEGREE": "tp_degree",
    "DS_VERSION": "ds_version", "UNIVERSAL_CHECKPOINT_INFO": "universal_checkpoint_info",
    "UNIVERSAL_CHECKPOINT_VERSION_KEY": "universal_checkpoint_version",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE": 0.4,
    "DS_AUTOTP_UC_META": "ds_autotp_universal_checkpoint_meta",
    "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS": "autotp_unsupported_parameter_patterns",
    "AFFINE_MAP": "affine_map", "AFFINE_MAP_VERSION": "version", "AFFINE_MAP_PARAMS": "params",
    "VOCAB_TENSOR": "vocab_tensor", "PADDED_VOCAB_SIZE": "padded_vocab_size",
    "ORIGINAL_VOCAB_SIZE": "original_vocab_size", "PARAM_SLICE_MAPPINGS": "param_slice_mappings",
    "CAT_DIM": "cat_dim", "PARAM_N_SUB_PARAMS": "param_n_sub_params",
    "SUB_PARAM_SHAPE": "sub_param_shape",
    "VOCABULARY_PARAMETER_PATTERNS": "vocabulary_parameter_patterns",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS": "pipeline_replicated_parameter_patterns",
    "PARAMETER_TO_AVERAGE_PATTERNS": "parameter_to_average_patterns",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS": "parameter_with_row_parallelism_patterns",
    "TP_REPLICATED_PARAMETER_PATTERNS": "tp_replicated_parameter_patterns",
    "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0": "parameter_with_2_sub_params_cat_dim_0",
    "PARAMETER_WITH_SUB_PARAMS": "parameter_with_sub_params",
    "SUB_PARAM_SHARD_WIDTHS": "sub_param_shard_widths", "SUB_PARAMS_SHAPE": "sub_params_shape",
    "AUTOEP_LAYERS_KEY": "ds_autoep_layers", "AUTOEP_LAYERS_KEY_LEGACY": "autoep_layers",
    "AUTOEP_EXPERT_KEY_PREFIX": "expert_key_prefix", "AUTOEP_NUM_EXPERTS": "num_experts",
    "AUTOEP_NUM_LOCAL_EXPERTS": "num_local_experts", "AUTOEP_EP_SIZE": "ep_size",
    "AUTOEP_EXPERT_PLACEMENT": "expert_placement", "AUTOEP_AFFINE_MAPS": "affine_maps",
    "DS_AUTOEP_UC_META": "ds_autoep_uc_meta", "AUTOEP_PARAM_LOGICAL_SHAPE": "logical_shape",
    "AUTOEP_PARAM_EP_RANK": "ep_rank", "AUTOEP_PARAM_LOCAL_EXPERTS": "local_experts",
    "AUTOEP_ZERO12_REQUIRED_FIELDS": ("expert_key_prefix", "num_experts", "num_local_experts", "ep_size"),
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY": "checkpoint_format",
    "AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT": "zero3_partitioned",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY": "checkpoint_format_version",
    "AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION": 1, "AUTOEP_PLACEMENT_VERSION_KEY": "version",
    "AUTOEP_PLACEMENT_VERSION": 1, "AUTOEP_PLACEMENT_NUM_EXPERTS": "num_experts",
    "AUTOEP_PLACEMENT_EP_SIZE": "ep_size", "AUTOEP_PLACEMENT_RANKS": "ranks",
    "AUTOEP_PLACEMENT_RANK": "rank", "AUTOEP_PLACEMENT_EXPERTS": "experts",
    "EP_IS_EXPERT_PARAM": "is_expert_param", "EP_NUM_EXPERTS": "ep_num_experts",
    "EXPERT_PARAMETER_PATTERNS": "expert_parameter_patterns", "FOLDING_METADATA_KEY": "folding",
    "FOLDING_METADATA_VERSION": 1, "FOLDING_TP_SIZE": "tp_size", "FOLDING_TP_RANK": "tp_rank",
    "FOLDING_EP_SIZE": "ep_size", "FOLDING_EP_RANK": "ep_rank", "FOLDING_ETP_SIZE": "etp_size",
    "FOLDING_ETP_RANK": "etp_rank", "FOLDING_ZERO_PARTITION_GROUP": "zero_partition_group",
    "FOLDING_ZERO_PARTITION_RANK": "zero_partition_rank",
    "FOLDING_ZERO_PARTITION_COUNT": "zero_partition_count",
    "FOLDING_DISPATCH_STRATEGY": "dispatch_strategy",
    "FOLDING_SHARED_EXPERT_PLACEMENT": "shared_expert_placement", "FOLDING_FAMILY": "family",
    "FOLDING_PARAM_FAMILIES": "param_families",
}

ZERO_CONFIG = {
    "ZERO_OPTIMIZATION": "zero_optimization",
}

ZERO_STAGE_ENUM = {
    "disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3,
}

OFFLOAD_DEVICE_ENUM = {
    "none": "none", "cpu": "cpu", "nvme": "nvme",
}

OFFLOAD_STATE_TYPE_ENUM = {
    "optim_states": "optim_states", "hp_params": "hp_params", "lp_params": "lp_params",
    "lp_grads": "lp_grads", "contiguous_grad_buffer": "contiguous_grad_buffer",
}


#: alias module (under shardtrain.deepspeed) -> every constant it must define, exactly
MODULES: Dict[str, Dict[str, Any]] = {
    "runtime.config": {**RUNTIME_CONSTANTS, **RUNTIME_CONFIG},
    "runtime.constants": RUNTIME_CONSTANTS,
    "runtime.lr_schedules": LR_SCHEDULES,
    "checkpoint.constants": CHECKPOINT_CONSTANTS,
    "runtime.zero.config": ZERO_CONFIG,
}
ENUMS = [(ZeroStageEnum, int, ZERO_STAGE_ENUM), (OffloadDeviceEnum, str, OFFLOAD_DEVICE_ENUM),
         (OffloadStateTypeEnum, str, OFFLOAD_STATE_TYPE_ENUM)]


def _typed(values: Dict[str, Any]) -> Dict[str, Any]:
    """Each value with its type: 1 and 1.0 and True, or a list and a tuple, are not the same
    constant to a config (``"gradient_clipping": 1`` is an int)."""
    return {name: (type(value).__name__, value) for name, value in values.items()}


@pytest.mark.parametrize("path", sorted(MODULES))
def test_every_constant_has_deepspeeds_value(path):
    module = importlib.import_module(f"shardtrain.deepspeed.{path}")
    want = MODULES[path]
    ours = {name: getattr(module, name) for name in constant_names(vars(module))}
    missing = sorted(set(want) - set(ours))
    extra = sorted(set(ours) - set(want))
    wrong = {name: (ours[name], want[name]) for name in set(want) & set(ours)
             if _typed({name: ours[name]}) != _typed({name: want[name]})}
    assert not missing, f"deepspeed.{path} lacks DeepSpeed's {missing}"
    assert not extra, f"deepspeed.{path} defines {extra}, which DeepSpeed 0.19.8 does not"
    assert not wrong, f"deepspeed.{path}: (ours, DeepSpeed's) differ for {wrong}"


@pytest.mark.parametrize("path", sorted(MODULES))
def test_import_star_gives_every_constant(path):
    namespace: Dict[str, Any] = {}
    exec(f"from shardtrain.deepspeed.{path} import *", namespace)
    assert set(MODULES[path]) <= set(namespace), sorted(set(MODULES[path]) - set(namespace))


@pytest.mark.parametrize("cls, base, members", ENUMS, ids=lambda x: getattr(x, "__name__", ""))
def test_enums_have_deepspeeds_members(cls, base, members):
    assert issubclass(cls, (base, enum.Enum)) and isinstance(cls(next(iter(members.values()))), base)
    assert {name: m.value for name, m in cls.__members__.items()} == members
    assert all(pickle.loads(pickle.dumps(m)) is m for m in cls)


def test_constants_pickle_as_themselves():
    for path, values in MODULES.items():
        module = importlib.import_module(f"shardtrain.deepspeed.{path}")
        ours = {name: getattr(module, name) for name in values}
        assert _typed(pickle.loads(pickle.dumps(ours))) == _typed(values), path


def test_schedules_take_every_parameter_deepspeed_names():
    """Each parameter name of lr_schedules is a keyword of the schedule that reads it, so a
    ``scheduler.params`` block spelled with the constants is one shardtrain's classes accept."""
    accepted = set()
    for name in L.VALID_LR_SCHEDULES:
        accepted |= set(inspect.signature(getattr(L, name)).parameters)
    not_keys = {"LR_SCHEDULE", "EDGE_VALUE", "MID_VALUE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE"}
    keys = {LR_SCHEDULES[n] for n in LR_SCHEDULES if n not in not_keys
            and isinstance(LR_SCHEDULES[n], str) and LR_SCHEDULES[n] not in L.VALID_LR_SCHEDULES}
    assert keys - accepted == set()


# -- configs built from the constants ---------------------------------------------------------------

def _train(config: Dict[str, Any], steps: int = 12):
    """A one-process engine from ``config`` (as pickled and restored, so the config a launcher
    hands over is the one that trains), and the learning rate after each step."""
    torch.manual_seed(0)
    config = pickle.loads(pickle.dumps(config))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=torch.nn.Linear(2, 1), config=config)
    lrs, moms = [], []
    for _ in range(steps):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        lrs.append(engine.get_lr()[0])
        moms.append(engine.get_mom()[0])
    return optimizer, scheduler, lrs, moms


def _config(scheduler=None, optimizer_type=C.ADAM_OPTIMIZER, **params):
    config = {C.TRAIN_MICRO_BATCH_SIZE_PER_GPU: 1, C.GRADIENT_CLIPPING: C.GRADIENT_CLIPPING_DEFAULT,
              C.OPTIMIZER: {C.TYPE: optimizer_type, C.OPTIMIZER_PARAMS: {"lr": 0.1, **params}}}
    return {**config, C.SCHEDULER: scheduler} if scheduler else config


def test_a_warmup_block_of_constants_trains_as_written():
    _, scheduler, lrs, _ = _train(_config({C.TYPE: L.WARMUP_LR, C.SCHEDULER_PARAMS: {
        L.WARMUP_MIN_LR: 0.0, L.WARMUP_MAX_LR: 0.01, L.WARMUP_NUM_STEPS: 4,
        L.WARMUP_TYPE: L.WARMUP_LINEAR_RATE}}))
    assert type(scheduler).__name__ == L.WARMUP_LR
    assert lrs[:5] == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01]) and lrs[-1] == pytest.approx(0.01)


def test_decay_cosine_one_cycle_and_range_test_blocks_of_constants():
    _, _, decay, _ = _train(_config({C.TYPE: L.WARMUP_DECAY_LR, C.SCHEDULER_PARAMS: {
        L.WARMUP_MAX_LR: 0.01, L.WARMUP_NUM_STEPS: 4, L.TOTAL_NUM_STEPS: 10,
        L.WARMUP_TYPE: L.WARMUP_LINEAR_RATE}}))
    assert max(decay) == pytest.approx(0.01) and decay[-1] == 0.0
    _, _, cosine, _ = _train(_config({C.TYPE: L.WARMUP_COSINE_LR, C.SCHEDULER_PARAMS: {
        L.WARMUP_MIN_RATIO: 0.0, L.WARMUP_NUM_STEPS: 4, L.TOTAL_NUM_STEPS: 10,
        L.COS_MIN_RATIO: 0.1, L.WARMUP_TYPE: L.WARMUP_LOG_RATE}}))
    assert max(cosine) == pytest.approx(0.1) and cosine[-1] == pytest.approx(0.1 * 0.1)
    _, _, cycle, moms = _train(_config({C.TYPE: L.ONE_CYCLE, C.SCHEDULER_PARAMS: {
        L.CYCLE_MIN_LR: 0.001, L.CYCLE_MAX_LR: 0.01, L.CYCLE_FIRST_STEP_SIZE: 4,
        L.CYCLE_SECOND_STEP_SIZE: 4, L.CYCLE_FIRST_STAIR_COUNT: 0, L.CYCLE_SECOND_STAIR_COUNT: 0,
        L.DECAY_STEP_SIZE: 2, L.DECAY_LR_RATE: 0.5, L.CYCLE_MIN_MOM: 0.8, L.CYCLE_MAX_MOM: 0.9,
        L.DECAY_MOM_RATE: 0.0}}))
    assert max(cycle) == pytest.approx(0.01) and min(cycle) < 0.001
    assert min(m[0] for m in moms) == pytest.approx(0.8)
    _, _, stairs, _ = _train(_config({C.TYPE: L.LR_RANGE_TEST, C.SCHEDULER_PARAMS: {
        L.LR_RANGE_TEST_MIN_LR: 0.001, L.LR_RANGE_TEST_STEP_SIZE: 2, L.LR_RANGE_TEST_STEP_RATE: 1.0,
        L.LR_RANGE_TEST_STAIRCASE: True}}))
    assert stairs[:4] == pytest.approx([0.001, 0.002, 0.002, 0.003])


def test_optimizer_types_of_constants():
    """The types shardtrain builds, built; the others refused by name."""
    assert type(_train(_config(), 1)[0]) is torch.optim.AdamW  # "adam": decoupled decay, as DeepSpeed's
    assert type(_train(_config(optimizer_type=C.ADAMW_OPTIMIZER), 1)[0]) is torch.optim.AdamW
    assert type(_train(_config(optimizer_type=C.ADAGRAD_OPTIMIZER), 1)[0]) is torch.optim.Adagrad
    plain = _train(_config(**{C.ADAM_W_MODE: not C.ADAM_W_MODE_DEFAULT, C.TORCH_ADAM_PARAM: True}), 1)[0]
    assert type(plain) is torch.optim.Adam
    assert type(_train(_config(optimizer_type=C.MUON_OPTIMIZER), 1)[0]).__name__ == "MuonWithAuxAdam"
    built = {C.ADAM_OPTIMIZER, C.ADAMW_OPTIMIZER, C.ADAGRAD_OPTIMIZER, C.MUON_OPTIMIZER}
    for name in set(C.DEEPSPEED_OPTIMIZERS) - built:
        with pytest.raises(NotImplementedError, match=f"Optimizer '{name}' is not available"):
            _train(_config(optimizer_type=name), 1)


def test_a_config_of_runtime_constants_and_enums_validates():
    config = {
        C.TRAIN_BATCH_SIZE: 4, C.GRADIENT_ACCUMULATION_STEPS: 2,
        C.BFLOAT16: {C.BFLOAT16_ENABLED: True,
                     C.BFLOAT16_IMMEDIATE_GRAD_UPDATE: C.BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT},
        C.GRADIENT_ALLREDUCE_OP: C.GRADIENT_ALLREDUCE_OP_SUM,
        C.CHECKPOINT: {C.CHECKPOINT_TAG_VALIDATION: C.ValidationMode.FAIL,
                       C.LOAD_UNIVERSAL_CHECKPOINT: C.LOAD_UNIVERSAL_CHECKPOINT_DEFAULT},
        C.DATA_TYPES: {C.GRAD_ACCUM_DTYPE: "fp32"},
        C.DATALOADER_DROP_LAST: C.DATALOADER_DROP_LAST_DEFAULT,
        "zero_optimization": {"stage": ZeroStageEnum.gradients,
                              "offload_optimizer": {"device": OffloadDeviceEnum.cpu}},
    }
    loaded = shardtrain.load_config(pickle.loads(pickle.dumps(config)), 2)
    assert loaded.train_micro_batch_size_per_gpu == 1
    assert loaded.zero_optimization.stage == ZeroStageEnum.gradients == 2
    assert loaded.zero_optimization.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert deepspeed.DeepSpeedConfig(config)[C.GRADIENT_ALLREDUCE_OP] == "sum"
