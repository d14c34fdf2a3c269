"""Model factories for ``shardtrain estimate``: callables that return an ``nn.Module``.

    shardtrain estimate --model examples/models.py:gpt_small --nproc 8
    shardtrain estimate --model examples/models.py:gpt --model-kwargs '{"n_layer": 24, "n_embd": 2048}'

``estimate`` calls the factory under ``torch.device("meta")``, so even a model far larger than
this machine's memory is "built" in an instant without allocating its weights.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt as _gpt  # noqa: E402  (the example model, next to this file)


def gpt_tiny() -> _gpt.GPT:
    """The unit-test GPT: 28,512 parameters."""
    return _gpt.GPT(_gpt.gpt_config("tiny"))


def gpt_demo() -> _gpt.GPT:
    """The demo GPT of examples/train_gpt.py: 611,200 parameters."""
    return _gpt.GPT(_gpt.gpt_config("demo"))


def gpt_small() -> _gpt.GPT:
    """The benchmark GPT: 3,997,440 parameters."""
    return _gpt.GPT(_gpt.gpt_config("small"))


def gpt(preset: str = "demo", **overrides: Any) -> _gpt.GPT:
    """A GPT from a preset ("tiny", "demo", "small") with fields replaced, e.g.
    ``gpt(n_layer=24, n_embd=2048, n_head=16, block_size=1024)``."""
    return _gpt.GPT(_gpt.gpt_config(preset, **overrides))


def llama(**overrides: Any) -> Any:
    """A Hugging Face ``LlamaForCausalLM`` from a config (needs ``transformers``); the fields
    default to Llama-3-8B's (8.03 billion parameters), e.g.
    ``shardtrain estimate --model examples/models.py:llama --nproc 8 --tensor-parallel 2``.
    AutoTP splits it by the llama preset (its ``model_type``)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fields = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, tie_word_embeddings=False)
    fields.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**fields))


def moe(hidden: int = 1024, experts: int = 8, layers: int = 8, vocab: int = 32000,
        ep_size: int = 1, k: int = 2) -> Any:
    """A stack of mixture-of-experts layers (``shardtrain.moe.MoE``: ``experts`` MLPs of width
    4 x ``hidden`` each, top-``k``) between a token embedding and a head; with ``ep_size`` > 1
    each rank builds ``experts / ep_size`` of them, as training would, e.g.
    ``shardtrain estimate --model examples/models.py:moe --model-kwargs '{"ep_size": 4}' --nproc 8``.
    """
    import torch
    from shardtrain.moe import MoE

    def expert():
        return torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                   torch.nn.Linear(4 * hidden, hidden))
    blocks = [MoE(hidden, expert(), num_experts=experts, ep_size=ep_size, k=k)
              for _ in range(layers)]
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(vocab, hidden),
                                "blocks": torch.nn.ModuleList(blocks),
                                "head": torch.nn.Linear(hidden, vocab, bias=False)})


def mixtral(hidden: int = 4096, ffn: int = 14336, experts: int = 8, layers: int = 32,
            vocab: int = 32000, heads: int = 32, kv_heads: int = 8) -> Any:
    """transformers' ``MixtralForCausalLM`` (Mixtral-8x7B's shape by default), whose experts
    AutoEP splits, e.g. ``shardtrain estimate --model examples/models.py:mixtral --nproc 8
    --expert-parallel 8`` (or ``--config`` with an ``expert_parallel`` block)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=2))
