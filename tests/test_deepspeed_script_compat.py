"""docs/deepspeed_compat.md: what a DeepSpeed script and config get from shardtrain, kept honest.

The doc's tables are generated here, so they cannot drift from the code:

* every config key of DeepSpeed 0.19.8 (as /work/shared/DEEPSPEED_FACTS.md lists them) with
  its status from ``shardtrain.config.config_table()``; a key the table does not have must be
  listed in ``NOT_IN_TABLE`` with its reason, and ``load_config`` must refuse it;
* every DeepSpeed function, class, engine method and attribute a script is likely to use,
  with its status; the test imports shardtrain and checks with ``hasattr`` (on a real
  one-process engine for the engine rows) that each name marked as present exists and each
  name marked as missing does not.

Regenerate the doc after a change: ``python tests/test_deepspeed_script_compat.py --write``.
"""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Tuple

import pytest
import torch

import shardtrain
import shardtrain.deepspeed  # the tree `import deepspeed` gives with the alias
from shardtrain.config import ConfigError, config_table, load_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "deepspeed_compat.md"

# -- config keys ------------------------------------------------------------------------------

# Every key DEEPSPEED_FACTS.md names (sections 1, 1a-1d), removed ones included.
_TOP = """train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps
managed_gradient_accumulation steps_per_print wall_clock_breakdown memory_breakdown
gradient_clipping prescale_gradients gradient_predivide_factor gradient_allreduce_op
communication_data_type seq_parallel_communication_data_type zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer dataloader_drop_last disable_allgather dump_state disable_python_gc
vocabulary_size log_level use_data_before_expert_parallelism sequence_parallel_size
data_parallel_size allgather_size zero_optimization fp16 bf16 bfloat16 torch_autocast optimizer
scheduler activation_checkpointing flops_profiler tensorboard csv_monitor wandb comet
comms_logger checkpoint data_types aio autotuning pipeline data_efficiency hybrid_engine compile
tensor_parallel expert_parallel timers datastates_ckpt weight_quantization model_info
nebula compression_training amp quantize_training sparse_gradients eigenvalue sparse_attention
elasticity graph_harvesting curriculum_learning progressive_layer_drop"""
_SUB = {
    "zero_optimization": """stage contiguous_gradients reduce_scatter reduce_bucket_size
        use_multi_rank_bucket_allreduce allgather_partitions allgather_bucket_size overlap_comm
        compute_grad_norm load_from_fp32_weights elastic_checkpoint offload_param
        offload_optimizer zenflow sub_group_size stage3_prefetch_bucket_size
        stage3_param_persistence_threshold stage3_model_persistence_threshold
        stage3_max_live_parameters stage3_max_reuse_distance
        stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save
        stage3_module_granularity_threshold stage3_use_all_reduce_for_fetch_params
        stage3_allgather_sequential ignore_unused_parameters legacy_stage1 round_robin_gradients
        parameter_alignment zero_hpz_partition_size zero_quantized_weights
        zero_quantized_nontrainable_weights zero_quantized_gradients memory_efficient_linear
        pipeline_loading_checkpoint override_module_apply log_trace_cache_warnings
        enable_sanity_checks save_muon_momentum_buffer_in_memory leaf_module cpu_offload
        cpu_offload_param cpu_offload_use_pin_memory mics_shard_size
        mics_hierarchical_params_gather zeropp_loco_param""",
    "zero_optimization.offload_param": "device nvme_path buffer_count buffer_size max_in_cpu pin_memory",
    "zero_optimization.offload_optimizer": """device nvme_path buffer_count pin_memory pipeline_read
        pipeline_write fast_init ratio super_offload cpuadam_cores_perc""",
    "fp16": """enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis
        consecutive_hysteresis min_loss_scale fp16_master_weights_and_grads""",
    "bf16": """enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads
        bf16_optimizer_states""",
    "torch_autocast": "enabled dtype lower_precision_safe_modules",
    "data_types": "grad_accum_dtype param_dtype buffer_dtype keep_in_fp32_modules",
    "optimizer": "type params legacy_fusion",
    "scheduler": "type params",
    "tensorboard": "enabled output_path job_name",
    "csv_monitor": "enabled output_path job_name",
    "wandb": "enabled group team project",
    "comet": "enabled samples_log_interval",
    "flops_profiler": "enabled recompute_fwd_factor profile_step module_depth top_modules detailed output_file",
    "activation_checkpointing": """partition_activations contiguous_memory_optimization
        cpu_checkpointing number_checkpoints synchronize_checkpoint_boundary profile""",
    "checkpoint": "tag_validation load_universal use_node_local_storage parallel_write checkpoint_serialization writer",
    "checkpoint.parallel_write": "pipeline_stage",
    "checkpoint.writer": "type io_buffer_size io_buffer_double io_multiplier show_statistics data_parallel decoupled",
    "comms_logger": "enabled verbose prof_all debug prof_ops",
    "timers": "throughput",
    "zero_optimization.leaf_module": "classes names name_suffixes",
    "compile": """deepcompile autoep_non_moe free_activation free_activation_threshold
        offload_activation offload_activation_pin_memory offload_opt_states double_buffer
        symmetric_memory debug_log offload_parameters sync_before_reduce sync_after_reduce
        sync_before_allgather sync_after_allgather keep_int_input_tensors keep_all_input_tensors
        passes""",
}
DEEPSPEED_KEYS: List[str] = _TOP.split() + [f"{block}.{key}" for block, keys in _SUB.items()
                                            for key in keys.split()]

#: DeepSpeed keys with no row of their own in config_table(): key -> (status, why).
NOT_IN_TABLE: Dict[str, Tuple[str, str]] = {
    "timers.throughput": ("planned: refused unless disabled",
                          "throughput timers are planned; `{\"throughput\": {\"enabled\": false}}` "
                          "is accepted, `true` refused"),
}
#: a value that load_config must refuse for each key of NOT_IN_TABLE
_REFUSED_EXAMPLE = {"timers.throughput": {"timers": {"throughput": {"enabled": True}}}}

