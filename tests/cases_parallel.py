"""Rank bodies for test_parallel.py: the engine on a device mesh (tensor- and sequence-parallel
ranks composed with ZeRO's data parallelism) against plain single-process training of the same
model on the same global batch.

Each case trains a tiny model through ``shardtrain.initialize`` with ``training_data=``: the
collate function records every batch this rank's loader handed out (before the
sequence-parallel slicing), so the reference can train on exactly the global batches the
data-parallel ranks read. The reference of a step is the mean over data-parallel replicas and
micro-steps of each replica's loss, as data parallelism without a mesh defines it.

Adam's ``eps`` is 1e-6: a split layer sums its products in another order, and an element whose
gradient is near ``eps`` turns that last-bit difference into a visible update difference with
torch's default of 1e-8 (``lr / (4 eps)`` times the rounding); the losses and the global norm
are compared as they are.
"""
from __future__ import annotations

import functools
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
           "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.01, "eps": 1e-6}}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    cfg.update(extra)
    return cfg


def hf_loss(model: Callable, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def gpt_loss(model: Callable, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["input_ids"], batch["labels"].clamp(min=0))


def train(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int,
          loss_of: Callable = hf_loss) -> Dict[str, Any]:
    """Trains through the engine; returns the losses, the batches read, the full weights."""
    seen: List[Dict[str, torch.Tensor]] = []

    def collate(items):
        batch = default_collate(items)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    engine, *_ = shardtrain.initialize(model=build(), config=cfg, training_data=Tokens(),
                                       collate_fn=collate)
    batches = iter(engine.training_dataloader)
    losses, shapes = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch = next(batches)
        shapes.append(tuple(batch["input_ids"].shape))
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {k: v.float().clone() for k, v in full_state_dict(engine.module, rank=None).items()}
    out = {"losses": losses, "seen": seen, "shapes": shapes, "weights": weights,
           "coordinate": engine.mesh.coordinate(), "dp": engine.dp_world_size,
           "norm": engine.get_global_grad_norm()}
    engine.destroy()
    return out


def reference(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any],
              replicas: List[List[Dict[str, torch.Tensor]]], loss_of: Callable = hf_loss
              ) -> Dict[str, Any]:
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
                loss = loss_of(model, replicas[d][step * gas + micro])
                (loss / (gas * dp)).backward()
                losses[d].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"]).item()
        opt.step()
        opt.zero_grad()
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "norm": norm}


def compare(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int = 2,
            loss_of: Callable = hf_loss) -> Dict[str, Any]:
    """This rank's training against the reference on the batches every replica read."""
    try:
        got = train(build, cfg, steps, loss_of)
    except Exception:  # every rank still meets the gather below, then all fail together
        comm.all_gather_object(None)
        raise
    every = comm.all_gather_object((got["coordinate"], got["seen"]))
    if any(e is None for e in every):
        raise RuntimeError("another rank failed in this case (see its output)")
    replicas: Dict[int, List] = {}
    same_in_group = True
    for coord, seen in every:
        if coord["dp"] in replicas:  # another rank of the same replica: the same samples
            same_in_group &= all(torch.equal(a["input_ids"], b["input_ids"])
                                 for a, b in zip(seen, replicas[coord["dp"]]))
        replicas.setdefault(coord["dp"], seen)
    ref = reference(build, cfg, [replicas[d] for d in sorted(replicas)], loss_of)
    mine = ref["losses"][got["coordinate"]["dp"]]
    loss_err = max(abs(a - b) for a, b in zip(got["losses"], mine))
    errs = {k: (got["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items()}
    worst = max(errs, key=errs.get)
    weight_err = errs[worst]
    return {"loss_err": loss_err, "weight_err": weight_err, "same_in_group": same_in_group,
            "norm_err": abs(got["norm"] - ref["norm"]), "shapes": got["shapes"],
            "replicas": len(replicas), "dp": got["dp"], "moved": _moved(ref["weights"], build),
            "norms": (got["norm"], ref["norm"]), "worst": worst}


def _moved(weights: Dict[str, torch.Tensor], build: Callable[[], torch.nn.Module]) -> float:
    """How far training moved the weights (a parity check is only telling if they moved)."""
    start = build().state_dict()
    return max((weights[k] - v.float()).abs().max().item() for k, v in start.items())


# -- the cases --------------------------------------------------------------------------------

def sequence_parallel(rank: int, world_size: int, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    """``sequence_parallel_size: 2`` at each ZeRO stage (world 2: sp 2; world 4: dp 2 x sp 2)."""
    cases = {f"stage{s}": (lambda r, w, s=s: compare(llama, config(s, sequence_parallel_size=2)))
             for s in stages}
    return run_cases(cases, rank, world_size)


def gpt() -> torch.nn.Module:
    from gpt import GPT, gpt_config
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_head=4, vocab_size=VOCAB, block_size=SEQ))


#: layer_specs for the GPT example (DeepSpeed's partition_config form).
GPT_SPECS = [{"patterns": [r".*\.attn\.(query|key|value)\.(weight|bias)$"], "partition_type": "column"},
             {"patterns": [r".*\.attn\.proj\.weight$"], "partition_type": "row"},
             {"patterns": [r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.mlp\.proj\.weight$"], "partition_type": "row"}]
#: The Llama preset plus a vocabulary-parallel head (its loss never gathers the vocabulary).
HEAD_SPECS = [{"patterns": [r"lm_head\.weight$"], "partition_type": "column"}]


def tensor_parallel(rank: int, world_size: int, tp: int, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    """``tensor_parallel.autotp_size: tp`` at each ZeRO stage, for the GPT example with
    layer_specs and for Llama with the preset its model_type picks."""
    block = {"autotp_size": tp}
    # (key/value heads split too: tp 4 needs 4 of them)
    llama_tp = functools.partial(llama, num_key_value_heads=max(KV_HEADS, tp))
    gpt_block = {**block, "partition_config": {"layer_specs": GPT_SPECS}}
    cases: Dict[str, Callable] = {}
    for s in stages:
        cases[f"gpt_stage{s}"] = (lambda r, w, s=s: compare(
            gpt, config(s, tensor_parallel=gpt_block), loss_of=gpt_loss))
        cases[f"llama_stage{s}"] = (lambda r, w, s=s: compare(
            llama_tp, config(s, tensor_parallel=block)))
    cases["llama_head_split"] = lambda r, w: compare(llama_tp, config(
        1, tensor_parallel={**block, "partition_config": {"layer_specs": HEAD_SPECS}}))
    cases["llama_tied_head_split"] = lambda r, w: compare(
        functools.partial(llama_tp, tie_word_embeddings=True),
        config(2, tensor_parallel={**block, "partition_config": {"layer_specs": HEAD_SPECS}}))
    return run_cases(cases, rank, world_size)
