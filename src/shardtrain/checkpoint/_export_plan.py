"""What an export to the Hugging Face layout writes, planned from meta.json alone.

meta.json names every parameter and buffer with its shape, dtype and the pieces the rank files
hold, so the whole output (which tensor goes to which shard file, at which offset, in which
dtype; the index; config.json) is known before a byte of weights is read. The writer
(:mod:`._export`) then streams each shard's tensors after its header.

The layout is the one ``save_pretrained`` writes and ``from_pretrained`` reads:

* tensors in state-dict order (parameters, then persistent buffers), each tied weight once,
  under the name ``named_parameters()`` gives it first (``transformer.wte.weight``, not
  ``lm_head.weight``): ``from_pretrained`` ties the other name back;
* shards filled in that order up to ``max_shard_size`` bytes of tensor data, Hugging Face's
  rule (``huggingface_hub.split_torch_state_dict_into_shards``): a tensor larger than the
  limit gets a shard of its own, and the shard being filled carries on after it;
* one shard is ``model.safetensors`` with no index; several are
  ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``
  (``metadata.total_size``, ``metadata.total_parameters``, ``weight_map``);
* config.json from the model's configuration recorded at the save (meta.json's
  ``model_config``), with ``dtype`` set to the written dtype, as ``save_pretrained`` sets it.

The dtypes follow :func:`._consolidation.consolidate`: None keeps each saved dtype, ``fp32``
reads the fp32 masters of a 16-bit run, ``bf16``/``fp16`` cast floating-point parameters,
buffers keep theirs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..memory import parse_size
from ._format import dtype_from, dtype_name
from ._reading import entry_for, module_key

__all__ = ["Planned", "Plan", "plan_export", "shard_size_bytes", "SINGLE", "INDEX", "CONFIG"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


@dataclass(frozen=True)
class Planned:
    """One tensor of the output: its name there, the saved tensor it comes from (``param/``,
    ``master/`` or ``buffer/<name>``) with that tensor's meta.json entry, and how it is
    written."""

    name: str
    key: str
    entry: Dict[str, Any]
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Plan:
    """The output files: each shard's name and tensors in file order, the index (None for
    one shard) and config.json (None when the checkpoint recorded no model configuration)."""

    shards: List[Tuple[str, List[Planned]]]
    index: Optional[Dict[str, Any]]
    config: Optional[Dict[str, Any]]


def shard_size_bytes(value: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: a number of bytes or a size such as ``"5GB"`` (powers of
    1000, as Hugging Face reads it) or ``"4GiB"`` (powers of 1024)."""
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as error:
            raise ValueError(f"max_shard_size: {error}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_shard_size is {value!r}; give a positive number of bytes or a "
                         "size such as '5GB'.")
    return value


def plan_export(meta: Dict[str, Any], dtype: Optional[torch.dtype],
                max_shard_size: int) -> Plan:
    """The files an export of the checkpoint described by ``meta`` writes."""
    tensors = _planned(meta, dtype)
    groups = _split(tensors, max_shard_size)
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                     for k in range(n)]
    shards = list(zip(names, groups))
    index = _index(meta, shards) if n > 1 else None
    return Plan(shards, index, _config(meta, tensors))


def _planned(meta: Dict[str, Any], want: Optional[torch.dtype]) -> List[Planned]:
    """Every parameter (tied ones once), then every persistent buffer."""
    out = []
    for name, entry in meta["params"].items():
        key = module_key(entry, name, want) if want is not None else f"param/{name}"
        source = entry_for(entry, key)
        saved = dtype_from(source["dtype"], f"meta.json entry {key!r}")
        written = want if want is not None and saved.is_floating_point else saved
        out.append(Planned(name, key, source, written, tuple(entry["shape"])))
    for name, entry in meta["buffers"].items():
        saved = dtype_from(entry["dtype"], f"meta.json entry 'buffer/{name}'")
        out.append(Planned(name, f"buffer/{name}", entry, saved, tuple(entry["shape"])))
    return out


def _split(tensors: List[Planned], limit: int) -> List[List[Planned]]:
    """Hugging Face's rule: fill shards in order; a tensor over the limit gets its own."""
    shards: List[List[Planned]] = []
    current: List[Planned] = []
    size = 0
    for t in tensors:
        if t.nbytes > limit:
            shards.append([t])
            continue
        if current and size + t.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _index(meta: Dict[str, Any], shards: List[Tuple[str, List[Planned]]]) -> Dict[str, Any]:
    total_size = sum(t.nbytes for _, group in shards for t in group)
    parameters = sum(int(e["numel"]) for e in meta["params"].values())
    return {"metadata": {"total_parameters": parameters, "total_size": total_size},
            "weight_map": {t.name: name for name, group in shards for t in group}}


def _config(meta: Dict[str, Any], tensors: List[Planned]) -> Optional[Dict[str, Any]]:
    """The recorded model configuration, with the dtype of the first floating-point
    parameter written (what ``save_pretrained`` records as the model's dtype)."""
    config = meta.get("model_config")
    if not isinstance(config, dict):
        return None
    floating = [t.dtype for t in tensors if not t.key.startswith("buffer/")
                and t.dtype.is_floating_point]
    if not floating:
        return dict(config)
    name = dtype_name(floating[0])
    config = dict(config, dtype=name)
    if "torch_dtype" in config:  # written by transformers before 4.56: keep the two agreeing
        config["torch_dtype"] = name
    return config
