"""DeepSpeed names this tree does not implement: each fails where it is used, with the
feature it belongs to and what to use instead, never with an ``AttributeError`` deep
inside the library that reached for it.

Functions and classes DeepSpeed has but shardtrain does not are defined as stand-ins
(:func:`unsupported_function`, :func:`unsupported_class`): importing them works, so a
library that imports eagerly and uses a feature only when configured is not stopped;
calling or instantiating one raises ``NotImplementedError``. Whole modules are refused at
import time (:func:`missing_module_message`), with ``ModuleNotFoundError``, an
``ImportError`` that libraries probing for optional parts already catch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

_DOC = "docs/deepspeed_compat.md lists what the alias provides"

_DOCS_PARALLEL = "docs/parallelism.md"
#: what to use instead of pipeline parallelism while it is not provided
FIT_A_LARGE_MODEL = ("ZeRO stage 3 (shards every weight) or tensor parallelism "
                     "(tensor_parallel.autotp_size in the config) to fit a large model")
_MOE = ("DeepSpeed's MoE internals beyond layer, experts, sharded_moe and utils",
        "deepspeed.moe.layer.MoE (shardtrain.moe), or the model's own MoE block trained at ZeRO "
        "stage 3 as a leaf module (set_z3_leaf_modules)")
_SP = ("Ulysses sequence parallelism from the config: sequence_parallel_size: S (the engine's loader "
       "gives each rank its slice of every sequence; engine.mpu has the groups); "
       f"shardtrain.parallel.enable_ulysses and shard_sequence outside the engine ({_DOCS_PARALLEL})")
_TP = ("AutoTP from the config: tensor_parallel.autotp_size (with preset_model or "
       "partition_config.layer_specs); shardtrain.parallel.apply_autotp outside the engine "
       f"({_DOCS_PARALLEL})")

#: DeepSpeed module prefixes -> (the feature, what to use instead). A module at or below a
#: prefix that this tree does not have is refused with that reason; a prefix may also be a
#: package the tree provides in part (``deepspeed.moe``: ``layer``, ``experts``,
#: ``sharded_moe`` and ``utils`` are there, the rest is refused). Lifting a refusal is adding
#: the module and removing its entry.
MISSING_MODULES: Dict[str, Tuple[str, str]] = {
    "deepspeed.inference": ("DeepSpeed-Inference (kernel injection, init_inference)",
                            "run the trained torch module directly, or torch.compile it"),
    "deepspeed.module_inject": ("kernel injection and DeepSpeed's AutoTP layer classes "
                                "(only module_inject.layers.set_autotp_mode is provided)", _TP),
    "deepspeed.runtime.pipe.schedule": ("DeepSpeed's pipeline instruction classes "
                                        "(TrainSchedule, PipeInstruction)",
                                        "the pipeline block's schedule key"),
    "deepspeed.runtime.pipe.p2p": ("DeepSpeed's pipeline send/recv helpers",
                                   "shardtrain.comm.send and shardtrain.comm.recv"),
    "deepspeed.moe": _MOE,
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": (
        "DeepSpeed's sequence-parallel group registry (parallel_state_sp)", _SP),
    "deepspeed.sequence": ("DeepSpeed's sequence-parallel layers (DistributedAttention, FPDT)", _SP),
    "deepspeed.runtime.tensor_parallel": ("DeepSpeed's AutoTP internals (TpTrainingManager, "
                                          "its config objects)", _TP),
    "deepspeed.ops.transformer": ("DeepSpeed's fused transformer kernels",
                                  "the model's own layers (torch.nn.functional.scaled_dot_product_attention)"),
    "deepspeed.ops.op_builder": ("compiled DeepSpeed ops", "nothing is compiled: the optimizers "
                                 "under deepspeed.ops are torch optimizers"),
    "deepspeed.ops.aio": ("NVMe offload (async I/O)", "offload to CPU memory (offload_optimizer, offload_param)"),
    "deepspeed.nvme": ("NVMe offload", "offload to CPU memory (offload_optimizer, offload_param)"),
    "deepspeed.compile": ("DeepCompile's pass modules", "engine.compile() with compile.deepcompile "
                          "true, and schedule=[(step, [pass names])] for its passes"),
    "deepspeed.autotuning": ("DeepSpeed's autotuner", "`shardtrain autotune`"),
    "deepspeed.elasticity": ("elastic batch sizes (removed from DeepSpeed too)",
                             "fixed batch keys; `shardtrain run --max-restarts` for elastic restarts"),
    "deepspeed.linear": ("OptimizedLinear (LoRA and quantisation)", "peft or torch.nn.Linear"),
    "deepspeed.profiling": ("DeepSpeed's FLOPs profiler API",
                            "the flops_profiler config block (shardtrain measures it)"),
    "deepspeed.monitor": ("DeepSpeed's monitor classes",
                          "the tensorboard / csv_monitor / wandb config blocks and engine.log_metrics()"),
    "deepspeed.runtime.hybrid_engine": ("the hybrid engine (RLHF generation)", "engine.module.generate()"),
    "deepspeed.checkpoint.ds_to_universal": ("universal checkpoints",
                                             "shardtrain checkpoints load on any world size and stage as they are"),
    "deepspeed.checkpoint.universal_checkpoint": (
        "universal checkpoints", "shardtrain checkpoints load on any world size and stage as they are"),
}


def is_listed_missing(name: str) -> bool:
    """Whether ``deepspeed.X`` is a module of :data:`MISSING_MODULES` (or below one)."""
    return any(name == p or name.startswith(p + ".") for p in MISSING_MODULES)


def _lookup(name: str) -> Tuple[str, str]:
    for prefix in sorted(MISSING_MODULES, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return MISSING_MODULES[prefix]
    return ("", "")


def missing_module_message(name: str) -> str:
    """The message of the ``ModuleNotFoundError`` for a module that is not provided."""
    feature, instead = _lookup(name)
    if not feature:
        return (f"No module named {name!r}: shardtrain's DeepSpeed alias does not provide it "
                f"({_DOC}).")
    return (f"No module named {name!r}: shardtrain's DeepSpeed alias does not provide {feature}. "
            f"Instead: {instead} ({_DOC}).")


def _message(qualname: str, feature: str, instead: str) -> str:
    return (f"{qualname} ({feature}) is not provided by shardtrain's DeepSpeed alias. "
            f"Instead: {instead}.")


def unsupported_function(qualname: str, feature: str, instead: str) -> Callable[..., Any]:
    """A function that raises ``NotImplementedError`` naming ``feature`` when called."""
    message = _message(qualname, feature, instead)

    def unsupported(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    unsupported.__name__ = unsupported.__qualname__ = qualname.rpartition(".")[2]
    unsupported.__doc__ = message
    return unsupported


def unsupported_class(qualname: str, feature: str, instead: str) -> type:
    """A class whose construction raises ``NotImplementedError`` naming ``feature``;
    ``isinstance(x, cls)`` is simply False for everything."""
    message = _message(qualname, feature, instead)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(message)

    name = qualname.rpartition(".")[2]
    return type(name, (), {"__init__": __init__, "__doc__": message,
                           "__module__": qualname.rpartition(".")[0]})