_STATUS = {
    "honoured": "supported",
    "accepted (no effect: see notes)": "accepted, no effect",
    "planned (refused unless default)": "planned: refused unless default",
    "removed (refused)": "refused: removed in DeepSpeed too",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_rows() -> List[Dict[str, str]]:
    """One row per DeepSpeed key, in the facts' order."""
    table = {row["key"]: row for row in config_table()}
    rows = []
    for key in DEEPSPEED_KEYS:
        if key in table:
            row = table[key]
            rows.append({"key": key, "status": _STATUS[row["status"]],
                         "default": row["default"], "notes": row["notes"]})
        else:
            status, why = NOT_IN_TABLE[key]
            rows.append({"key": key, "status": status, "default": "", "notes": why})
    return rows


def other_rows() -> List[Dict[str, str]]:
    """Keys shardtrain reads beyond the facts' list: pydantic field names that DeepSpeed
    also accepts for its aliases, sub-keys of blocks the facts list without detail, and
    shardtrain's own (`jsonl_monitor`)."""
    known = set(DEEPSPEED_KEYS)
    return [{"key": r["key"], "status": _STATUS[r["status"]], "default": r["default"],
             "notes": r["notes"]} for r in config_table() if r["key"] not in known]


def _config_markdown(rows: List[Dict[str, str]]) -> str:
    lines = ["| key | shardtrain | default | notes |", "|---|---|---|---|"]
    for r in rows:
        default = f"`{_cell(r['default'])}`" if r["default"] else ""
        lines.append(f"| `{r['key']}` | {r['status']} | {default} | {_cell(r['notes'])} |")
    return "\n".join(lines)


# -- functions, classes, engine methods -------------------------------------------------------

class Api(NamedTuple):
    name: str    # "initialize", "zero.Init", "Engine.backward" (engine instance), ...
    status: str  # one of STATUSES
    notes: str


PRESENT = ("supported", "differs", "refused")   # the name exists in shardtrain
ABSENT = ("planned", "not provided")             # it does not (yet)
STATUSES = PRESENT + ABSENT

API: List[Api] = [
    # top level: deepspeed.X, with the alias installed -> shardtrain.deepspeed.X
    Api("initialize", "differs",
        "same arguments, same `(engine, optimizer, dataloader, lr_scheduler)`; `args.deepspeed_config` "
        "(or the deprecated `deepscale_config`), `config=` or `config_params=`. `mpu=` brings the "
        "caller's data- and model-parallel groups; `mesh_param` raises NotImplementedError (the "
        "config's sizes build the mesh). No model, no config or two configs at once: "
        "`InitializeError`, a `ValueError` and, as DeepSpeed's, an `AssertionError`. The engine's "
        "ZeRO-3 `module.state_dict()` is DeepSpeed's: local, partitioned parameters as empty "
        "placeholders (shardtrain's own `initialize` gathers the values)"),
    Api("init_distributed", "supported",
        "DeepSpeed's signature; joins from torchrun's, SLURM's or OpenMPI's variables (no mpi4py), "
        "adopts an initialised group, a world of one without a launcher"),
    Api("add_config_arguments", "supported",
        "`--deepspeed`, `--deepspeed_config`, `--deepscale`, `--deepscale_config`"),
    Api("DeepSpeedEngine", "supported", "is `shardtrain.Engine` (one class under both names)"),
    Api("DeepSpeedOptimizer", "differs",
        "a base class nothing derives from: `engine.optimizer` is the torch optimizer itself"),
    Api("DeepSpeedConfig", "differs",
        "`DeepSpeedConfig(config)` returns shardtrain's `ShardConfig` (validated, batch triple "
        "resolved), which also reads as a dict"),
    Api("DeepSpeedConfigError", "differs", "is `shardtrain.ConfigError`, a ValueError"),
    Api("get_accelerator", "supported", "as `deepspeed.accelerator.get_accelerator`"),
    Api("OnDevice", "supported", "`OnDevice(dtype=None, device=\"meta\", enabled=True)`: tensors built "
        "inside go to `device` (and floating ones to `dtype`)"),
    Api("log_dist", "supported", "`log_dist(message, ranks=[0])`"),
    Api("logger", "supported", "the `shardtrain` logger (`[shardtrain]` prefix, INFO, stderr)"),
    Api("__version__", "differs", "`0.19.8+shardtrain.<shardtrain's version>`: version checks pass "
        "and the label says what it is"),
    Api("init_inference", "refused", "DeepSpeed-Inference: NotImplementedError naming it"),
    Api("tp_model_init", "differs",
        "returns the model unchanged when its `config` asks for the same `tensor_parallel.autotp_size` "
        "(and 16-bit dtype): `initialize` splits the model from that config, as the Hugging Face "
        "Trainer's call expects; without such a config NotImplementedError gives the block to add, "
        "a different size or dtype is a ValueError, `tp_group=` is refused "
        "([parallelism.md](parallelism.md))"),
    Api("set_autotp_mode", "supported",
        "`training=True` changes nothing (shardtrain's AutoTP is the training one); "
        "`training=False` (DeepSpeed-Inference's) raises NotImplementedError"),
    Api("PipelineModule", "supported",
        "is `shardtrain.pipe.PipelineModule` (also `deepspeed.pipe`, with `LayerSpec` and "
        "`TiedLayerSpec`): DeepSpeed's arguments, partition methods and layer names; "
        "`initialize` returns a `PipelineEngine` for it ([parallelism.md]"
        "(parallelism.md#pipeline-parallelism))"),
    Api("PipelineEngine", "supported",
        "`train_batch(data_iter)`, `eval_batch(...)`, `set_dataiterator`, `set_batch_fn`, "
        "`is_first_stage`/`is_last_stage`; 1F1B (or GPipe: `pipeline.schedule`) over ZeRO stages "
        "0-2; `forward`/`backward`/`step` raise PipelineError as DeepSpeed's do; checkpoints load "
        "on any pipeline size, and DeepSpeed's own pipeline checkpoints (ZeRO-1) load too "
        "(converted: checkpoints.md)"),
    Api("DeepSpeedTransformerLayer", "refused", "DeepSpeed's fused kernels: NotImplementedError"),
    Api("add_tuning_arguments", "not provided", "LR range-test arguments; use the config's `scheduler` block"),
    # ZeRO-3 tools
    Api("zero", "supported", "`deepspeed.zero` is `deepspeed.runtime.zero`"),
    Api("zero.Init", "differs",
        "partitions each module's parameters when its `__init__` ends; `module=` and "
        "`enabled=` as in DeepSpeed; `dtype=` casts (default: keep the parameters' dtype, "
        "the engine casts later for bf16/fp16; DeepSpeed picks fp16/bf16 itself); "
        "`remote_device`, `pin_memory`, `config_dict_or_path`, `config` are accepted and "
        "ignored; `data_parallel_group`/`mpu` raise NotImplementedError. Parameters carry "
        "`ds_id`, `ds_shape`, `ds_numel`, `ds_status`, `ds_tensor`, `ds_persist`, not the "
        "`all_gather()`/`partition()` methods"),
    Api("zero.GatheredParameters", "supported",
        "`modifier_rank=None` read-only, `modifier_rank=r` stores rank r's values in every "
        "shard (each rank receives its shard, one scatter; a parameter gathered before the "
        "block receives the whole value, as do the small ones stage 3 keeps whole), "
        "`enabled=False` and plain parameters (or None, or buffers): no-op. "
        "`fwd_module` is accepted and not needed. Nested blocks over one parameter do not "
        "raise (DeepSpeed: RuntimeError)"),
    Api("zero.ZeroParamStatus", "supported", "AVAILABLE, NOT_AVAILABLE, INFLIGHT; one enum under "
        "every path (`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus` too)"),
    Api("zero.register_external_parameter", "supported",
        "checks its arguments and needs nothing more: a partitioned parameter read outside the "
        "forward of the module that owns it is gathered on attribute access"),
    Api("zero.unregister_external_parameter", "supported", "the counterpart (nothing to undo)"),
    Api("zero.MiCS_Init", "refused", "MiCS partitioning: NotImplementedError naming it"),
    Api("runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor", "differs",
        "DeepSpeed's constructor wrapper, for code that wraps or swaps it (Transformers' "
        "`prevent_arange_dtype_change`); `zero.Init` itself replaces no constructor"),
    Api("runtime.zero.partition_parameters._orig_torch_arange", "supported", "torch's own `arange`"),
    # the runtime by DeepSpeed's paths
    Api("runtime.engine.DeepSpeedEngine", "supported", "is `shardtrain.Engine`"),
    Api("runtime.lr_schedules.VALID_LR_SCHEDULES", "supported",
        "`['LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR']`"),
    Api("runtime.lr_schedules.WarmupLR", "supported", "shardtrain's schedules (DeepSpeed's formulas)"),
    Api("runtime.lr_schedules.OneCycle", "supported", "lr and beta1 cycle as DeepSpeed's (beta2 0.99)"),
    Api("runtime.base_optimizer.DeepSpeedOptimizer", "differs", "as `DeepSpeedOptimizer`"),
    Api("runtime.config.DeepSpeedConfig", "differs", "as `DeepSpeedConfig`"),
    Api("runtime.config.ADAM_OPTIMIZER", "supported",
        "`\"adam\"`, and every other module-level constant of DeepSpeed's `runtime/config.py` "
        "(`ADAMW_OPTIMIZER`, `DEEPSPEED_OPTIMIZERS`, `TORCH_ADAM_PARAM`, `ADAM_W_MODE`, ...) and, "
        "re-exported as DeepSpeed does, of `runtime/constants.py`, with DeepSpeed's values; as "
        "optimizer types, `adam`, `adamw`, `adagrad` and `muon` (ZeRO stages 0-3, "
        "docs/optimizers.md) are built and `lamb`, `lion`, `muadam`, `muadamw`, `musgd` refused "
        "by name"),
    Api("runtime.constants.GRADIENT_CLIPPING", "supported",
        "every config key name and default of DeepSpeed's `runtime/constants.py` (`TRAIN_BATCH_SIZE`, "
        "`FP16_INITIAL_SCALE_POWER_DEFAULT`, `PIPE_REPLICATED`, `ROUTE_TRAIN`, `ValidationMode`, ...), "
        "without its `*_FORMAT` help texts"),
    Api("runtime.lr_schedules.WARMUP_MIN_LR", "supported",
        "and every schedule and parameter name of DeepSpeed's `lr_schedules` (`WARMUP_MAX_LR`, "
        "`WARMUP_NUM_STEPS`, `WARMUP_TYPE`, `TOTAL_NUM_STEPS`, `CYCLE_*`, `DECAY_*`, "
        "`LR_RANGE_TEST_*`, `WARMUP_MIN_RATIO`, `COS_MIN_RATIO`, ...): shardtrain's schedules take "
        "those keys"),
    Api("runtime.zero.config.ZeroStageEnum", "supported",
        "an `int` enum (`disabled`, `optimizer_states`, `gradients`, `weights`, `max_stage`); also "
        "`ZERO_OPTIMIZATION`"),
    Api("runtime.zero.config.DeepSpeedZeroConfig", "refused",
        "DeepSpeed's pydantic config classes: `DeepSpeedConfig(config).zero_optimization` instead"),
    Api("runtime.zero.offload_config.OffloadDeviceEnum", "supported",
        "a `str` enum (`none`, `cpu`, `nvme`; NVMe offload is refused by the config); also "
        "`OffloadStateTypeEnum`"),
    Api("runtime.zero.offload_states.get_state_devices", "supported",
        "the host for a kind `engine.offload_states()` moved, the engine's device otherwise; "
        "`offload_adam_states`/`reload_adam_states` (a bare optimizer's) are refused, pointing "
        "at the engine's"),
    Api("runtime.pipe.topology.PipeModelDataParallelTopology", "supported",
        "with `ProcessTopology` and `PipeDataParallelTopology`: the same rank layout (pipe, data, "
        "model); `PipelineParallelGrid` is not provided: `engine.mpu` answers its lookups"),
    Api("runtime.pipe.engine.PipelineEngine", "supported", "is `deepspeed.PipelineEngine`"),
    Api("runtime.pipe.module.PipelineError", "supported", "is `shardtrain.errors.PipelineError`"),
    Api("utils.RepeatingLoader", "supported",
        "restarts the loader at its end (also `deepspeed.runtime.dataloader.RepeatingLoader`)"),
    Api("runtime.pipe.dualpipev.DualPipeVModule", "supported",
        "a `PipelineModule` of two chunks a stage placed as a V (DualPipeV's placement), trained "
        "by shardtrain's zero-bubble V schedule (`zbv`): DeepSpeed's DualPipeV losses; "
        "`DualPipeVEngine` is `PipelineEngine`"),
    Api("runtime.pipe.schedule", "not provided",
        "DeepSpeed's pipeline instruction classes: importing it raises ModuleNotFoundError "
        "naming it; so does `runtime.pipe.p2p`"),
    Api("runtime.sequence_parallel.ulysses_sp.TiledMLP", "supported",
        "is `shardtrain.parallel.TiledMLP`: the MLP tile by tile along the sequence, only its "
        "input saved for backward; the parameters' gradient arrives once (no `ds_grad_is_ready`)"),
    Api("runtime.sequence_parallel.ulysses_sp.sequence_tiled_compute", "supported",
        "is `shardtrain.parallel.sequence_tiled_compute` (also `SequenceTiledCompute.apply`); "
        "parameters get gradients when listed in `compute_params`"),
    Api("runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss", "supported",
        "is `shardtrain.parallel.TiledFusedLogitsLoss`; `tiled_logits_loss` gives the exact mean "
        "over valid labels ([parallelism.md](parallelism.md))"),
    Api("runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF.register_with_transformers",
        "differs", "returns the `mpu` of a mesh with a sequence-parallel dimension (`MeshMPU`); "
        "`initialize(mpu=...)` then runs shardtrain's Ulysses, whose loss is the mean over the "
        "whole sequences (the same on every rank); `sdpa` or `eager` attention, packed rows attend "
        "within their documents; constructing the class raises NotImplementedError"),
    Api("runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter", "supported",
        "is `shardtrain.parallel.SequenceParallelLoader`: the group's batches in turn, each as "
        "this rank's slice with `shift_labels` (and `labels` set to them, so `model(**batch).loss` "
        "is the loss); `position_ids` are made when absent. Accelerate's "
        "`ParallelismConfig(sp_backend=\"deepspeed\")` runs on them "
        "([switching_from_deepspeed.md](switching_from_deepspeed.md)); `parallel_state_sp` "
        "raises ModuleNotFoundError"),
    Api("sequence.layer.DistributedAttention", "not provided",
        "the same ModuleNotFoundError: Ulysses comes from `sequence_parallel_size`"),
    Api("runtime.tensor_parallel", "not provided",
        "DeepSpeed's AutoTP internals: ModuleNotFoundError pointing to `tensor_parallel.autotp_size`"),
    Api("module_inject.layers.set_autotp_mode", "supported", "as `set_autotp_mode`"),
    Api("module_inject.layers.LinearLayer", "refused",
        "DeepSpeed's AutoTP layer classes (also `LinearAllreduce`): `isinstance` is False, "
        "construction raises NotImplementedError; the rest of `module_inject` raises "
        "ModuleNotFoundError naming kernel injection"),
    Api("runtime.utils.move_to_device", "supported", ""),
    Api("runtime.utils.see_memory_usage", "supported", "logs allocated/reserved memory when `force`"),
    # helpers
    Api("utils", "supported", "the names below"),
    Api("utils.logger", "supported", "the `shardtrain` logger"),
    Api("utils.logging.logger", "supported", "the same logger (Lightning sets its level here)"),
    Api("utils.safe_get_full_fp32_param", "supported",
        "the full fp32 value (the master copy in 16-bit training), assembled from every rank's "
        "slice: call it on every rank"),
    Api("utils.safe_get_full_grad", "differs",
        "the full averaged gradient between the backward of an accumulation boundary and "
        "`step()`, **unscaled** (DeepSpeed returns it times the fp16 loss scale); before the "
        "boundary and inside `no_sync()`, at stages 0-1, this rank's gradient accumulated so "
        "far, as DeepSpeed's; at stages 2-3 there a `GradientsUnavailableError` (a `ValueError`, "
        "as DeepSpeed's stage 2 raises)"),
    Api("utils.safe_get_full_optimizer_state", "supported", "`(param, \"exp_avg\")`, ..."),
    Api("utils.safe_set_full_fp32_param", "supported", "master and module weight, every rank"),
    Api("utils.safe_set_full_grad", "supported", "replaces the gradient `step()` applies (unscaled)"),
    Api("utils.safe_set_full_optimizer_state", "supported", ""),
    Api("utils.safe_get_local_fp32_param", "supported", "this rank's slice, 1-D"),
    Api("utils.safe_get_local_grad", "supported", "this rank's slice, 1-D, unscaled"),
    Api("utils.safe_get_local_optimizer_state", "supported", "this rank's slice, 1-D"),
    Api("utils.set_z3_leaf_modules", "supported",
        "classes or class names (`Block`, `package.module.Block`); also `shardtrain.zero.set_z3_leaf_modules`"),
    Api("utils.unset_z3_leaf_modules", "supported", ""),
    Api("utils.set_z3_leaf_modules_by_name", "supported", "names as in `named_modules()`"),
    Api("utils.set_z3_leaf_modules_by_suffix", "supported", ""),
    Api("utils.z3_leaf_module", "supported", ""),
    Api("utils.get_z3_leaf_modules", "supported", ""),
    Api("utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint", "differs",
        "full fp32 weights of a shardtrain checkpoint (any world size and stage), one CPU process; "
        "DeepSpeed's own checkpoint files do not load"),
    Api("utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict", "differs",
        "writes `pytorch_model.bin` or `model.safetensors` (sharded with an index past "
        "`max_shard_size`) from a shardtrain checkpoint"),
    Api("utils.zero_to_fp32.load_state_dict_from_zero_checkpoint", "differs", "from a shardtrain checkpoint"),
    Api("utils.groups._get_sequence_parallel_group", "differs",
        "and `_get_{sequence,sequence_data,data}_parallel_{group,world_size,rank}`, "
        "`_get_model_parallel_world_size`, `get_tensor_model_parallel_{world_size,rank}`: read "
        "from the mesh `UlyssesSPAttentionHF.register_with_transformers` built (its `mpu`), else "
        "the only live engine's; a group of this rank alone raises KeyError, as DeepSpeed without "
        "one; expert-parallel groups are not provided (`engine.mpu` has the same answers)"),
    Api("checkpoint.utils.clone_tensors_for_torch_save", "supported", ""),
    Api("checkpoint.constants.OPTIMIZER_STATE_DICT", "supported",
        "and every other key and file name of DeepSpeed's `checkpoint/constants.py` (`FP32_FLAT_GROUPS`, "
        "`ZERO_STAGE`, `PARTITION_COUNT`, `PARAM_SHAPES`, `BUFFER_NAMES`, `FROZEN_PARAM_SHAPES`, "
        "`DS_VERSION`, `UNIVERSAL_CHECKPOINT_INFO`, ...); the keys the checkpoint importer reads "
        "are its own constants"),
    Api("launcher.runner.DEEPSPEED_ENVIRONMENT_NAME", "supported", "`.deepspeed_env` (or `$DS_ENV_FILE`)"),
    Api("launcher.runner.main", "differs",
        "the `deepspeed` command: `--num_gpus`, `--num_nodes`, `--hostfile`, `--include/--exclude`, "
        "`--master_addr/--master_port`, `--node_rank`, `--no_local_rank`, `--module`, over "
        "`shardtrain run` (torchrun); starts this machine's processes (no ssh/pdsh): run it on "
        "every node with `--node_rank`"),
    Api("moe.utils.split_params_into_different_moe_groups_for_optimizer", "supported",
        "expert parameters in groups of their own per `ep_size` (`moe: True`), cut at "
        "`max_group_size` elements"),
    Api("moe.layer.MoE", "differs", "the layer and its arguments; top-1/top-2 gating (k > 2, "
        "`use_tutel` and expert slicing refused); expert parallelism trains at ZeRO stages 0-3, "
        "its checkpoints move between `ep_size`s; without random token selection "
        "an over-full expert keeps its first tokens ([parallelism.md](parallelism.md#mixtures-of-experts))"),
    Api("moe.sharded_moe.top1gating", "supported", "DeepSpeed's rule; draws from torch's generator"),
    Api("moe.sharded_moe.top2gating", "supported", "DeepSpeed's rule; draws from torch's generator"),
    Api("compression.helper.recursive_getattr", "supported", ""),
    Api("compression.helper.recursive_setattr", "supported", ""),
    Api("ops.adam.FusedAdam", "differs", "`torch.optim.Adam` with DeepSpeed's arguments (decoupled "
        "weight decay unless `adam_w_mode=False`); `bias_correction=False` is refused"),
    Api("ops.adam.DeepSpeedCPUAdam", "differs", "the same over host memory (ZeRO-Offload); any "
        "torch optimizer is accepted with offload too"),
    Api("ops.adagrad.DeepSpeedCPUAdagrad", "differs", "`torch.optim.Adagrad`"),
    Api("ops.lion.DeepSpeedCPULion", "refused", "no Lion optimizer: NotImplementedError naming it"),
    Api("checkpointing", "supported", "activation checkpointing (`deepspeed.checkpointing`)"),
    Api("checkpointing.checkpoint", "supported", "on `torch.utils.checkpoint`; every ZeRO stage"),
    Api("checkpointing.configure", "supported",
        "`checkpoint_in_cpu`, `synchronize`, `partition_activations` (with `mpu_`, or the engine's "
        "tensor-parallel mesh), `mpu_`; `contiguous_checkpointing`, `num_checkpoints`, `profile` "
        "accepted with no effect"),
    Api("checkpointing.is_configured", "supported", ""),
    Api("checkpointing.reset", "supported", ""),
    Api("checkpointing.get_cuda_rng_tracker", "supported",
        "Megatron's named RNG streams (`fork()`, `add`, `get_states`/`set_states`; the device's "
        "generator, the CPU's on a CPU run); `checkpoint` recomputes a region with the streams' "
        "states of its forward"),
    Api("checkpointing.model_parallel_cuda_manual_seed", "supported",
        "the default stream seeded alike, `model-parallel-rng` with seed + 2718 + the "
        "model-parallel rank of the `mpu_` given to `configure`"),
    Api("comm", "supported", "`deepspeed.comm`: DeepSpeed's functions and signatures, passed to "
        "`torch.distributed` on the group given (None: the world)"),
    Api("comm.init_distributed", "supported", "as `init_distributed`"),
    Api("comm.is_initialized", "supported", ""),
    Api("comm.get_rank", "supported", "`get_rank(group=None)`; 0 before a process group exists"),
    Api("comm.get_world_size", "supported", "`get_world_size(group=None)`; 1 before a group exists"),
    Api("comm.get_local_rank", "supported", ""),
    Api("comm.barrier", "supported", ""),
    Api("comm.all_reduce", "supported",
        "`all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False)`; `op` may also be a "
        "name, and AVG works on gloo"),
    Api("comm.broadcast", "supported", "`broadcast(tensor, src, group=None, async_op=False)`"),
    Api("comm.all_gather", "supported", "DeepSpeed's list form, `all_gather(tensor_list, tensor)`"),
    Api("comm.all_gather_into_tensor", "supported", ""),
    Api("comm.reduce_scatter_tensor", "supported", ""),
    Api("comm.all_to_all_single", "supported", ""),
    Api("comm.send", "supported", "and `recv`, `isend`, `irecv`"),
    Api("comm.new_group", "supported", "torch's `new_group`"),
    Api("comm.ReduceOp", "supported", "torch's `ReduceOp`"),
    Api("comm.log_summary", "supported",
        "`log_summary(show_straggler=False, return_dict=False)`: rank 0 logs the table of the "
        "`comms_logger` log (bandwidths in GB/s, as nccl-tests); also `configure` and `reset_log`"),
    Api("accelerator.get_accelerator", "supported",
        "an object with DeepSpeed's accelerator methods for the device the engine uses: "
        "`device_name`, `current_device_name`, `set_device`, `device_count`, `is_available`, "
        "`synchronize`, `manual_seed_all`, `empty_cache`, memory queries, "
        "`communication_backend_name`, streams and events (CUDA), ..."),
    Api("accelerator.set_accelerator", "differs",
        "takes a `DeepSpeedAccelerator` (or an instance of a subclass; anything else is a "
        "TypeError) and changes what `get_accelerator()` returns to scripts, not the device "
        "shardtrain trains on"),
    # the engine: DeepSpeedEngine.X -> shardtrain.Engine.X (checked on an instance)
    Api("Engine.forward", "supported",
        "`engine(*inputs, **kwargs)`: inputs moved to the device and cast in bf16/fp16 mode; "
        "any output structure (tensors, tuples, dicts, Transformers `ModelOutput`), returned "
        "as ordinary tensors (`loss *= s` works)"),
    Api("Engine.backward", "supported",
        "`backward(loss, retain_graph=False, scale_wrt_gas=True)`, returns `loss / gas`; a plain "
        "`loss.backward()` gives the same gradients at every stage (DeepSpeed: stages 1-3)"),
    Api("Engine.step", "supported", "`step(lr_kwargs=None)`; updates at the accumulation boundary"),
    Api("Engine.zero_grad", "supported", ""),
    Api("Engine.no_sync", "supported", "stages 0-1; refused at 2-3, nested blocks and `step()` "
        "inside refused, as in DeepSpeed, with `StepOrderError` (an `AssertionError`, as "
        "DeepSpeed's, and a `RuntimeError`)"),
    Api("Engine.train", "supported", ""),
    Api("Engine.eval", "supported", ""),
    Api("Engine.is_gradient_accumulation_boundary", "supported", ""),
    Api("Engine.set_gradient_accumulation_boundary", "supported", "sticky, as in DeepSpeed"),
    Api("Engine.get_lr", "supported", ""),
    Api("Engine.get_mom", "supported", "each group's `betas` (Adam) or `momentum` (SGD)"),
    Api("Engine.get_global_grad_norm", "differs",
        "the unscaled norm before clipping; also reported at stage 0 in fp32 when clipping "
        "measures it (DeepSpeed: None there)"),
    Api("Engine.was_step_applied", "supported", ""),
    Api("Engine.train_batch_size", "supported", ""),
    Api("Engine.train_micro_batch_size_per_gpu", "supported", ""),
    Api("Engine.gradient_accumulation_steps", "supported", ""),
    Api("Engine.set_train_batch_size", "supported",
        "changes the accumulation steps; ValueError unless a multiple of micro-batch x world size"),
    Api("Engine.set_train_micro_batch_size", "planned", "changing the batch triple at run time"),
    Api("Engine.get_batch_info", "supported", "`(train_batch_size, micro-batch, accumulation steps)`"),
    Api("Engine.zero_optimization_stage", "supported", ""),
    Api("Engine.zero_optimization", "supported", "True at stages 1-3"),
    Api("Engine.zero_optimization_partition_gradients", "supported", "stage >= 2"),
    Api("Engine.zero_cpu_offload", "supported", "optimizer offload to the CPU"),
    Api("Engine.zero_gather_16bit_weights_on_model_save", "supported",
        "`stage3_gather_16bit_weights_on_model_save`"),
    Api("Engine._zero3_consolidated_16bit_state_dict", "supported",
        "full weights on rank 0 (CPU), None elsewhere; every rank calls it"),
    Api("Engine._consolidated_16bit_state_dict", "supported",
        "as `_zero3_consolidated_16bit_state_dict` at stage 3 or with tensor parallelism; "
        "ValueError otherwise, as in DeepSpeed"),
    Api("Engine.fp16_enabled", "supported", ""),
    Api("Engine.bfloat16_enabled", "supported", ""),
    Api("Engine.gradient_clipping", "supported", ""),
    Api("Engine.steps_per_print", "supported", "None for never (null or Infinity in the config)"),
    Api("Engine.wall_clock_breakdown", "supported", ""),
    Api("Engine.tput_timer", "differs", "`avg_samples_per_sec()` from the engine's counters; "
        "`start`/`stop`/`update_epoch_count` accepted"),
    Api("Engine.scale", "planned",
        "loss scaling for a manual backward; a plain `loss.backward()` is already scaled by "
        "the engine's output hooks"),
    Api("Engine.save_checkpoint", "differs",
        "DeepSpeed's signature, tag `global_step<N>` and `latest` file; another on-disk format "
        "(safetensors and `meta.json`, docs/checkpoints.md): DeepSpeed checkpoints load once "
        "converted (`shardtrain import-deepspeed`), shardtrain's do not load in DeepSpeed. "
        "Loads on any world size and ZeRO stage. `client_state` takes any picklable values "
        "(Trainer and Lightning states)"),
    Api("Engine.load_checkpoint", "differs",
        "no `custom_load_fn`; returns the tag directory and only the user's `client_state` keys, "
        "unpickled with torch's restricted (`weights_only`) loader"),
    Api("Engine.save_16bit_model", "supported",
        "full weights from every stage (gathered at stage 3); `*.safetensors` writes safetensors"),
    Api("Engine.save_fp16_model", "supported", "the deprecated name of `save_16bit_model`"),
    Api("Engine.module_state_dict", "supported", "`engine.module.state_dict()` (at stage 3: as "
        "`initialize` built the engine, local placeholders or the gathered full weights)"),
    Api("Engine.load_module_state_dict", "supported", "`engine.module.load_state_dict(sd)`: at every stage"),
    Api("Engine.deepspeed_io", "planned", "`initialize(training_data=...)` builds the loader"),
    Api("Engine.compile", "supported", "`compile(backend=None, compile_kwargs=None, "
        "schedule=None)`; with `compile.deepcompile` true, DeepCompile at stages 1-3: ZeRO's "
        "collectives inside the compiled graphs, a schedule of passes by name (`z1`, `z3`, "
        "`prefetch`, `selective_gather`, `offload_opt_states`; DeepSpeed takes pass functions), "
        "on the CPU too ([performance.md](performance.md#deepcompile))"),
    Api("Engine.launch_compile_passes", "supported", "forward calls it: the schedule's passes "
        "for `global_steps`"),
    Api("Engine.is_compiled", "supported", ""),
    Api("Engine.is_deepcompile_enabled", "supported", "`compile.deepcompile`"),
    Api("Engine.is_deepcompile_active", "supported", "true once `engine.compile()` applied "
        "DeepCompile"),
    Api("Engine.destroy", "supported",
        "removes the engine's gradient hooks and releases stage-3 parameters; the process "
        "group stays (`deepspeed.comm.destroy_process_group()` ends it)"),
    Api("Engine.empty_partition_cache", "supported", "releases gathered stage-3 parameters"),
    Api("Engine.offload_states", "supported",
        "`offload_states(include=None, device=cpu, pin_memory=True, non_blocking=False)` at "
        "stages 0-3 (DeepSpeed: 1-3): each kind of `OffloadStateTypeEnum` moves to host memory "
        "in place, bit for bit back at `reload_states()`; `hp_params` moves nothing in fp32 "
        "training (no master copies); a call that needs what is away raises, naming it; also "
        "on `engine.optimizer`, as OpenRLHF calls it ([zero.md](zero.md#model-states-off-the-device-on-demand))"),
    Api("Engine.reload_states", "supported", "`reload_states(non_blocking=False)`; also on "
        "`engine.optimizer`"),
    Api("Engine.allreduce_gradients", "not provided",
        "gradients are reduced in buckets during backward; there is nothing to call"),
    Api("Engine.module", "supported", "and attributes the engine lacks come from it "
        "(`engine.gradient_checkpointing_enable()`)"),
    Api("Engine.optimizer", "differs",
        "the torch optimizer itself, stepping this rank's (fp32) shards, with DeepSpeed's "
        "`overflow`, `loss_scale` and `cur_scale` attributes and its ZeRO optimizer's "
        "`offload_states`/`reload_states`; DeepSpeed returns its ZeRO/fp16 wrapper"),
    Api("Engine.lr_scheduler", "supported", ""),
    Api("Engine.training_dataloader", "supported", "resumable: its position is in checkpoints"),
    Api("Engine.global_steps", "supported", ""),
    Api("Engine.global_samples", "supported", ""),
    Api("Engine.micro_steps", "supported", ""),
    Api("Engine.skipped_steps", "supported", ""),
    Api("Engine.global_rank", "supported", ""),
    Api("Engine.local_rank", "supported", ""),
    Api("Engine.world_size", "supported", "every rank of the job (data x sequence x tensor parallel)"),
    Api("Engine.device", "supported", ""),
    Api("Engine.config", "differs", "a typed `ShardConfig` that also reads as the config dict "
        "(`engine.config.get(\"zero_optimization\", {})`, `engine.config[\"train_batch_size\"]`)"),
    Api("Engine.dp_world_size", "supported", "the ranks that read different samples: `world_size` "
        "divided by the tensor- and sequence-parallel sizes"),
    Api("Engine.mp_world_size", "supported", "the tensor-parallel size"),
    Api("Engine.dump_state", "supported", "the key; with it rank 0 logs `engine.state_report()` at "
        "start-up (the mesh, stage, dtypes, batch triple, optimizer, model-state bytes)"),
    Api("Engine.collect_python_gc", "supported", "one collection (with `disable_python_gc` the "
        "collector is off while an engine holding the key lives)"),
    Api("Engine.sequence_parallel_size", "supported", ""),
    Api("Engine.seq_dp_world_size", "supported", "data- x sequence-parallel ranks (ZeRO's group)"),
    Api("Engine.monitor", "supported",
        "`write_events([(name, value, global_samples)])` and `enabled`, as DeepSpeed's monitor; the "
        "monitors come from the config (also `summary()` and `close()`)"),
]

#: shardtrain names with no row above, for the doc's last table (checked to exist)
ADDITIONS: List[Tuple[str, str]] = [
    ("destroy", "tears down the process group `init_distributed` created"),
    ("log_dist_once", "`log_dist` that logs a message only once"),
    ("load_config", "the config loader: dict, JSON path or base64 JSON, and the world size"),
    ("Engine.get_loss_scale", "the current loss scale (1 outside fp16)"),
    ("Engine.loss_scaler", "the loss scaler (scale, hysteresis, window)"),
    ("Engine.model_state_bytes", "bytes of parameters, gradients, optimizer states and masters this rank holds"),
    ("Engine.log_metrics", "writes values to the configured monitors (rank 0)"),
    ("checkpoint.consolidate", "one safetensors file of full weights from a checkpoint, one CPU process"),
]


def _api_markdown() -> str:
    lines = ["| DeepSpeed | shardtrain | notes |", "|---|---|---|"]
    for row in API:
        shown = f"engine.{row.name[len('Engine.'):]}" if row.name.startswith("Engine.") \
            else f"deepspeed.{row.name}"
        lines.append(f"| `{shown}` | {row.status} | {_cell(row.notes)} |")
    return "\n".join(lines)


def _additions_markdown() -> str:
    lines = ["| shardtrain | what it does |", "|---|---|"]
    for name, what in ADDITIONS:
        shown = f"engine.{name[len('Engine.'):]}" if name.startswith("Engine.") else f"shardtrain.{name}"
        lines.append(f"| `{shown}` | {_cell(what)} |")
    return "\n".join(lines)


def module_tree() -> List[Tuple[str, str, List[str], List[str]]]:
    """(``deepspeed.<path>``, its docstring's first line, its public names, and those of them
    that are DeepSpeed's constants) for every public module of ``shardtrain.deepspeed``, the
    tree ``import deepspeed`` gives with the alias."""
    import importlib
    import pkgutil

    from shardtrain.deepspeed._constants import constant_names
    root = shardtrain.deepspeed
    out = [("deepspeed", _first_sentence(root.__doc__), list(root.__all__), [])]
    for info in sorted(pkgutil.walk_packages(root.__path__, "shardtrain.deepspeed."),
                       key=lambda i: i.name):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        names = [n for n in getattr(module, "__all__", [])
                 if not isinstance(getattr(module, n, None), type(root))]
        constants = set(constant_names(vars(module)))
        out.append(("deepspeed" + info.name[len("shardtrain.deepspeed"):],
                    _first_sentence(module.__doc__ or ""), names,
                    [n for n in names if n in constants]))
    return out


def _first_sentence(doc: str) -> str:
    """A module docstring's first sentence, without a leading ```deepspeed.x``:`` and with
    reST's double backquotes made single."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    text = re.sub(r"^``[\w.]+``(?: \(``[\w.]+``\))?:\s*", "", text).replace("``", "`")
    text = re.sub(r":(?:mod|class|func):`\.?([^`]+)`", r"`\1`", text)
    end = re.search(r"\.(\s|$)", text)
    text = text[: end.start() + 1] if end else text
    return text[:1].upper() + text[1:]


def _tree_markdown() -> str:
    tree = module_tree()
    lines = ["| module | what it is | names |", "|---|---|---|"]
    for name, doc, names, constants in tree:
        shown = ", ".join(f"`{n}`" for n in names if n not in constants)
        lines.append(f"| `{name}` | {_cell(doc)} | {_cell(_join(shown, _constants_cell(constants, tree)))} |")
    return "\n".join(lines)


def _constants_cell(constants: List[str], tree) -> str:
    """A module's constants; those of another module it re-exports whole (as
    ``runtime.config`` does ``runtime.constants``) are named by that module."""
    if not constants:
        return ""
    whole = [(other, set(c)) for other, _, _, c in tree
             if c and set(c) < set(constants)]
    covered = set().union(*(c for _, c in whole)) if whole else set()
    parts = [f"every constant of `{other}`" for other, _ in whole]
    rest = [n for n in constants if n not in covered]
    if rest:
        label = "constant" if len(rest) == 1 else f"{len(rest)} constants"
        parts.append(f"{label}: " + ", ".join(f"`{n}`" for n in rest))
    return "; ".join(parts)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def sections() -> Dict[str, str]:
    """The generated blocks of the doc, by marker name."""
    return {"config": _config_markdown(config_rows()), "other-keys": _config_markdown(other_rows()),
            "tree": _tree_markdown(), "api": _api_markdown(), "additions": _additions_markdown()}


_BLOCK = re.compile(r"(?P<begin><!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?:.*?\n)?"
                    r"(?P<end><!-- END GENERATED: (?P=name) -->)", re.S)


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    blocks = sections()
    return _BLOCK.sub(lambda m: m.group("begin") + blocks[m.group("name")] + "\n" + m.group("end"),
                      text)


# -- the tests --------------------------------------------------------------------------------

def test_every_deepspeed_key_has_a_status():
    table = {row["key"] for row in config_table()}
    assert len(DEEPSPEED_KEYS) == len(set(DEEPSPEED_KEYS))
    for key in DEEPSPEED_KEYS:
        assert (key in table) != (key in NOT_IN_TABLE), key
    assert set(NOT_IN_TABLE) <= set(DEEPSPEED_KEYS)


@pytest.mark.parametrize("key", sorted(NOT_IN_TABLE))
def test_keys_without_a_row_are_refused(key):
    with pytest.raises(ConfigError):
        load_config({"train_micro_batch_size_per_gpu": 1, **_REFUSED_EXAMPLE[key]}, 1)


@pytest.fixture(scope="module")
def engine():
    """A one-process engine: instance attributes exist only on an instance."""
    model = torch.nn.Linear(2, 2)
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def _exists(name: str, engine, root: Any = None) -> bool:
    """Whether ``deepspeed.<name>`` (the alias tree) or ``engine.<name>`` exists."""
    if name.startswith("Engine."):
        return hasattr(engine, name[len("Engine."):])
    node: Any = shardtrain.deepspeed if root is None else root
    for part in name.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


@pytest.mark.parametrize("row", API, ids=lambda r: r.name)
def test_api_rows_match_what_shardtrain_has(row, engine):
    assert row.status in STATUSES, row
    exists = _exists(row.name, engine)
    if row.status in PRESENT:
        assert exists, f"{row.name} is documented as {row.status!r} but shardtrain has no such name"
    else:
        assert not exists, (f"{row.name} now exists in shardtrain: update its row "
                            f"(documented as {row.status!r}) and regenerate the doc")


@pytest.mark.parametrize("name", [name for name, _ in ADDITIONS])
def test_additions_exist(name, engine):
    assert _exists(name, engine, root=shardtrain), name


def test_initialize_takes_deepspeeds_arguments():
    deepspeed = ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                 "distributed_port", "mpu", "dist_init_required", "collate_fn", "config",
                 "mesh_param", "config_params"]
    ours = list(inspect.signature(shardtrain.initialize).parameters)
    assert ours == deepspeed


def test_engine_methods_take_deepspeeds_arguments(engine):
    def params(fn):
        return list(inspect.signature(fn).parameters)
    assert params(engine.backward) == ["loss", "retain_graph", "scale_wrt_gas"]
    assert params(engine.step) == ["lr_kwargs"]
    assert params(engine.save_checkpoint) == ["save_dir", "tag", "client_state", "save_latest",
                                              "exclude_frozen_parameters"]
    # DeepSpeed's last argument, custom_load_fn, is the documented difference
    assert params(engine.load_checkpoint) == ["load_dir", "tag", "load_module_strict",
                                              "load_optimizer_states", "load_lr_scheduler_states",
                                              "load_module_only"]
    assert params(engine.save_16bit_model) == ["save_dir", "save_filename",
                                               "exclude_frozen_parameters"]


def test_doc_is_generated_from_the_code():
    text = DOC.read_text()
    names = set(m.group("name") for m in _BLOCK.finditer(text))
    assert names == set(sections()), f"the doc's generated blocks are {sorted(names)}"
    assert text == render(text), ("docs/deepspeed_compat.md is out of date: run "
                                  "`python tests/test_deepspeed_script_compat.py --write`")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_deepspeed_script_compat.py --write")
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote {DOC}")
