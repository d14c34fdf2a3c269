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
