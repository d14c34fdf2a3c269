"""Checkpoints that hold each expert apart, loaded into experts stacked in one weight.

transformers (since v5) builds a MoE block's experts as weights of shape ``(experts, ...)``:
``experts.gate_up_proj`` (each expert's gate and up projections concatenated along their
output dimension) and ``experts.down_proj``. The checkpoints on the Hugging Face Hub hold one
module per expert instead, and ``from_pretrained`` converts them as it loads:

* most families (Qwen2/Qwen3-MoE, DeepSeek-V2/V3, OLMoE, ...):
  ``...mlp.experts.<e>.gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``;
* Mixtral: ``...block_sparse_moe.experts.<e>.w1.weight`` (gate), ``w3`` (up), ``w2``
  (down), and the whole block under ``block_sparse_moe`` where the model has ``mlp``
  (its router ``block_sparse_moe.gate.weight``).

:func:`per_expert_sources` names, for a stacked weight, the file's tensors of each expert
(concatenated along their first dimension, they are that expert's row); :func:`renamed`
the file's name of a tensor kept under Mixtral's block name. A rank whose experts are split
over an expert-parallel group reads only its own experts' tensors.
"""
from __future__ import annotations

from typing import Dict, List, Optional

#: A stacked weight's name after ``experts.``, and the per-expert weights it joins (in
#: order), in each checkpoint family's names.
_STACKED: Dict[str, tuple] = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
                              "down_proj": (("down_proj",), ("w2",))}
_BLOCK, _MIXTRAL_BLOCK = ".mlp", ".block_sparse_moe"

__all__ = ["per_expert_sources", "renamed"]


def per_expert_sources(name: str, num_experts: int, tensors: Dict[str, object]
                       ) -> Optional[List[List[str]]]:
    """For the stacked weight ``name`` (``<block>.experts.gate_up_proj`` or ``down_proj``), the
    names in ``tensors`` of each expert's weights, expert by expert; None when the file does
    not hold all of them in one family's names."""
    head, sep, leaf = name.rpartition(".experts.")
    if not sep or leaf not in _STACKED:
        return None
    heads = [head]
    if head.endswith(_BLOCK):
        heads.append(head[: -len(_BLOCK)] + _MIXTRAL_BLOCK)
    for block in heads:
        for names in _STACKED[leaf]:
            parts = [[f"{block}.experts.{e}.{n}.weight" for n in names]
                     for e in range(num_experts)]
            if all(p in tensors for expert in parts for p in expert):
                return parts
    return None


def renamed(name: str, tensors: Dict[str, object]) -> Optional[str]:
    """The file's name of ``name`` when the file keeps the block under Mixtral's name."""
    alt = name.replace(f"{_BLOCK}.", f"{_MIXTRAL_BLOCK}.", 1)
    return alt if alt != name and alt in tensors else None
