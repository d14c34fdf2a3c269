"""shardtrain checkpoints against ``torch.save`` of the full state by one rank.

The GPT-style model (examples/gpt.py preset "small", about 4M parameters) with AdamW trains
one step on 2 CPU processes, then, in one run:

* shardtrain: ``engine.save_checkpoint`` (every rank writes its shard, fsync, atomic rename)
  and ``engine.load_checkpoint`` (every rank reads what it needs, CRC-checked), at each
  ZeRO stage asked for;
* baseline: at stage 0, rank 0 ``torch.save``s {module, optimizer, scheduler, counters} (the
  DeepSpeed stage-0 layout: one file with the full optimizer state) with an fsync, and every
  rank ``torch.load``s it and restores the module and the optimizer.

Times are medians over ``--repeats`` rounds, measured between barriers (the slowest rank
counts). Both read back from the page cache right after writing: this measures the
formats' CPU cost, not the disk.

    python benchmarks/bench_checkpoint.py                  # stages 0 and 2, about 30 s
    python benchmarks/bench_checkpoint.py --stages 0,1,2 --repeats 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--model", default="small", help="examples/gpt.py preset (default small)")
    p.add_argument("--stages", default="0,2", help="ZeRO stages to measure (default 0,2)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per measurement (default 3)")
    p.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _timed(fn) -> float:
    import shardtrain
    shardtrain.comm.barrier()
    start = time.perf_counter()
    fn()
    shardtrain.comm.barrier()  # the slowest rank decides
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _engine(args, stage: int):
    import gpt
    import shardtrain
    torch.manual_seed(0)
    engine, *_ = shardtrain.initialize(model=gpt.GPT(gpt.gpt_config(args.model)), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    tokens = torch.randint(0, 65, (2, 129), generator=torch.Generator().manual_seed(1))
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()  # optimizer states exist from here on
    return engine


def _ours(engine, args, where: Path) -> dict:
    saves, loads = [], []
    for i in range(args.repeats):
        saves.append(_timed(lambda i=i: engine.save_checkpoint(where, tag=f"r{i}")))
        loads.append(_timed(lambda i=i: engine.load_checkpoint(where, tag=f"r{i}")))
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "bytes": _dir_bytes(where / "r0")}


def _baseline(engine, args, where: Path, rank: int) -> dict:
    path = where / "full_state.pt"

    def save():
        if rank == 0:
            state = {"module": engine.module.state_dict(),
                     "optimizer": engine.optimizer.state_dict(),
                     "global_steps": engine.global_steps}
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def load():
        state = torch.load(path, map_location="cpu", weights_only=True)
        engine.module.load_state_dict(state["module"])
        engine.optimizer.load_state_dict(state["optimizer"])

    saves = [_timed(save) for _ in range(args.repeats)]
    loads = [_timed(load) for _ in range(args.repeats)]
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "bytes": path.stat().st_size}


def _worker(rank, world, port, args, base, queue):
    torch.set_num_threads(args.threads)
    import shardtrain
    shardtrain.init_distributed()
    results = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        engine = _engine(args, stage)
        results[f"shardtrain stage {stage}"] = _ours(engine, args, base / f"stage{stage}")
        if stage == 0:
            results["torch.save, rank 0"] = _baseline(engine, args, base, rank)
        results["params"] = sum(p.numel() for p in engine.module.parameters())
    if rank == 0:
        queue.put(results)
    shardtrain.destroy()


def measure(args) -> dict:
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        result = run_ranks(_worker, args.world, args, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return result


def report(result: dict) -> None:
    mib = 1024 * 1024
    base = result.get("torch.save, rank 0")
    print(f"{'':24} {'save ms':>9} {'load ms':>9} {'MiB written':>12}")
    for name, row in result.items():
        if name == "params":
            continue
        ratio = ""
        if base is not None and row is not base:
            ratio = (f"   x{row['save_s'] / base['save_s']:.2f} save, "
                     f"x{row['load_s'] / base['load_s']:.2f} load vs torch.save")
        print(f"{name:24} {row['save_s'] * 1e3:9.1f} {row['load_s'] * 1e3:9.1f} "
              f"{row['bytes'] / mib:12.2f}{ratio}")


def main(argv=None):
    args = parse_args(argv)
    print(f"checkpoints: GPT '{args.model}', {args.world} ranks x {args.threads} thread, "
          f"AdamW, fp32, {args.repeats} rounds, torch {torch.__version__}")
    result = measure(args)
    print(f"parameters: {result['params'] / 1e6:.2f}M; the state to save is 12 B/param = "
          f"{12 * result['params'] / 1024 ** 2:.1f} MiB (fp32 params 4 + Adam moments 8)")
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
