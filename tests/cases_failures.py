"""Rank bodies for test_failures.py: a rank that stops responding in the middle of training."""
from __future__ import annotations

import time
from typing import Any, Dict

import torch

import shardtrain
from shardtrain import comm

STUCK_SECONDS = 10.0  # past rank 0's timeout (3 s) and roll call (5 s)


def stuck_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 stops before the backward of step 2 (a long sleep, as a rank stuck in a data
    loader or a different branch would); the others reach the gradient reduction and wait."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    start = time.monotonic()
    try:
        for step in range(3):
            for _ in range(2):
                loss = engine(torch.randn(2, 8)).pow(2).mean()
                if rank == 1 and step == 1:
                    time.sleep(STUCK_SECONDS)
                engine.backward(loss)
                engine.step()
    except comm.CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - start,
                "cause": type(err.__cause__).__name__}
    return {"error": None, "seconds": time.monotonic() - start}
