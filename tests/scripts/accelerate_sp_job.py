"""Accelerate's long-sequence path, ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``,
on the alias: a tiny Llama (2 layers, built from a ``LlamaConfig``, seed 0) trained by an
Accelerate loop on 2 CPU ranks forming one sequence-parallel group
(``tests/test_accelerate.py`` compares it with one process).

Rank 0 writes the loss of every optimizer step, and the model's final weights, to
``<out>/result.json``.

    python -m torch.distributed.run --nproc-per-node 2 accelerate_sp_job.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig, InitProcessGroupKwargs
from transformers import LlamaConfig, LlamaForCausalLM

SEQ, VOCAB, MICRO, BATCHES = 16, 64, 2, 6


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batches() -> list:
    """``BATCHES`` batches of ``MICRO`` rows; the last positions of some rows are padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for b in range(BATCHES):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        labels = ids.clone()
        labels[0, SEQ - 3 - b % 3:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2,
                           sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ,
                                                                      sp_attn_implementation="sdpa"))
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    accelerator = Accelerator(deepspeed_plugin=plugin, parallelism_config=pc,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = tiny_llama()
    rows = [{k: v[i] for k, v in b.items()} for b in batches() for i in range(MICRO)]
    loader = torch.utils.data.DataLoader(rows, batch_size=MICRO, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, shapes = [], []
    model.train()
    for batch in loader:
        shapes.append(list(batch["input_ids"].shape))
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # the Hugging Face Trainer's route: a loader wrapped after prepare, through deepspeed.utils.groups
    from deepspeed.utils import groups
    adapted = accelerator.deepspeed_ulysses_dl_adapter(
        torch.utils.data.DataLoader(rows, batch_size=MICRO, shuffle=False), model)
    first = next(iter(adapted))
    trainer_route = {"len": len(adapted), "shape": list(first["input_ids"].shape),
                     "sp": [groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()]}
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "shapes": shapes, "num_processes": accelerator.num_processes,
                       "mpu": repr(model.mpu) if hasattr(model, "mpu") else None,
                       "trainer_route": trainer_route,
                       "weights": {n: w.tolist() for n, w in weights.items()}}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
