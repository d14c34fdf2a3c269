"""Activation checkpointing and torch.compile through the engine, on every rank."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

import gpt
from _dist import run_cases
import shardtrain
from shardtrain import checkpointing
from shardtrain.checkpointing import checkpoint


class CheckpointedGPT(gpt.GPT):
    """GPT whose blocks run through shardtrain.checkpointing.checkpoint."""

    use_checkpointing = True

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = checkpoint(block, x) if self.use_checkpointing else block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **extra}


def tokens(world: int, steps: int = 3, layers: int = 2):
    cfg = gpt.gpt_config("tiny", n_layer=layers)
    g = torch.Generator().manual_seed(11)
    return cfg, torch.randint(0, cfg.vocab_size, (steps, world, 2, cfg.block_size + 1),
                              generator=g)


def train(engine, data, rank) -> Dict[str, Any]:
    losses = []
    for s in range(data.shape[0]):
        batch = data[s, rank]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "params": state}


def saved_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch[:, :-1], batch[:, 1:])
    return total[0]


def case_checkpointing(rank, world):
    cfg, data = tokens(world)
    out = {}
    for stage in (0, 1, 2, 3):
        runs = {}
        for enabled in (False, True):
            torch.manual_seed(0)
            model = CheckpointedGPT(cfg)
            model.use_checkpointing = enabled
            extra = {"activation_checkpointing": {"cpu_checkpointing": enabled}}
            engine, *_ = shardtrain.initialize(model=model, config=config(stage, **extra))
            runs[enabled] = train(engine, data, rank)
            if stage == 0:
                runs[enabled]["saved"] = saved_bytes(engine.module, data[0, rank])
        out[stage] = runs
    checkpointing.reset()
    return out


def case_compile(rank, world):
    cfg, data = tokens(world, layers=1)
    out = {}
    for stage in (0, 3):
        runs = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            engine, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config=config(stage))
            if compiled:
                engine.compile(backend="inductor")
            runs[compiled] = train(engine, data, rank)
        out[stage] = runs
    return out


def case_compile_warning(rank, world):
    seen: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("shardtrain")
    logger.addHandler(handler)
    try:
        engine, *_ = shardtrain.initialize(model=torch.nn.Linear(4, 2),
                                           config=config(0, compile={"enabled": True}))
        for _ in range(3):
            engine(torch.randn(2, 4))
    finally:
        logger.removeHandler(handler)
    return {"warnings": [m for m in seen if "engine.compile() was not called" in m]}


CASES = {"checkpointing": case_checkpointing, "compile": case_compile,
         "compile_warning": case_compile_warning}


def run_all(rank: int, world_size: int, only: Optional[List[str]] = None) -> Dict[str, Any]:
    return run_cases(CASES, rank, world_size, only)
