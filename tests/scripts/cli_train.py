"""Trains the tiny GPT a few steps under whatever launcher started it (`shardtrain run` tests).

Every step's global batch is a fixed function of the step number, so a run resumed from a
checkpoint sees the same data as an uninterrupted one and must reach the same losses.

    shardtrain run --nproc 2 tests/scripts/cli_train.py --steps 6 --out result.json

Rank 0 writes ``--out``: the mean loss over ranks of every step, the world size, what each
rank saw of ``--local_rank`` and of its launcher, the step it resumed at and how many times
torchrun restarted it.
With ``--ckpt DIR`` a checkpoint is saved every ``--save-every`` steps (the losses so far ride
in ``client_state``) and the latest one in DIR, if any, is resumed from. ``--die-at S`` kills
global rank ``--die-rank`` with SIGKILL after step S, on the first attempt only: an elastic
restart test.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402

import shardtrain  # noqa: E402
from shardtrain import comm  # noqa: E402

MICRO = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--die-rank", type=int, default=1)
    # What a script written for DeepSpeed's launcher declares; None when nobody passed it.
    p.add_argument("--local_rank", type=int, default=None)
    return p.parse_args()


def global_batch(dataset: gpt.CharDataset, step: int, world: int, rank: int):
    """This rank's share of step ``step``'s global batch, independent of any loader state."""
    size = MICRO * world
    idx = [(step * size + i) % len(dataset) for i in range(rank * MICRO, (rank + 1) * MICRO)]
    xs, ys = zip(*(dataset[i] for i in idx))
    return torch.stack(xs), torch.stack(ys)


def main() -> None:
    args = parse_args()
    local_rank_arg = args.local_rank  # read before initialize(), which overwrites it
    torch.manual_seed(0)
    cfg = gpt.gpt_config("tiny")
    dataset = gpt.CharDataset(gpt.load_corpus(), cfg.block_size)
    model = gpt.GPT(gpt.gpt_config("tiny", vocab_size=dataset.vocab_size))
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = shardtrain.initialize(args=args, model=model, config=config)
    rank, world = comm.get_rank(), comm.get_world_size()

    losses = []
    if args.ckpt:  # (None, None) while the folder holds no checkpoint, as in DeepSpeed
        os.makedirs(args.ckpt, exist_ok=True)  # shardtrain refuses a folder that is missing
        _, client = engine.load_checkpoint(args.ckpt)
        losses = list(client["losses"]) if client else []
    resumed_at = engine.global_steps
    while engine.global_steps < args.steps:
        x, y = global_batch(dataset, engine.global_steps, world, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / world)
        if args.ckpt and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, client_state={"losses": losses})
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if engine.global_steps == args.die_at and rank == args.die_rank and restarts == 0:
            # the others are then blocked in the next step's first collective, the place whose
            # report the test reads (torchrun stops a worker that is not at once)
            time.sleep(2.0)
            os.kill(os.getpid(), signal.SIGKILL)

    seen = comm.all_gather_object({"rank": rank, "local_rank_arg": local_rank_arg,
                                   "local_rank_env": int(os.environ["LOCAL_RANK"]),
                                   "source": comm.detect_launch_env().source})
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "losses": losses, "world": world, "ranks": seen, "resumed_at": resumed_at,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}))
    shardtrain.destroy()


if __name__ == "__main__":
    main()
