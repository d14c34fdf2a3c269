"""shardtrain: a distributed training engine for PyTorch.

One training script runs unchanged on one process, on N processes of one machine or on
many machines. The API and the JSON config follow DeepSpeed's names.

Example:
    >>> import shardtrain
    >>> engine, optimizer, loader, scheduler = shardtrain.initialize(
    ...     model=model, config="train.json", training_data=dataset)
    >>> for x, y in loader:
    ...     loss = engine(x, y)
    ...     engine.backward(loss)
    ...     engine.step()
"""
from __future__ import annotations

import argparse
from typing import Any, Optional, Tuple

import torch

from . import accelerator, checkpointing, comm, errors, utils, zero
from .comm import destroy, init_distributed
from .config import ConfigError, ShardConfig, load_config
from .engine import Engine
from .errors import InitializeError
from .log import log_dist, log_dist_once
from .pipe import PipelineModule
from .pipeline_engine import PipelineEngine
from .pretrained import load_pretrained

__version__ = "0.1.0"

__all__ = [
    "initialize", "init_distributed", "destroy", "Engine", "ShardConfig", "ConfigError",
    "load_config", "log_dist", "log_dist_once", "add_config_arguments", "comm", "accelerator",
    "zero", "checkpointing", "utils", "errors", "load_pretrained", "__version__",
]


def initialize(args: Optional[argparse.Namespace] = None, model: Optional[torch.nn.Module] = None,
               optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required: Optional[bool] = None,
               collate_fn=None, config=None, mesh_param=None, config_params=None
               ) -> Tuple[Engine, Any, Any, Any]:
    """Builds the training engine around ``model``.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` names the config file when
            ``config`` is not given (DeepSpeed scripts keep working).
        model: the ``torch.nn.Module`` to train.
        optimizer: a ``torch.optim.Optimizer``, a callable taking the parameters, or None to
            build the config's ``optimizer`` block.
        model_parameters: the parameters (or param groups) the optimizer updates; default
            all of the model's.
        training_data: a map-style dataset; a loader over this rank's share is returned.
        lr_scheduler: a scheduler, a callable taking the optimizer, or None for the config's
            ``scheduler`` block.
        collate_fn: for the returned loader.
        config: a dict, a path to a JSON (or hjson) file, or base64 JSON (``config_params``
            is an alias).
        mpu: DeepSpeed's model-parallel unit, for a model whose layers the caller split
            itself: an object with ``get_data_parallel_group()`` and
            ``get_model_parallel_group()`` (torch process groups); ZeRO then shards over its
            data-parallel group. Without it, the config's ``tensor_parallel`` and
            ``sequence_parallel_size`` build the mesh (``engine.mpu`` exposes it).
        mesh_param: DeepSpeed's device-mesh shape; the config's sizes say it here, so it
            must be None.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; the last three may be None.

    Example:
        >>> engine, opt, _, _ = shardtrain.initialize(
        ...     model=net, config={"train_micro_batch_size_per_gpu": 10,
        ...                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    """
    if model is None:
        raise InitializeError("initialize() needs model=: the torch.nn.Module to train.")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...): set the mesh in the config "
                                  "instead (tensor_parallel.autotp_size, "
                                  "sequence_parallel_size) and pass mesh_param=None.")
    config = _resolve_config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    dp = mpu.get_data_parallel_world_size() if mpu is not None and \
        hasattr(mpu, "get_data_parallel_world_size") else None
    stages = model.topology().get_dim("pipe") if isinstance(model, PipelineModule) else 1
    cfg = config if isinstance(config, ShardConfig) else \
        load_config(config, comm.get_world_size() // stages, data_parallel_world_size=dp)
    asked = cfg.pipeline.get("stages")
    if not isinstance(model, PipelineModule) and isinstance(asked, int) and asked > 1:
        # a Hugging Face causal LM, by its layers (two chunks a stage for the interleaved and
        # zero-bubble schedules)
        model = _split_into_stages(model, asked, str(cfg.pipeline.get("schedule", "1f1b")))
        model_parameters, optimizer = _on_this_stage(model, model_parameters, optimizer)
        stages = asked
        if not isinstance(config, ShardConfig):
            cfg = load_config(config, comm.get_world_size() // stages, data_parallel_world_size=dp)
    kind = Engine
    if isinstance(model, PipelineModule):  # the batch counts the data-parallel ranks of a stage
        model_axis = max(model.topology().get_dim("model"), 1)
        if model_axis > 1 and cfg.tensor_parallel_size() == 1 and not isinstance(config, ShardConfig):
            cfg = load_config(config, comm.get_world_size(),
                              data_parallel_world_size=comm.get_world_size() // (stages * model_axis))
        kind = PipelineEngine
    engine = kind(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                  lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn,
                  mpu=mpu)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # DeepSpeed overwrites it with the env value too
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _split_into_stages(model: torch.nn.Module, stages: int, schedule: str) -> PipelineModule:
    """``pipeline.stages`` > 1 for a model that is not a PipelineModule: a Hugging Face causal
    LM is split by its decoder layers; anything else is refused (DeepSpeed ignores the key)."""
    from .pipe import split_causal_lm
    chunks = 2 if schedule.lower() in ("interleaved", "zbv") else 1
    try:
        return split_causal_lm(model, num_stages=stages, virtual_stages=chunks,
                               chunk_placement="v" if schedule.lower() == "zbv" else "loop")
    except (NotImplementedError, TypeError) as err:
        raise InitializeError(
            f"the config asks for pipeline.stages {stages}, but the model is a "
            f"{type(model).__name__}, not a PipelineModule, and cannot be split by its layers "
            f"({err}). Build a shardtrain.pipe.PipelineModule of its layers, or remove "
            "pipeline.stages.") from None


def _on_this_stage(model: torch.nn.Module, model_parameters, optimizer):
    """The parameters (or parameter groups) and an optimizer's groups given before the split,
    without the layers other stages hold."""
    kept = {id(p) for p in model.parameters()}

    def keep(items):
        out = []
        for item in items:
            if isinstance(item, dict) and "params" in item:
                group = [item["params"]] if isinstance(item["params"], torch.Tensor) \
                    else list(item["params"])
                out.append({**item, "params": [p for p in group if id(p) in kept]})
            elif id(item) in kept:
                out.append(item)
        return out

    if model_parameters is not None:
        model_parameters = keep(list(model_parameters))
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept]
    return model_parameters, optimizer


def _resolve_config_source(args, config, config_params):
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise InitializeError("Two configs were given: --deepspeed_config on the command line and "
                              "config= in initialize(); keep one.")
    config = config if config is not None else from_args
    if config is None:
        raise InitializeError("initialize() needs a config: pass config=<dict or path to JSON>, "
                              "or --deepspeed_config <path> with args=.")
    return config


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's launcher arguments (``--deepspeed``, ``--deepspeed_config``, and the
    deprecated ``--deepscale``/``--deepscale_config``) so DeepSpeed scripts parse unchanged.

    Example:
        >>> parser = shardtrain.add_config_arguments(argparse.ArgumentParser())
        >>> args = parser.parse_args(["--deepspeed_config", "ds.json"])
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Flag for the script's own use (shardtrain ignores it).")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="Path to the JSON config.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated alias of --deepspeed.")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated alias of --deepspeed_config.")
    return parser
