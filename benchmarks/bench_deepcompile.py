"""DeepCompile against eager shardtrain and FSDP2 (eager and per-block torch.compile), side by
side in one run.

Each engine trains the same GPT from the same initialisation on the same batches, on 2 CPU
processes with one thread each (gloo); timed blocks alternate between the engines so that
drift on a shared machine hits all alike. Reported: the median step time of each and its
ratio to eager shardtrain at the same stage, the peak memory a step raised (host resident
memory on the CPU, allocated bytes on CUDA), the largest loss difference from eager, and the
two warm-up steps' time, which includes compiling (DeepCompile's schedule starts its later
passes at step 1, so the timed steps run them). Two models: the default one, and one of many
small layers, where the host's per-layer work (hooks, Python) weighs most.

    python benchmarks/bench_deepcompile.py                  # both models, stages 1, 2 and 3
    python benchmarks/bench_deepcompile.py --models small --stages 3 --blocks 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)
from bench_fsdp import _batches, _build_fsdp, _engine_step, _fsdp_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

#: name -> examples/gpt.py preset and overrides
MODELS = {"small": ("small", {}), "many_layers": ("tiny", {"n_layer": 24, "n_embd": 64}),
          "tiny": ("tiny", {})}  # tiny: a quick look (the suite's smoke run)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--models", default="small,many_layers", help=f"of {sorted(MODELS)}")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages (default 1,2,3)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch per rank (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per engine (default 4)")
    p.add_argument("--steps", type=int, default=2, help="steps per block (default 2)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _peak_step(step, tokens):
    """The step's loss and the peak memory it raised (device bytes on CUDA, else host)."""
    from shardtrain.memory import peak_memory
    with peak_memory() as peak:
        loss = step(tokens)
    return loss, (peak["device"] if torch.cuda.is_available() else peak["host"]) or 0


def _worker(rank, world, port, args, model_name, queue):
    torch.set_num_threads(args.threads)
    import gpt
    import shardtrain
    from torch.distributed.device_mesh import init_device_mesh

    shardtrain.init_distributed()
    preset, overrides = MODELS[model_name]
    cfg = gpt.gpt_config(preset, block_size=args.seq, **overrides)
    device = shardtrain.accelerator.device()
    mesh = init_device_mesh(device.type, (world,))
    engines, steps = {}, {}
    for stage in (int(s) for s in args.stages.split(",")):
        for compiled in (False, True):
            torch.manual_seed(0)
            engine, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config={
                "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": stage, "overlap_comm": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
                "compile": {"deepcompile": compiled}})
            if compiled:  # the schedule's later passes from step 1: the timed steps run them
                later = ["z3", "prefetch", "selective_gather"] if stage == 3 else ["z1"]
                engine.compile(backend=args.backend, schedule=[(0, later[:1]), (1, later)])
            name = f"{'deepcompile' if compiled else 'eager'}{stage}"
            engines[name] = engine
            steps[name] = lambda tokens, e=engine: _engine_step(e, tokens, rank, 1)
    for compiled in (False, True):
        fsdp = _build_fsdp(gpt, cfg, device, mesh, True, True)
        if compiled:
            for block in fsdp[0].blocks:
                block.compile(backend=args.backend)
        name = "fsdp2_compiled" if compiled else "fsdp2"
        steps[name] = lambda tokens, f=fsdp: _fsdp_step(f, tokens, rank, 1)
    names = list(steps)
    warm = 2  # the first step compiles; the second recompiles with the schedule's later passes
    total = warm + args.blocks * args.steps
    data = _batches(cfg, total, world, args.micro).view(total, 1, world, args.micro, -1).to(device)
    first, times, peaks, losses = {}, {n: [] for n in names}, {n: 0 for n in names}, {}
    for name in names:
        start = time.perf_counter()
        losses[name] = [steps[name](data[k]) for k in range(warm)]
        first[name] = time.perf_counter() - start
    for block in range(args.blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            shardtrain.comm.barrier()
            start = time.perf_counter()
            for s in range(args.steps):
                loss, peak = _peak_step(steps[name], data[warm + block * args.steps + s])
                losses[name].append(loss)
                peaks[name] = max(peaks[name], peak)
            times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        queue.put({"model": model_name, "params": gpt.GPT(cfg).num_parameters(), "times": times,
                   "first": first, "peaks": peaks, "losses": losses})
    shardtrain.destroy()


def report(out) -> None:
    times = {n: statistics.median(v) for n, v in out["times"].items()}
    print(f"\nmodel {out['model']} ({out['params'] / 1e6:.2f}M parameters)")
    print(f"  {'engine':16} {'step ms':>8} {'vs eager':>8} {'warm-up s':>10} {'peak MiB':>9} "
          f"{'max|dloss|':>10}")
    for name, t in times.items():
        stage = name[-1] if not name.startswith("fsdp2") else None
        base = times.get(f"eager{stage}") if stage else times.get("fsdp2")
        ref = out["losses"][f"eager{stage}"] if stage else out["losses"]["fsdp2"]
        dloss = max(abs(a - b) for a, b in zip(out["losses"][name], ref))
        print(f"  {name:16} {t * 1e3:8.1f} {t / base:8.3f} {out['first'][name]:10.1f} "
              f"{out['peaks'][name] / 2**20:9.1f} {dloss:10.2e}")
    print("  vs eager: the ratio to eager shardtrain at the same stage (FSDP2 rows: to eager "
          "FSDP2). warm-up: the first two steps (compiling). peak: the most a step raised "
          "memory (host resident on the CPU).")


def main(argv=None):
    args = parse_args(argv)
    print(f"DeepCompile vs eager and FSDP2: {args.world} ranks x {args.threads} thread, "
          f"backend {args.backend}, seq {args.seq}, micro-batch {args.micro}, torch {torch.__version__}")
    results = []
    for model in args.models.split(","):
        results.append(run_ranks(_worker, args.world, args, model, device=args.device))
        report(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
