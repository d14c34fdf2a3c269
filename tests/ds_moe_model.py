"""The model, data and config of the DeepSpeed MoE fixtures (tests/fixtures/deepspeed_moe/).

``fixtures/deepspeed_moe/make_fixtures.py`` trains this model with the real DeepSpeed (its
``deepspeed.moe.layer.MoE`` with ``ep_size`` 2) and saves a checkpoint; the test suite builds the
same model through the ``deepspeed`` alias (shardtrain's layer) and the same data, imports the
checkpoint and continues. Top-2 routing without sampling and without dropping tokens, so both
route alike.
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
