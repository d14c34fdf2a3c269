"""The model, data and config of the DeepSpeed fixtures (tests/fixtures/deepspeed/).

``make_fixtures.py`` trains this model with the real DeepSpeed; the test suite builds the very
same model and data stream with shardtrain alone, so a converted checkpoint resumes on the
batches DeepSpeed trained on next. Nothing here imports DeepSpeed.

The model has what a DeepSpeed checkpoint distinguishes: nested parameter names, sizes that
do not divide by 2 or 3 (padding of the flat partitions), a frozen parameter (frozen
fragments at stage 3), a persistent buffer (``buffer_names``) and, at stage 3, parameters
both under and over the persistence threshold.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, OUT = 8, 32, 5
TRAIN_BATCH, MICRO, GAS, WORLD = 12, 3, 2, 2  # DeepSpeed's run: 2 ranks
SAVE_AT, CONTINUE = 4, 4                      # steps before the save, steps after it
DATA_SEED, MODEL_SEED = 1234, 7

CONFIG: Dict[str, Any] = {
    "train_batch_size": TRAIN_BATCH,
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8,
                                              "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                             "warmup_num_steps": 3, "total_num_steps": 12}},
    "zero_optimization": {"stage": 0},
}
STAGE3_PERSISTENCE = 100  # parameters of at most this many elements stay whole at stage 3
# Optimizers passed to initialize (DeepSpeed: zero_allow_untested_optimizer), each with a
# WarmupLR passed beside it; the config then has neither block.
CLIENT_OPTIMIZERS = ("AdamW", "Adam", "SGD")
CLIENT_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 3}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.gain = nn.Parameter(torch.ones(width), requires_grad=False)  # frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(self.norm(self.fc(x)))


class TinyNet(nn.Module):
    """About 1,600 parameters; floating inputs are cast to the weights' dtype (bf16)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.block = Block(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x + self.shift.to(x.dtype)).to(self.embed.weight.dtype)
        return self.head(self.block(torch.relu(self.embed(x))))


def make_model() -> TinyNet:
    torch.manual_seed(MODEL_SEED)
    return TinyNet()


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def global_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``TRAIN_BATCH`` samples of optimizer step ``step`` (counted from 0)."""
    g = torch.Generator().manual_seed(DATA_SEED + step)
    return torch.randn(TRAIN_BATCH, IN, generator=g), torch.randint(0, OUT, (TRAIN_BATCH,),
                                                                    generator=g)


def micro_batch(step: int, micro: int, rank: int, world: int) -> Tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """Rank ``rank``'s share of micro-step ``micro`` of ``step``: micro-step k covers samples
    ``[k * TRAIN_BATCH / GAS, (k + 1) * TRAIN_BATCH / GAS)`` whatever the world size, and rank r
    takes its ``1 / world`` of them in rank order."""
    x, y = global_batch(step)
    per_micro = TRAIN_BATCH // GAS
    size = per_micro // world
    lo = micro * per_micro + rank * size
    return x[lo: lo + size], y[lo: lo + size]


def client_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The client optimizer ``name`` (one of ``CLIENT_OPTIMIZERS``) over ``params``."""
    if name == "SGD":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=0.01)
    return getattr(torch.optim, name)(params, lr=0.01, betas=(0.9, 0.99), eps=1e-8,
                                      weight_decay=0.01)


def config(stage: int, bf16: bool, world: int = WORLD, client: bool = False) -> Dict[str, Any]:
    """The fixture's config for ``stage`` and precision, for a run on ``world`` ranks; with
    ``client``, for an optimizer and scheduler passed to initialize."""
    cfg = copy.deepcopy(CONFIG)
    if client:
        del cfg["optimizer"], cfg["scheduler"]
        cfg["zero_allow_untested_optimizer"] = True
    cfg["train_micro_batch_size_per_gpu"] = TRAIN_BATCH // (GAS * world)
    cfg["zero_optimization"] = {"stage": stage}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = STAGE3_PERSISTENCE
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg
