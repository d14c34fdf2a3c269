"""A small MLP trained with shardtrain, for the autotuner's tests: activations dominate.

    python tests/scripts/autotune_mlp.py --config train.json [--steps 50]

Per sample it saves its input (32 floats) and the ReLU output (512 floats) for backward:
2,176 bytes of activations.
"""
import argparse

import torch

import shardtrain

IN, HIDDEN = 32, 512


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, IN))
    engine, _, _, _ = shardtrain.initialize(model=model, config=args.config)
    micro = engine.train_micro_batch_size_per_gpu()
    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x = torch.randn(micro, IN)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


if __name__ == "__main__":
    main()
