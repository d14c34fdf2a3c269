"""``deepspeed.utils.zero_to_fp32``: full fp32 weights from a checkpoint, in one CPU
process, whatever world size and ZeRO stage saved it (over
:func:`shardtrain.checkpoint.full_weights`). The checkpoint is shardtrain's format, as
``engine.save_checkpoint`` writes it; DeepSpeed's own checkpoint files do not load here.

Example:
    >>> from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    >>> model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("checkpoints"))
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Union

import torch

from ...checkpoint import full_weights
from ...files import write_weights

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> Dict[str, torch.Tensor]:
    """The full weights (fp32 from the masters in 16-bit training; buffers as saved).

    ``lazy_mode`` is accepted and changes nothing (the tensors are read at once).
    """
    del lazy_mode
    return full_weights(checkpoint_dir, tag, dtype="fp32",
                        exclude_frozen_parameters=exclude_frozen_parameters)


def _size(text: Union[int, str]) -> int:
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text).upper())
    if not match:
        raise ValueError(f"max_shard_size {text!r}: expected bytes or e.g. '5GB'")
    return int(float(match.group(1)) * 1000 ** " KMGT".index(match.group(2) or " "))


def _shards(state: Dict[str, torch.Tensor], limit: int) -> List[Dict[str, torch.Tensor]]:
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: Union[int, str] = "5GB",
                                               safe_serialization: bool = False,
                                               tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Writes the fp32 weights into ``output_dir`` as ``pytorch_model.bin`` (or
    ``model.safetensors``), split into shards of at most ``max_shard_size`` with a
    Hugging Face index file when they do not fit one."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    ext = "safetensors" if safe_serialization else "bin"
    base = "model" if safe_serialization else "pytorch_model"
    shards = _shards(state, _size(max_shard_size))
    if len(shards) == 1:
        write_weights(shards[0], os.path.join(output_dir, f"{base}.{ext}"))
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{base}-{i:05d}-of-{len(shards):05d}.{ext}"
        write_weights(shard, os.path.join(output_dir, name))
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    with open(os.path.join(output_dir, f"{base}.{ext}.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Loads the checkpoint's fp32 weights into ``model`` (moved to the CPU first) and
    returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
