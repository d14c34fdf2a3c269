"""An Accelerate training loop with a ``DeepSpeedPlugin``, run unchanged on the ``deepspeed``
alias (``tests/test_accelerate.py`` starts it on 2 CPU ranks with torchrun).

On a machine without a GPU, Accelerate finds no communication backend of its own and would
count each process as a world of one; ``InitProcessGroupKwargs(backend="gloo")`` names the
CPU backend, and Accelerate then keeps its DeepSpeed path with the right world size.
Rank 0 writes the loss of every optimizer step to ``<out>/result.json``.

    python -m torch.distributed.run --nproc-per-node 2 accelerate_job.py --pretrained DIR \
        --out DIR --stage 2 [--save-at 3] [--resume DIR]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import InitProcessGroupKwargs
from transformers import GPT2LMHeadModel

import deepspeed
from hf_trainer_job import Tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    plugin = DeepSpeedPlugin(zero_stage=a.stage, gradient_accumulation_steps=a.gas,
                             gradient_clipping=1.0, zero3_save_16bit_model=True)
    accelerator = Accelerator(deepspeed_plugin=plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = GPT2LMHeadModel.from_pretrained(a.pretrained)
    data = Tokens(a.micro * accelerator.num_processes * a.gas * a.steps, model.config.vocab_size)
    loader = torch.utils.data.DataLoader(data, batch_size=a.micro, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    start = 0
    if a.resume:
        accelerator.load_state(a.resume)
        start = model.global_steps
        loader = accelerator.skip_first_batches(loader, start * a.gas)
    losses, micro = {}, []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro.append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients:
            step = model.global_steps
            losses[step] = sum(micro) / len(micro)
            micro = []
            if step == a.save_at:
                accelerator.save_state(os.path.join(a.out, f"state-{step}"))
    weights = accelerator.get_state_dict(model)  # every rank: stage 3 gathers them
    if accelerator.is_main_process:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "start": start,
                       "distributed_type": str(accelerator.distributed_type),
                       "num_processes": accelerator.num_processes,
                       "is_deepspeed_engine": isinstance(model, deepspeed.DeepSpeedEngine),
                       "stage": model.zero_optimization_stage(),
                       "weights": {n: w.tolist() for n, w in weights.items()}}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
