"""The configs the autotuner writes: the user's config with the micro-batch and ZeRO stage of
a run set; for a measured run, everything that would disturb the measure (monitors, the FLOPs
profiler) off."""
from __future__ import annotations

import copy
from typing import Any, Dict


def base_config(raw: Dict[str, Any], stage: int, micro_batch: int, gas: int) -> Dict[str, Any]:
    """The user's config with the micro-batch and stage set, monitors and profilers off."""
    config = copy.deepcopy(raw)
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = gas
    zero = config.get("zero_optimization")
    config["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
    for key in ("tensorboard", "csv_monitor", "jsonl_monitor", "flops_profiler"):
        if isinstance(config.get(key), dict):
            config[key] = {**config[key], "enabled": False}
    return config


def tuned_config(raw: Dict[str, Any], stage: int, micro_batch: int, gas: int, nproc: int) -> Dict[str, Any]:
    """The best configuration: the user's config with the chosen micro-batch and stage."""
    config = copy.deepcopy(raw)
    config.pop("autotuning", None)
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = gas
    config["train_batch_size"] = micro_batch * gas * nproc
    zero = config.get("zero_optimization")
    config["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "stage": stage}
    return config
