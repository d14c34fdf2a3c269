"""Export cases run on every rank of one process group (see test_export.py).

A ``transformers.GPT2LMHeadModel`` built from a small config (random initialisation, nothing
downloaded) trains a few steps through the engine and is saved: at ZeRO stage 3 in bf16 and
in fp16, and at stage 1 in fp32. Each case returns what the engine holds at the save (its
``state_dict``, the tied ``lm_head.weight`` included) and the logits its module computes on
fixed tokens, for the test to compare with what ``from_pretrained`` makes of the export.

The model is wide and deep enough that it is many times its largest tensor (0.86M parameters,
the largest 65k): a memory bound of about one tensor is then told apart from holding the
model.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional

import torch

import shardtrain
from _dist import run_cases

VOCAB, EMBD, LAYERS, HEADS, POSITIONS = 512, 128, 4, 4, 64
MICRO, SEQ, STEPS = 2, 16, 2
VARIANTS = {"s3-bf16": (3, "bf16"), "s3-fp16": (3, "fp16"), "s1-fp32": (1, None)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, None: torch.float32}


def hf_config():
    """GPT-2, no dropout (deterministic), ids inside the small vocabulary."""
    from transformers import GPT2Config
    return GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, vocab_size=VOCAB,
                      n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(hf_config())


def eval_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def engine_config(stage: int, precision: Optional[str]) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def train_and_save(name: str, rank: int, world: int, root: str) -> Dict[str, Any]:
    """Trains ``STEPS`` steps, saves to ``<root>/ckpt-<name>``; returns the engine's weights
    and its module's logits on :func:`eval_ids` (every rank runs it: stage 3 gathers)."""
    stage, precision = VARIANTS[name]
    engine, *_ = shardtrain.initialize(model=build_model(0), config=engine_config(stage, precision))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (STEPS, world, MICRO, SEQ), generator=g)
    for step in range(STEPS):
        out = engine(input_ids=tokens[step, rank], labels=tokens[step, rank])
        engine.backward(out.loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, f"ckpt-{name}"))
    weights = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    engine.module.eval()
    with torch.no_grad():
        logits = engine.module(input_ids=eval_ids()).logits.float().cpu()
    return {"weights": weights, "logits": logits, "skipped": engine.skipped_steps}


def run_all(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    cases = {name: functools.partial(train_and_save, name, root=root) for name in VARIANTS}
    return run_cases(cases, rank, world_size)
