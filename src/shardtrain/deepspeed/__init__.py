"""DeepSpeed's module tree over shardtrain: the package ``import deepspeed`` gives once the
alias is installed (``shardtrain deepspeed-alias install``).

Every name is shardtrain's own object (``deepspeed.DeepSpeedEngine is shardtrain.Engine``,
``deepspeed.zero.ZeroParamStatus is shardtrain.zero.ZeroParamStatus``; ``initialize`` is
shardtrain's, with DeepSpeed's local ZeRO-3 ``state_dict()`` on the engine it builds), laid out by
DeepSpeed 0.19.8's module paths so that libraries which import deepspeed themselves (the
Hugging Face Trainer, Accelerate, Lightning) and DeepSpeed's example scripts run unchanged.
A DeepSpeed name shardtrain does not implement fails where it is used, with the feature it
belongs to and the alternative (:mod:`._missing`). The tree is listed in
``docs/deepspeed_compat.md``.

Without the alias the same tree is importable as ``shardtrain.deepspeed``.

Example:
    >>> import deepspeed                      # the alias: shardtrain.deepspeed
    >>> engine, optimizer, _, scheduler = deepspeed.initialize(
    ...     model=model, model_parameters=model.parameters(), config="ds_config.json")
"""
from typing import Any, Tuple

from .. import Engine as DeepSpeedEngine
from .. import add_config_arguments, init_distributed
from .. import initialize as _initialize
from ..zero import set_state_dict_gather
from ..cli import DEEPSPEED_VERSION, alias_version
from ..log import log_dist, log_dist_once, logger
from . import (accelerator, checkpoint, comm, compression, launcher, moe, module_inject, ops, pipe,
               runtime, utils)
from ._autotp import tp_model_init
from ._missing import unsupported_class, unsupported_function
from .accelerator import get_accelerator
from .module_inject import replace_transformer_layer, set_autotp_mode
from .runtime import zero
from .runtime.activation_checkpointing import checkpointing
from .runtime.base_optimizer import DeepSpeedOptimizer
from .runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from .runtime.engine import DeepSpeedOptimizerCallable, DeepSpeedSchedulerCallable
from .runtime.pipe.engine import PipelineEngine
from .runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
from .pipe import PipelineModule
from .utils import OnDevice



def initialize(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``shardtrain.initialize`` with DeepSpeed's ZeRO-3 ``module.state_dict()``: local, the
    partitioned parameters as empty placeholders (whole inside ``GatheredParameters``), so that
    code written for DeepSpeed may read it on one rank alone (OpenRLHF's ``save_model`` reads
    its keys on rank 0). shardtrain's own ``initialize`` gathers the full values instead
    (``shardtrain.zero.set_state_dict_gather`` switches either engine)."""
    engine, optimizer, loader, scheduler = _initialize(*args, **kwargs)
    set_state_dict_gather(engine.module, False)
    return engine, optimizer, loader, scheduler


__version__ = alias_version()
version = __version__
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_VERSION.split("."))
__git_hash__ = git_hash = None
__git_branch__ = git_branch = None

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

init_inference = unsupported_function("deepspeed.init_inference", "DeepSpeed-Inference",
                                      "run the trained module directly, or torch.compile it")
default_inference_config = unsupported_function("deepspeed.default_inference_config",
                                                "DeepSpeed-Inference", "run the module directly")
InferenceEngine = unsupported_class("deepspeed.InferenceEngine", "DeepSpeed-Inference",
                                    "run the trained module directly")
DeepSpeedInferenceConfig = unsupported_class("deepspeed.DeepSpeedInferenceConfig",
                                             "DeepSpeed-Inference", "run the module directly")
DeepSpeedHybridEngine = unsupported_class("deepspeed.DeepSpeedHybridEngine",
                                          "the hybrid engine (RLHF generation)",
                                          "engine.module.generate()")
DeepSpeedTransformerLayer = unsupported_class("deepspeed.DeepSpeedTransformerLayer",
                                              "DeepSpeed's fused transformer kernels",
                                              "the model's own layers")
DeepSpeedTransformerConfig = unsupported_class("deepspeed.DeepSpeedTransformerConfig",
                                               "DeepSpeed's fused transformer kernels",
                                               "the model's own layers")

__all__ = [
    "initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine",
    "DeepSpeedOptimizer", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedOptimizerCallable",
    "DeepSpeedSchedulerCallable", "get_accelerator", "zero", "comm", "checkpointing", "ops",
    "runtime", "utils", "pipe", "accelerator", "checkpoint", "launcher", "moe", "module_inject",
    "compression", "log_dist",
    "log_dist_once", "logger", "OnDevice", "TORCH_DISTRIBUTED_DEFAULT_PORT", "__version__",
    "version", "git_hash", "git_branch", "init_inference", "default_inference_config",
    "tp_model_init", "set_autotp_mode", "replace_transformer_layer", "PipelineModule",
    "PipelineEngine", "DualPipeVEngine", "DualPipeVModule", "InferenceEngine",
    "DeepSpeedInferenceConfig", "DeepSpeedHybridEngine", "DeepSpeedTransformerLayer",
    "DeepSpeedTransformerConfig",
]
