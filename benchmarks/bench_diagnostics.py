"""What the collective trail and the divergence check cost per training step.

On 2 processes (gloo on CPU; ``--device cuda``: NCCL), the GPT-style model of
``examples/gpt.py`` (preset ``small``, sequence 128, micro-batch 8) at ZeRO stage 0 (few,
large collectives) and stage 3 (a gather per block, forward and backward: the most
collectives per step), four variants of the same engine, in alternating timed blocks:

* ``trail off``: no record (``comm.keep_trail(False)``), the reference;
* ``trail on``: the default, a record per collective in the memory-mapped ring;
* ``step check``: ``diagnostics.divergence_check: "step"``, one all-gather of a small tensor
  per optimizer step;
* ``collective check``: ``"collective"``, an all-gather before every collective (debugging).

It prints the median step time of each and its ratio to ``trail off`` (on a shared machine
these ratios carry a few percent of noise), and, measured alone, the cost of one record
(microseconds) and of one step check (milliseconds), each as a share of the step: records x
collectives per step, and the check once per step.

    python benchmarks/bench_diagnostics.py                # about 1 minute on 2 cores
    python benchmarks/bench_diagnostics.py --blocks 3 --steps 2 --stages 0
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ranks import run_ranks  # noqa: E402  (next to this file)

VARIANTS = ("trail off", "trail on", "step check", "collective check")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,3")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per variant")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per block")
    p.add_argument("--model", default="small")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _switch(comm, variant: str) -> None:
    comm.keep_trail(variant != "trail off")
    comm.set_check({"step check": "step", "collective check": "collective"}.get(variant, "off"))


def _record_cost_us(n: int = 20000) -> float:
    """One record written alone, as the trail writes it (microseconds)."""
    from shardtrain.comm._trail import Trail
    trail = Trail(1024)
    start = time.perf_counter()
    for i in range(n):
        trail.record("zero", "0", "0-1", "all_gather", 4096 + i, "float32", "blocks.3",
                     "step 12, micro-step 1 of 1, in forward")
    return (time.perf_counter() - start) / n * 1e6


def _trace_cost_us(comm, n: int = 20000) -> float:
    """One record through the comm layer, with the engine's position of the moment, as a
    collective writes it (microseconds; ``comm.mark`` takes the same path without a
    tensor; every rank marks alike, so the trails stay comparable)."""
    start = time.perf_counter()
    for _ in range(n):
        comm.mark("benchmark", "blocks.3", comm.WORLD)
    return (time.perf_counter() - start) / n * 1e6


def _check_ms(comm, accelerator, n: int = 50) -> float:
    """One per-step check alone (milliseconds, median of ``n``)."""
    times = []
    for _ in range(n):
        accelerator.synchronize()
        start = time.perf_counter()
        comm.check_agreement()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(args.threads)
    import gpt
    import shardtrain
    from shardtrain import comm

    shardtrain.init_distributed()
    cfg = gpt.gpt_config(args.model, block_size=args.seq)
    device = shardtrain.accelerator.device()
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g).to(device)
    calls = []
    comm.add_observer(lambda op, tensor: calls.append(op))
    results = {"record_us": _record_cost_us(), "stages": {}}
    for stage in [int(s) for s in args.stages.split(",")]:
        torch.manual_seed(0)
        engine, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config={
            "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}})

        def step(engine=engine):
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()

        step()  # warm-up, untimed
        calls.clear()
        step()
        per_step = len(calls)
        times = {v: [] for v in VARIANTS}
        for block in range(args.blocks):
            order = VARIANTS if block % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                _switch(comm, variant)
                comm.barrier()
                shardtrain.accelerator.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                shardtrain.accelerator.synchronize()
                times[variant].append((time.perf_counter() - start) / args.steps)
        _switch(comm, "trail on")
        medians = {v: statistics.median(t) for v, t in times.items()}
        check_ms = _check_ms(comm, shardtrain.accelerator)
        trace_us = _trace_cost_us(comm)
        results["stages"][stage] = {
            "collectives_per_step": per_step, "check_ms": check_ms, "trace_us": trace_us,
            "trail_share": per_step * trace_us / 1e3 / (medians["trail off"] * 1e3),
            "check_share": check_ms / (medians["trail off"] * 1e3),
            "step_ms": {v: m * 1e3 for v, m in medians.items()},
            "ratio_to_trail_off": {v: m / medians["trail off"] for v, m in medians.items()}}
        engine.destroy()
    if rank == 0:
        queue.put(results)
    shardtrain.destroy()


def main(argv=None):
    args = parse_args(argv)
    got = run_ranks(_worker, 2, args, device=args.device)
    print(f"one trail record alone: {got['record_us']:.2f} us (the ring only)")
    print(f"{'stage':>5} {'collectives/step':>17} " + " ".join(f"{v:>17}" for v in VARIANTS))
    for stage, row in got["stages"].items():
        cells = " ".join(f"{row['step_ms'][v]:8.1f} ms {row['ratio_to_trail_off'][v]:5.3f}"
                         for v in VARIANTS)
        print(f"{stage:>5} {row['collectives_per_step']:>17} {cells}")
    for stage, row in got["stages"].items():
        print(f"stage {stage}: records cost {row['trail_share']:.3%} of a step "
              f"({row['collectives_per_step']} x {row['trace_us']:.2f} us, the engine's "
              f"position included); the step check alone takes {row['check_ms']:.3f} ms, "
              f"{row['check_share']:.2%} of a step")
    if args.json:
        args.json.write_text(json.dumps(got, indent=2))
    return got


if __name__ == "__main__":
    main()
