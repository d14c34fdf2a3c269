"""Measures the model-state bytes each rank holds after one step of the example demo GPT, at
every given ZeRO stage and in every mode; for the `shardtrain estimate` test.

    shardtrain run --nproc 2 tests/scripts/cli_states.py --stages 0,1,2 --out states.json

Rank 0 writes a list with one dict per rank: ``"<stage>-<dtype>-<optimizer>"`` -> bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import models  # noqa: E402

import shardtrain  # noqa: E402
from shardtrain import comm  # noqa: E402

MODES = [("fp32", "adam"), ("bf16", "adam"), ("bf16", "sgd")]
OPTIMIZERS = {"adam": {"type": "Adam", "params": {"lr": 1e-3}},
              "sgd": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", required=True, help="comma-separated ZeRO stages")
    p.add_argument("--persistence", type=int, required=True,
                   help="zero_optimization.stage3_param_persistence_threshold")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    shardtrain.init_distributed()
    measured = {}
    for stage in [int(s) for s in args.stages.split(",") if s]:
        for dtype, opt in MODES:
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": 2, "optimizer": OPTIMIZERS[opt],
                      "bf16": {"enabled": dtype == "bf16"},
                      "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold":
                                            args.persistence}}
            engine, *_ = shardtrain.initialize(model=models.gpt_demo(), config=config)
            x = torch.randint(0, 65, (2, 16))
            engine.backward(engine(x, x))
            engine.step()  # optimizer states exist from the first step on
            measured[f"{stage}-{dtype}-{opt}"] = engine.model_state_bytes()["total"]
    every_rank = comm.all_gather_object(measured)
    if comm.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every_rank))
    shardtrain.destroy()


if __name__ == "__main__":
    main()
