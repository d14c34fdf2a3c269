"""The model, data and config of the DeepSpeed MoE fixtures (tests/fixtures/deepspeed_moe/).

``fixtures/deepspeed_moe/make_fixtures.py`` trains this model with the real DeepSpeed (its
``deepspeed.moe.layer.MoE`` with ``ep_size`` 2) and saves a checkpoint; the test suite builds the
same model through the ``deepspeed`` alias (shardtrain's layer) and the same data, imports the
checkpoint and continues. Top-2 routing without sampling and without dropping tokens, so both
route alike.

``mixtral`` and ``AUTOEP_*`` are the AutoEP fixture's (``fixtures/deepspeed_moe/autoep/``): a
tiny ``MixtralForCausalLM`` whose initial weights DeepSpeed's run saved (transformers' own
initialisation differs between its versions), trained with DeepSpeed's AutoEP over 2 ranks.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

M, EXPERTS, EP, MICRO, T, WORLD = 8, 4, 2, 2, 5, 2
SAVE_AT, CONTINUE = 2, 2  # steps before the save, steps after it


def config(stage: int) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01,
                                                      "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


class Net(torch.nn.Module):
    """A linear layer, an MoE layer of 4 experts split over 2 ranks, a head."""

    def __init__(self):
        from deepspeed.moe.layer import MoE  # DeepSpeed's, or shardtrain's through the alias
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(M, M)
        expert = torch.nn.Sequential(torch.nn.Linear(M, 2 * M), torch.nn.GELU(),
                                     torch.nn.Linear(2 * M, M))
        self.moe = MoE(M, expert, num_experts=EXPERTS, ep_size=EP, k=2, drop_tokens=False,
                       top2_2nd_expert_sampling=False)
        self.head = torch.nn.Linear(M, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(self.fc(x))
        return self.head(out).squeeze(-1)


def batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(WORLD * MICRO, T, M, generator=g), torch.randn(WORLD * MICRO, T, generator=g)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def loss_of(engine, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(engine(x), y)


AUTOEP_STEPS, AUTOEP_VOCAB = 3, 64


def mixtral() -> torch.nn.Module:
    """The AutoEP fixture's model (no router-auxiliary loss: DeepSpeed 0.19.8's AutoEP does
    not return the router logits transformers computes it from)."""
    import transformers as tf
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=AUTOEP_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2))


#: DeepSpeed's routing keys in place of the model's router (the fixture's "rule" run).
AUTOEP_RULE = {"top_k": 3, "score_func": "sigmoid", "route_norm": True, "route_scale": 1.5}


def autoep_config(stage: int, rule: bool = False) -> Dict[str, Any]:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0,
                                                      "torch_adam": True}},
            "expert_parallel": {"enabled": True, "autoep_size": WORLD, "preset_model": "mixtral",
                                "use_grouped_mm": False}}
    if rule:
        config["expert_parallel"].update(AUTOEP_RULE)
    return config


def autoep_tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + step)
    rows = torch.randint(0, AUTOEP_VOCAB, (WORLD * MICRO, 8), generator=g)
    return rows[rank * MICRO:(rank + 1) * MICRO]
