"""Per-step losses of one Muon run, under whichever ``deepspeed`` the interpreter imports:
DeepSpeed itself, or shardtrain's ``deepspeed`` alias. Run it once with each and compare.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/muon_deepspeed_losses.py --stage 2
    (with DeepSpeed's interpreter, then with the project's)

The model (an embedding, two linear layers, a LayerNorm) and the data are those of
tests/cases_muon.py; fp32, 2 micro-batches of 2 per rank per step, gradient clipping 0.5.
Rank 0 prints one JSON line: the engine's module path and the mean loss of each step.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import deepspeed

MICRO, ACCUM, WORLD = 2, 2, 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 5)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.norm(self.fc1(self.embed(tokens).mean(1)))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ns-method", default="gram")
    parser.add_argument("--clip", type=float, default=0.5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
              "gradient_clipping": args.clip,
              "optimizer": {"type": "Muon", "params": {
                  "muon_lr": 0.05, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.01,
                  "betas": [0.9, 0.95], "eps": 1e-8, "ns_method": args.ns_method}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(0, 11, (MICRO * ACCUM * WORLD, 3), generator=g)
        target = torch.randn(MICRO * ACCUM * WORLD, 5, generator=g)
        total = torch.zeros(())
        for k in range(ACCUM):
            lo = (k * WORLD + rank) * MICRO
            loss = (engine(tokens[lo:lo + MICRO]) - target[lo:lo + MICRO]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach() / ACCUM
        dist.all_reduce(total)
        losses.append(float(total) / WORLD)
    if rank == 0:
        print(json.dumps({"deepspeed": deepspeed.__file__, "stage": args.stage, "losses": losses}))


if __name__ == "__main__":
    main()
