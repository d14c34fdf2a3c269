"""Built-in AutoTP rules for model families (DeepSpeed's presets, by ``model_type``).

The patterns are DeepSpeed's. Two families needed more than its table:

* ``phi3``: ``qkv_proj`` fuses q, k and v, which are unequal under grouped-query
  attention; the sizes are read from the model's config (DeepSpeed's ``(3, -1)`` would give
  a rank q rows where k should be). Without those config fields, ``(3, -1)`` is used.
* ``mixtral``: Transformers 5 builds the experts as two fused 3-D parameters,
  ``mlp.experts.gate_up_proj`` ``[experts, 2 * ffn, hidden]`` and ``mlp.experts.down_proj``
  ``[experts, hidden, ffn]``, and the router as ``mlp.gate.weight``; DeepSpeed's patterns
  (per-expert ``block_sparse_moe.experts.N.w1/w2/w3`` Linears) are kept for older layouts.

``mistral`` and ``qwen2`` use the llama rules.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ._autotp_config import LayerSpec


def _spec(kind: str, *patterns: str, **options: Any) -> LayerSpec:
    return LayerSpec(patterns=patterns, partition_type=kind, where="the preset's rule "
                     f"{list(patterns)}", **options)


_ATTENTION = (_spec("row", r".*\.self_attn\.o_proj\.weight$"),
              _spec("column", r".*\.self_attn\.[qkv]_proj\.weight$"))
_MLP = (_spec("row", r".*\.mlp\.down_proj\.weight$"),
        _spec("column", r".*\.mlp\.(up|gate)_proj\.weight$"))


def _llama(config: Any) -> Tuple[LayerSpec, ...]:
    return _ATTENTION + _MLP


def _mixtral(config: Any) -> Tuple[LayerSpec, ...]:
    legacy = (_spec("row", r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
              _spec("column", r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
              _spec("skip", r".*\.block_sparse_moe\.gate\.weight$"))
    fused = (_spec("column", r".*\.mlp\.experts\.gate_up_proj$", shape=(-1, 2, -1),
                   partition_dim=1),
             _spec("row", r".*\.mlp\.experts\.down_proj$", partition_dim=2),
             _spec("skip", r".*\.mlp\.gate\.weight$"))
    return _ATTENTION + legacy + fused


def _qkv_sizes(config: Any) -> Optional[Tuple[int, int, int]]:
    """q, k and v rows of a fused GQA projection, from a Hugging Face config."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    if not heads or not hidden:
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def _phi3(config: Any) -> Tuple[LayerSpec, ...]:
    sizes = _qkv_sizes(config)
    return (_spec("row", r".*\.self_attn\.o_proj\.weight$"),
            _spec("column", r".*\.self_attn\.qkv_proj\.weight$",
                  shape=(sizes if sizes else 3, -1), partition_dim=0),
            _spec("row", r".*\.mlp\.down_proj\.weight$"),
            _spec("column", r".*\.mlp\.gate_up_proj\.weight$", shape=(2, -1), partition_dim=0))


PRESETS: Dict[str, Callable[[Any], Tuple[LayerSpec, ...]]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _llama, "mixtral": _mixtral, "phi3": _phi3}


def preset_specs(name: str, config: Any) -> Tuple[LayerSpec, ...]:
    """The rules of preset ``name`` for a model whose config is ``config`` (may be None)."""
    return PRESETS[name](config)
