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

#: DeepSpeed module prefixes that are not provided -> (feature, what to use instead).
MISSING_MODULES: Dict[str, Tuple[str, str]] = {
    "deepspeed.inference": ("DeepSpeed-Inference (kernel injection, init_inference)",
                            "run the trained torch module directly, or torch.compile it"),
    "deepspeed.module_inject": ("kernel injection and automatic tensor parallelism",
                                "the model's own torch modules"),
    "deepspeed.pipe": ("pipeline parallelism (PipelineModule)", "ZeRO stage 3 to fit a large model"),
    "deepspeed.runtime.pipe": ("pipeline parallelism (PipelineEngine)",
                               "ZeRO stage 3 to fit a large model"),
    "deepspeed.runtime.sequence_parallel": ("Ulysses sequence parallelism",
                                            "data parallelism with ZeRO; sequence parallelism is planned"),
    "deepspeed.sequence": ("sequence parallelism", "data parallelism with ZeRO"),
    "deepspeed.runtime.tensor_parallel": ("tensor parallelism (autotp)",
                                          "ZeRO stage 3; tensor parallelism is planned"),
    "deepspeed.utils.groups": ("model-, expert- and sequence-parallel process groups",
                               "shardtrain has one data-parallel group: deepspeed.comm with group=None"),
    "deepspeed.ops.transformer": ("DeepSpeed's fused transformer kernels",
                                  "the model's own layers (torch.nn.functional.scaled_dot_product_attention)"),
    "deepspeed.ops.op_builder": ("compiled DeepSpeed ops", "nothing is compiled: the optimizers "
                                 "under deepspeed.ops are torch optimizers"),
    "deepspeed.ops.aio": ("NVMe offload (async I/O)", "offload to CPU memory (offload_optimizer, offload_param)"),
    "deepspeed.nvme": ("NVMe offload", "offload to CPU memory (offload_optimizer, offload_param)"),
    "deepspeed.compile": ("DeepCompile", "engine.compile() (torch.compile at every ZeRO stage)"),
    "deepspeed.autotuning": ("DeepSpeed's autotuner", "`shardtrain autotune`"),
    "deepspeed.elasticity": ("elastic batch sizes (removed from DeepSpeed too)",
                             "fixed batch keys; `shardtrain run --max-restarts` for elastic restarts"),
    "deepspeed.moe.layer": ("DeepSpeed's MoE layer with expert parallelism",
                            "the model's own MoE block as a ZeRO-3 leaf module (set_z3_leaf_modules)"),
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
