"""What Muon costs over AdamW per optimizer step, and what its gather moves (2 CPU ranks, gloo).

At stages 1-3 each rank holds a slice of every Muon matrix, and Newton-Schulz needs the whole
matrix: one all-gather per step hands every rank the whole blended update of each (see
docs/optimizers.md). This script trains examples/gpt.py (preset ``small`` by default) at the
stages asked, with AdamW and with Muon, in alternating timed blocks, and reports per step: the
step time of each, the time of Muon's gather (its packing included, measured around the
optimizer's gather), the gather's bytes sent and received per rank, and the ratio Muon/AdamW.

    python benchmarks/bench_muon.py [--model small] [--stages 0 2] [--steps 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

MICRO, SEQ = 8, 128


def _engine(model_name: str, stage: int, optimizer: dict):
    import gpt
    import shardtrain
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(model_name))
    engine, opt, _, _ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "optimizer": optimizer,
        "zero_optimization": {"stage": stage}})
    return engine, opt


def _timed_gather(opt, spent: list):
    """Wraps the optimizer's gather of whole updates with a timer (Muon only)."""
    inner = opt._whole_updates

    def timed(*args):
        start = time.perf_counter()
        out = inner(*args)
        spent.append(time.perf_counter() - start)
        return out
    opt._whole_updates = timed


def _gather_bytes(opt, world: int):
    """Bytes each rank sends and receives in one gather: an even chunk of every Muon matrix."""
    from shardtrain.layout import chunk_size
    matrices = opt._muon_matrices() if opt._group is not None else []
    sent = sum(4 * chunk_size(m.numel, world) for m in matrices)
    return sent, sent * (world - 1)


def worker(rank: int, world: int, port: int, model_name: str, stages, steps: int, queue) -> None:
    import shardtrain
    torch.set_num_threads(1)
    shardtrain.init_distributed("gloo")
    vocab = 65
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, vocab, (MICRO, SEQ + 1), generator=g) for _ in range(4)]
    results = {}
    for stage in stages:
        engines = {"adamw": _engine(model_name, stage, {"type": "AdamW", "params": {"lr": 1e-3}}),
                   "muon": _engine(model_name, stage, {"type": "Muon", "params": {"lr": 1e-3}})}
        spent: list = []
        _timed_gather(engines["muon"][1], spent)
        times = {name: [] for name in engines}
        for block in range(steps + 1):  # the first block warms up, untimed
            for name, (engine, _) in engines.items():
                shardtrain.comm.barrier()
                start = time.perf_counter()
                batch = data[block % len(data)]
                engine.backward(engine(batch[:, :-1], batch[:, 1:]))
                engine.step()
                shardtrain.comm.barrier()
                if block:
                    times[name].append(time.perf_counter() - start)
        sent, received = _gather_bytes(engines["muon"][1], world)
        step = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        gathers = sorted(spent[1:])[len(spent[1:]) // 2] if len(spent) > 1 else 0.0
        results[stage] = {"adamw_step_s": step["adamw"], "muon_step_s": step["muon"],
                          "muon_over_adamw": step["muon"] / step["adamw"],
                          "gather_s": gathers, "gather_bytes_sent": sent,
                          "gather_bytes_received": received,
                          "muon_params": sum(m.numel for m in engines["muon"][1]._muon_matrices())
                          if stage == 0 else None}
        for engine, _ in engines.values():
            engine.destroy()
    if rank == 0:
        queue.put(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 2])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = run_ranks(worker, 2, args.model, args.stages, args.steps)
    for stage, r in results.items():
        print(f"stage {stage}: AdamW {r['adamw_step_s'] * 1e3:.1f} ms/step, Muon "
              f"{r['muon_step_s'] * 1e3:.1f} ms/step ({r['muon_over_adamw']:.2f}x); gather "
              f"{r['gather_s'] * 1e3:.1f} ms, {r['gather_bytes_sent'] / 2**20:.2f} MiB sent, "
              f"{r['gather_bytes_received'] / 2**20:.2f} MiB received per rank")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
