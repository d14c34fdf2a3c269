"""The ``tensor_parallel`` config block, read and checked before the model is touched.

Key names and defaults are DeepSpeed's AutoTP training ones, so that a DeepSpeed config
works unchanged::

    "tensor_parallel": {
        "autotp_size": 2,
        "preset_model": "llama",
        "partition_config": {
            "use_default_specs": true,
            "strict_mode": false,
            "lm_head_patterns": ["lm_head", "embed_out"],
            "layer_specs": [
                {"patterns": [".*\\\\.gate_up_proj\\\\.weight$"], "partition_type": "column",
                 "shape": [2, -1], "partition_dim": 0}
            ]
        }
    }

A layer spec's ``shape`` describes the parameter's own dimensions: at ``partition_dim`` a
count of equal fused sub-parameters (``2``), their sizes (``[q, k, v]``) or ``-1`` (one);
elsewhere ``-1`` or the actual size. Every mistake raises ValueError naming the key, the
value and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..layout import SplitSpec

_BLOCK = "tensor_parallel"
_PARTITION = f"{_BLOCK}.partition_config"
_BLOCK_KEYS = ("autotp_size", "preset_model", "partition_config", "tp_overlap_comm")
_PARTITION_KEYS = ("layer_specs", "use_default_specs", "strict_mode", "lm_head_patterns")
_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "gather_output",
              "model_types")
_TYPES = ("column", "row", "skip")
DEFAULT_LM_HEAD_PATTERNS = ("lm_head", "embed_out")

ShapeEntry = Union[int, Tuple[int, ...]]


@dataclass(frozen=True)
class LayerSpec:
    """One rule: parameters whose name ``re.match``-es a pattern are split this way."""

    patterns: Tuple[str, ...]
    partition_type: str = "column"
    shape: Optional[Tuple[ShapeEntry, ...]] = None
    partition_dim: Optional[int] = None
    gather_output: bool = False
    model_types: Optional[Tuple[str, ...]] = None
    where: str = "a layer spec"  # for messages: the config key or the preset

    @property
    def dim(self) -> int:
        """The dimension split: ``partition_dim``, else 0 for column and 1 for row."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == "column" else 1

    def applies_to(self, model_type: Optional[str]) -> bool:
        if not self.model_types:
            return True
        return model_type is not None and model_type.lower() in {m.lower() for m in self.model_types}

    def matches(self, name: str) -> bool:
        return any(re.match(p, name) for p in self.patterns)

    def split_for(self, name: str, shape: Sequence[int]) -> SplitSpec:
        """How this rule splits the parameter ``name`` of full ``shape``."""
        shape = tuple(shape)
        if self.dim >= len(shape):
            raise ValueError(f"{self.where} splits dim {self.dim} of {name}, which has shape "
                             f"{shape}: set partition_dim to one of 0..{len(shape) - 1}.")
        if self.shape is None:
            return SplitSpec(self.dim, (shape[self.dim],))
        if len(self.shape) != len(shape):
            raise ValueError(f"{self.where}: shape {list(self.shape)} has {len(self.shape)} dims "
                             f"but {name} has shape {shape}: give one entry per dimension of the "
                             f"parameter (-1 where any size goes); reshaping is not supported.")
        for i, (want, have) in enumerate(zip(self.shape, shape)):
            if i != self.dim and want not in (-1, have):
                raise ValueError(f"{self.where}: shape {list(self.shape)} expects size {want} at "
                                 f"dim {i} of {name}, which has shape {shape}: use -1 there.")
        return SplitSpec(self.dim, self._parts(name, shape))

    def _parts(self, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        entry, size = self.shape[self.dim], shape[self.dim]
        if isinstance(entry, tuple):
            if sum(entry) != size:
                raise ValueError(f"{self.where}: sub-parameter sizes {list(entry)} sum to "
                                 f"{sum(entry)}, but {name} {shape} has {size} along dim "
                                 f"{self.dim}: give sizes that sum to {size}.")
            return entry
        if entry == -1:
            return (size,)
        if size % entry:
            raise ValueError(f"{self.where}: {name} {shape} has {size} along dim {self.dim}, "
                             f"not divisible into {entry} equal sub-parameters: fix the count "
                             f"at dim {self.dim} of shape.")
        return (size // entry,) * entry


@dataclass(frozen=True)
class AutoTPConfig:
    """The checked ``tensor_parallel`` block."""

    autotp_size: Optional[int] = None
    preset_model: Optional[str] = None
    layer_specs: Tuple[LayerSpec, ...] = ()
    use_default_specs: bool = True
    strict_mode: bool = False
    lm_head_patterns: Tuple[str, ...] = DEFAULT_LM_HEAD_PATTERNS
    tp_overlap_comm: bool = False


def parse_block(block: Dict[str, Any], presets: Sequence[str]) -> AutoTPConfig:
    """Reads and checks the ``tensor_parallel`` block (``presets``: the known preset names)."""
    _check_dict(block, _BLOCK, _BLOCK_KEYS)
    partition = block.get("partition_config") or {}
    _check_dict(partition, _PARTITION, _PARTITION_KEYS)
    specs = block_specs(partition.get("layer_specs", []))
    heads = _strings(partition.get("lm_head_patterns", list(DEFAULT_LM_HEAD_PATTERNS)),
                     f"{_PARTITION}.lm_head_patterns")
    return AutoTPConfig(
        autotp_size=_size(block.get("autotp_size")),
        preset_model=_preset(block.get("preset_model"), presets),
        layer_specs=specs,
        use_default_specs=_flag(partition, "use_default_specs", True, _PARTITION),
        strict_mode=_flag(partition, "strict_mode", False, _PARTITION),
        lm_head_patterns=heads,
        tp_overlap_comm=_flag(block, "tp_overlap_comm", False, _BLOCK))


def block_specs(raw: Any) -> Tuple[LayerSpec, ...]:
    key = f"{_PARTITION}.layer_specs"
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{key} must be a list of layer specs, got {raw!r}.")
    return tuple(_layer_spec(item, f"{key}[{i}]") for i, item in enumerate(raw))


def _layer_spec(raw: Any, key: str) -> LayerSpec:
    _check_dict(raw, key, _SPEC_KEYS)
    kind = raw.get("partition_type", "column")
    if not isinstance(kind, str) or kind.lower() not in _TYPES:
        raise ValueError(f"{key}.partition_type is {kind!r}: use one of {', '.join(_TYPES)}.")
    kind = kind.lower()
    dim = raw.get("partition_dim")
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 0):
        raise ValueError(f"{key}.partition_dim is {dim!r}: use a non-negative integer, or leave "
                         "it out (0 for column, 1 for row).")
    gather = _flag(raw, "gather_output", False, key)
    if gather and kind != "column":
        raise ValueError(f"{key}.gather_output is true for a {kind!r} spec: only column-parallel "
                         "outputs can be gathered; remove gather_output.")
    types = raw.get("model_types")
    spec = LayerSpec(patterns=_patterns(raw.get("patterns"), f"{key}.patterns"),
                     partition_type=kind, partition_dim=dim, gather_output=gather,
                     model_types=None if types is None else _strings(types, f"{key}.model_types"),
                     where=key)
    shape = raw.get("shape")
    return spec if shape is None else _with_shape(spec, shape, f"{key}.shape")


def _with_shape(spec: LayerSpec, shape: Any, key: str) -> LayerSpec:
    if not isinstance(shape, (list, tuple)) or not shape:
        raise ValueError(f"{key} is {shape!r}: use a list with one entry per dimension, e.g. "
                         "[2, -1] or [[q, k, v], -1].")
    if spec.dim >= len(shape):
        raise ValueError(f"{key} {list(shape)} has no dim {spec.dim} to split: set partition_dim "
                         f"below {len(shape)} or give one entry per dimension.")
    entries = []
    for i, entry in enumerate(shape):
        if isinstance(entry, (list, tuple)):
            if i != spec.dim or not entry or any(not _positive(v) for v in entry):
                raise ValueError(f"{key} {list(shape)}: a list of sizes is allowed only at the "
                                 f"partition dim {spec.dim}, and must hold positive integers.")
            entries.append(tuple(entry))
        elif _positive(entry) or (_integer(entry) and entry == -1):
            entries.append(entry)
        else:
            raise ValueError(f"{key} {list(shape)}: entry {entry!r} must be a positive integer "
                             "or -1.")
    return LayerSpec(spec.patterns, spec.partition_type, tuple(entries), spec.partition_dim,
                     spec.gather_output, spec.model_types, spec.where)


def _check_dict(raw: Any, key: str, known: Sequence[str]) -> None:
    if not isinstance(raw, dict):
        raise ValueError(f"{key} must be a JSON object, got {raw!r}.")
    for name, value in raw.items():
        if name not in known:
            raise ValueError(f"{key}.{name} (= {value!r}) is not a known key: use one of "
                             f"{', '.join(known)}.")


def _patterns(raw: Any, key: str) -> Tuple[str, ...]:
    patterns = _strings(raw, key)
    if not patterns:
        raise ValueError(f"{key} is empty: give at least one regular expression matched against "
                         "parameter names, e.g. '.*\\\\.q_proj\\\\.weight$'.")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as err:
            raise ValueError(f"{key}: {p!r} is not a valid regular expression ({err}).") from err
    return patterns


def _strings(raw: Any, key: str) -> Tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or any(not isinstance(s, str) for s in raw):
        raise ValueError(f"{key} must be a list of strings, got {raw!r}.")
    return tuple(raw)


def _flag(raw: Dict[str, Any], name: str, default: bool, key: str) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}.{name} is {value!r}: use true or false.")
    return value


def _size(value: Any) -> Optional[int]:
    if value is not None and (not _positive(value)):
        raise ValueError(f"{_BLOCK}.autotp_size is {value!r}: use a positive integer (the "
                         "tensor-parallel group's size).")
    return value


def _preset(value: Any, presets: Sequence[str]) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in presets:
        raise ValueError(f"{_BLOCK}.preset_model is {value!r}: use one of {', '.join(presets)}, "
                         f"or leave it out and give {_PARTITION}.layer_specs.")
    return value.lower()


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _integer(value) and value > 0
