"""Rank bodies for test_parallel.py: the engine on a device mesh (tensor- and sequence-parallel
ranks composed with ZeRO's data parallelism) against plain single-process training of the same
model on the same global batch.

Each case trains a tiny model through ``shardtrain.initialize`` with ``training_data=``: the
collate function records every batch this rank's loader handed out (before the
sequence-parallel slicing), so the reference can train on exactly the global batches the
data-parallel ranks read. The reference of a step is the mean over data-parallel replicas and
micro-steps of each replica's loss, as data parallelism without a mesh defines it.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List

import torch
from torch.utils.data import default_collate

from _dist import run_cases
import shardtrain
from shardtrain import comm
from shardtrain.full_weights import full_state_dict

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 2, 128, 16


def llama(**overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    fields = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                  max_position_embeddings=64, attn_implementation="sdpa")
    fields.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**fields))


class Tokens(torch.utils.data.Dataset):
    """Random token rows with causal-LM labels; some rows have a prompt without targets, so
    the valid tokens differ between rows and between slices of a row."""

    def __init__(self, rows: int = 32, seq: int = SEQ, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        self.prompt = torch.randint(0, seq - 2, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: int(self.prompt[i]) * (i % 2)] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def config(stage: int, micro: int = 2, gas: int = 2, **extra: Any) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    cfg.update(extra)
    return cfg


def train(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """Trains through the engine; returns the losses, the batches read, the full weights."""
    seen: List[Dict[str, torch.Tensor]] = []

    def collate(items):
        batch = default_collate(items)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    engine, *_ = shardtrain.initialize(model=build(), config=cfg, training_data=Tokens(),
                                       collate_fn=collate)
    batches = iter(engine.training_dataloader)
    losses, norms, shapes = [], [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch = next(batches)
        shapes.append(tuple(batch["input_ids"].shape))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.is_gradient_accumulation_boundary() is False and engine.global_steps:
            norms.append(engine.get_global_grad_norm())
    weights = {k: v.float().clone() for k, v in full_state_dict(engine.module).items()}
    out = {"losses": losses, "seen": seen, "shapes": shapes, "weights": weights,
           "coordinate": engine.mesh.coordinate(), "dp": engine.dp_world_size,
           "norm": engine.get_global_grad_norm()}
    engine.destroy()
    return out


def reference(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any],
              replicas: List[List[Dict[str, torch.Tensor]]]) -> Dict[str, Any]:
    """Single-process training on the global batches: ``replicas[d]`` is the list of batches
    data-parallel replica ``d`` read, in order."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **cfg["optimizer"]["params"])
    gas, dp = cfg["gradient_accumulation_steps"], len(replicas)
    losses: List[List[float]] = [[] for _ in range(dp)]
    norm = None
    for step in range(len(replicas[0]) // gas):
        for micro in range(gas):
            for d in range(dp):
                loss = model(**replicas[d][step * gas + micro]).loss
                (loss / (gas * dp)).backward()
                losses[d].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"]).item()
        opt.step()
        opt.zero_grad()
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "norm": norm}


def compare(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int = 2
            ) -> Dict[str, Any]:
    """This rank's training against the reference on the batches every replica read."""
    got = train(build, cfg, steps)
    every = comm.all_gather_object((got["coordinate"], got["seen"]))
    replicas: Dict[int, List] = {}
    same_in_group = True
    for coord, seen in every:
        if coord["dp"] in replicas:  # another rank of the same replica: the same samples
            same_in_group &= all(torch.equal(a["input_ids"], b["input_ids"])
                                 for a, b in zip(seen, replicas[coord["dp"]]))
        replicas.setdefault(coord["dp"], seen)
    ref = reference(build, cfg, [replicas[d] for d in sorted(replicas)])
    mine = ref["losses"][got["coordinate"]["dp"]]
    loss_err = max(abs(a - b) for a, b in zip(got["losses"], mine))
    weight_err = max((got["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
    return {"loss_err": loss_err, "weight_err": weight_err, "same_in_group": same_in_group,
            "norm_err": abs(got["norm"] - ref["norm"]), "shapes": got["shapes"],
            "replicas": len(replicas), "dp": got["dp"], "moved": _moved(ref["weights"], build)}


def _moved(weights: Dict[str, torch.Tensor], build: Callable[[], torch.nn.Module]) -> float:
    """How far training moved the weights (a parity check is only telling if they moved)."""
    start = build().state_dict()
    return max((weights[k] - v.float()).abs().max().item() for k, v in start.items())


# -- the cases --------------------------------------------------------------------------------

def sequence_parallel(rank: int, world_size: int, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    """``sequence_parallel_size: 2`` at each ZeRO stage (world 2: sp 2; world 4: dp 2 x sp 2)."""
    cases = {f"stage{s}": (lambda s=s: compare(llama, config(s, sequence_parallel_size=2)))
             for s in stages}
    cases["bf16"] = lambda: compare(llama, config(1, sequence_parallel_size=2,
                                                  bf16={"enabled": True}))
    return run_cases(cases)
