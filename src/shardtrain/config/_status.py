"""What shardtrain does with each DeepSpeed key it does not simply honour.

A key is honoured unless a table here says otherwise: planned (accepted only at its default, so a
config that asks for an unimplemented feature fails instead of training without it), accepted with
no effect (shardtrain never imposes the restriction the key lifts), or removed from DeepSpeed
(refused whatever its value). The tables are data, read by the base model (removed keys), the
planned-feature gate and the key table, so that moving a feature from "planned" to
"implemented" means deleting its entry here (and, for ZeRO, adding the stage to
IMPLEMENTED_ZERO_STAGES); nothing else has to change.
"""

from typing import Any, Dict, FrozenSet, Tuple

__all__ = ["IMPLEMENTED_ZERO_STAGES", "PLANNED", "STAGE_TUNING_KEYS", "NO_EFFECT", "REMOVED_KEYS"]

IMPLEMENTED_ZERO_STAGES: FrozenSet[int] = frozenset({0, 1, 2, 3})

#: Dotted key -> what the feature is. A planned key is accepted only at its default (disabled)
#: value; any other value raises ConfigError. Object-valued blocks without a model here
#: (``hybrid_engine``, ``data_efficiency``, ...) count as disabled when they ask for nothing:
#: ``{}``, ``"enabled": false`` (whatever settings come with it), or every sub-block disabled
#: (see ``_planned._block_disabled``).
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
    "fp16.fp16_master_weights_and_grads": "16-bit master weights and gradients (ZeRO 1-3)",
    "data_types.keep_in_fp32_modules": "keeping named modules in fp32 under fp16/bf16",
    "comet.enabled": "the Comet monitor (meanwhile, log to wandb, mlflow, tensorboard, csv_monitor "
                     "or jsonl_monitor)",
    "checkpoint.parallel_write.pipeline_stage": "pipeline-parallel checkpoint writing",
    "checkpoint.writer": "the fast/decoupled checkpoint writers",
    "optimizer.legacy_fusion": "the legacy fused fp16 optimizer path",
    "use_data_before_expert_parallelism": "mixture-of-experts group topology",
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
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "ZeRO-3 parameter fetching",
    "zero_optimization.stage3_allgather_sequential": "ZeRO-3 parameter fetching",
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
        "adds each gradient into its buffer as soon as autograd produces it (with "
        "data_types.grad_accum_dtype \"fp32\"), so there is no copy to move",
    "checkpoint.use_node_local_storage":
        "on one machine every rank sees the same directory; on several machines true is "
        "refused at start-up (put save_dir on storage every node sees)",
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
    "aio": "tunes asynchronous NVMe I/O, which only NVMe offload and the fast checkpoint writers "
           "use (both planned)",
    "autotuning.model_info.num_params":
        "shardtrain autotune always runs the profile: it needs the measured activation memory",
    "autotuning.model_info.hidden_size": "informational: the profile measures what the autotuner needs",
    "autotuning.model_info.num_layers": "informational: the profile measures what the autotuner needs",
}

#: DeepCompile's tuning keys of DeepSpeed's own machinery (its buffers, stream syncs, input
#: profiling, AutoEP), which shardtrain's compiled ZeRO (shardtrain.deepcompile) does not have:
#: accepted and changing nothing. free_activation is what the compiled graphs do anyway (inductor
#: frees each buffer after its last use); offload_activation, offload_parameters and
#: symmetric_memory true are refused by engine.compile() with deepcompile true.
_DEEPCOMPILE_TUNING = {
    "autoep_non_moe": "AutoEP is not provided, so there are no AutoEP layers to compile apart",
    "free_activation": "the compiled graphs free every activation after its last use anyway",
    "free_activation_threshold": "the compiled graphs free every activation after its last use",
    "offload_activation": "refused by engine.compile() when true with deepcompile true",
    "offload_activation_pin_memory": "only read with offload_activation, which is refused",
    "double_buffer": "tunes DeepSpeed's own prefetch buffers; the compiled graphs allocate their own",
    "symmetric_memory": "refused by engine.compile() when true with deepcompile true",
    "debug_log": "DeepSpeed's graph dumps; TORCH_LOGS=graph_code shows the compiled graphs",
    "offload_parameters": "refused by engine.compile() when true with deepcompile true",
    "sync_before_reduce": "the graphs' collectives are ordered on the compute stream",
    "sync_after_reduce": "the graphs' collectives are ordered on the compute stream",
    "sync_before_allgather": "the graphs' collectives are ordered on the compute stream",
    "sync_after_allgather": "the graphs' collectives are ordered on the compute stream",
    "keep_int_input_tensors": "DeepSpeed's input profiling; the compiled graphs take real inputs",
    "keep_all_input_tensors": "DeepSpeed's input profiling; the compiled graphs take real inputs",
}
NO_EFFECT.update({f"compile.{key}": why for key, why in _DEEPCOMPILE_TUNING.items()})

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
