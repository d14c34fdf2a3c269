"""A training script written for DeepSpeed, run by shardtrain with one changed line: the import.

It has the shape of DeepSpeed's tutorials: argparse with ``--local_rank`` and
``add_config_arguments``, ``initialize(args=..., model=..., model_parameters=...)`` reading
the ``--deepspeed_config`` JSON (an unchanged DeepSpeed config), then ``engine(x)``,
``engine.backward(loss)``, ``engine.step()`` and ``engine.save_checkpoint``.

    shardtrain run --nproc 2 --local-rank-arg examples/deepspeed_script.py \\
        --deepspeed --deepspeed_config examples/configs/deepspeed_script.json

``--local-rank-arg`` passes ``--local_rank=<n>`` to each process as DeepSpeed's launcher does
(this script would accept its absence too). ``python examples/deepspeed_script.py
--deepspeed_config ...`` runs it on one process. With DeepSpeed installed, the original
import and ``deepspeed --num_gpus 2 examples/deepspeed_script.py ...`` run the same script.

The data is synthetic (a fixed random "teacher" labels Gaussian points), so the script runs
anywhere, CPU included, and its losses are reproducible: the tests compare them, and the
weights in the checkpoint, with plain single-process PyTorch.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import shardtrain as deepspeed  # the one change: this line was `import deepspeed`

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

    net = build_model()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = make_dataset()

    # The engine, the optimizer and the LR schedule from the JSON config, and a loader that
    # hands this rank its share of every global batch.
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    world = deepspeed.comm.get_world_size()
    losses = []
    for epoch in range(args.epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            outputs = model_engine(inputs)
            loss = F.cross_entropy(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()

            # The mean over ranks, for the log: DeepSpeed's all_reduce sums by default.
            mean = loss.detach().clone()
            deepspeed.comm.all_reduce(mean)
            losses.append(mean.item() / world)
        if model_engine.global_rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f} lr {model_engine.get_lr()[0]:.4g}")

    model_engine.save_checkpoint(args.save_dir, client_state={"epochs": args.epochs})

    if args.log_file and model_engine.global_rank == 0:
        with open(args.log_file, "w") as f:
            json.dump({"losses": losses, "world_size": world,
                       "global_steps": model_engine.global_steps,
                       "gradient_accumulation_steps": model_engine.gradient_accumulation_steps(),
                       "zero_stage": model_engine.zero_optimization_stage(),
                       "launcher_local_rank": launcher_local_rank,
                       "local_rank": args.local_rank}, f)


if __name__ == "__main__":
    main()
