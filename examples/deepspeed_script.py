"""A training script written for DeepSpeed, unchanged: shardtrain runs it through the
``deepspeed`` alias (``shardtrain deepspeed-alias install``, which ``make test`` runs).

It has the shape of DeepSpeed's examples: argparse with ``--local_rank`` and
``add_config_arguments``, ``deepspeed.init_distributed()``, ``get_accelerator()`` for the
device, the engine's getters (``get_batch_info()``, ``bfloat16_enabled()``,
``fp16_enabled()``, ``zero_optimization()``, ``gradient_clipping()``), ``deepspeed.comm``
for the logged loss, ``initialize(args=..., model=..., model_parameters=...)`` reading the
``--deepspeed_config`` JSON (an unchanged DeepSpeed config), then ``engine(x)``,
``engine.backward(loss)``, ``engine.step()``, ``engine.save_checkpoint`` and
``engine.destroy()``. It starts as DeepSpeed scripts start:

    deepspeed --num_gpus 2 examples/deepspeed_script.py \
        --deepspeed --deepspeed_config examples/configs/deepspeed_script.json

``deepspeed`` is the alias's launcher (over ``shardtrain run``, torchrun); on a machine
without GPUs ``--num_gpus`` is the number of CPU processes. ``python
examples/deepspeed_script.py --deepspeed_config ...`` runs it on one process.

The data is synthetic (a fixed random "teacher" labels Gaussian points), so the script runs
anywhere, CPU included, and its losses are reproducible: the tests compare them, and the
weights in the checkpoint, with plain single-process PyTorch.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

IN, HIDDEN, CLASSES, SAMPLES = 16, 64, 4, 64


def add_argument():
    parser = argparse.ArgumentParser(description="A DeepSpeed-style training script")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data")
    parser.add_argument("--save_dir", default="checkpoints/deepspeed_script",
                        help="where save_checkpoint writes at the end")
    parser.add_argument("--log_file", default=None,
                        help="rank 0 writes the mean loss of every micro-step here (JSON)")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build_model():
    torch.manual_seed(0)  # every rank builds the same initial weights
    return Net()


def make_dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    teacher = torch.randn(IN, CLASSES, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))


def main():
    args = add_argument()
    launcher_local_rank = args.local_rank  # initialize() overwrites it with LOCAL_RANK
    deepspeed.init_distributed()
    if args.local_rank >= 0:
        get_accelerator().set_device(args.local_rank)

    net = build_model()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = make_dataset()

    # The engine, the optimizer and the LR schedule from the JSON config, and a loader that
    # hands this rank its share of every global batch.
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    batch, micro, gas = model_engine.get_batch_info()
    if model_engine.global_rank == 0:
        print(f"batch {batch} = {micro} per rank x {gas} steps x {dist.get_world_size()} ranks, "
              f"ZeRO {'on' if model_engine.zero_optimization() else 'off'} "
              f"(stage {model_engine.zero_optimization_stage()}), "
              f"clipping {model_engine.gradient_clipping()}, on {local_device}")

    world = dist.get_world_size()
    losses = []
    for epoch in range(args.epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = F.cross_entropy(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()

            # The mean over ranks, for the log: DeepSpeed's all_reduce sums by default.
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        if model_engine.global_rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f} lr {model_engine.get_lr()[0]:.4g}")

    model_engine.save_checkpoint(args.save_dir, client_state={"epochs": args.epochs})

    if args.log_file and model_engine.global_rank == 0:
        with open(args.log_file, "w") as f:
            json.dump({"losses": losses, "world_size": world,
                       "global_steps": model_engine.global_steps,
                       "batch_info": [batch, micro, gas],
                       "gradient_accumulation_steps": model_engine.gradient_accumulation_steps(),
                       "zero_stage": model_engine.zero_optimization_stage(),
                       "launcher_local_rank": launcher_local_rank,
                       "local_rank": args.local_rank}, f)
    model_engine.destroy()


if __name__ == "__main__":
    main()
