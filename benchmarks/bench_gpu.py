"""One-command GPU benchmark: a GPT-2 124M-shaped model, bf16, sequence 1024.

For ZeRO stages 0-3 (stage 3 also with its blocks as leaf modules, and stage 0 with
torch.compile) it prints tokens/s, model FLOPs utilisation against the device's peak, and
peak memory, on the GPUs of one machine (one process per GPU, NCCL). Finishes in a few
minutes on one H100/H200.

    python benchmarks/bench_gpu.py                      # every GPU of this machine
    python benchmarks/bench_gpu.py --peak-tflops 989    # MFU against a given peak
    python benchmarks/bench_gpu.py --tiny --device cpu  # a smoke run without a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _ranks import run_ranks  # noqa: E402  (next to this file)

# Dense bf16 peak (TFLOP/s) by device name, from the vendors' datasheets.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: GPU count)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch per GPU (default 8)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per run (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages (default 0,1,2,3)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    p.add_argument("--leaf", default="Block",
                   help="also run stage 3 with these module classes as leaf modules, gathered "
                        "whole (default Block: one all-gather per transformer block); '' skips it")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak bf16 TFLOP/s for MFU (default: from the device name)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def model_config(tiny: bool):
    import gpt
    if tiny:
        return gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
    return gpt.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def flops_per_token(cfg, n_params: int) -> float:
    """6N for the weights' matmuls (forward + backward) plus attention's 12 L T d."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def peak_tflops(args) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    if args.device != "cuda":
        return 0.0
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), 0.0)


def _run(rank, world, port, args, stage, compiled, leaf, queue):
    import gpt
    import shardtrain
    shardtrain.init_distributed()
    cfg = model_config(args.tiny)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "overlap_comm": True,
                              **({"leaf_module": {"classes": leaf}} if leaf else {})}})
    if compiled:
        engine.compile()
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size + 1), generator=g)
    data = data.to(engine.device)
    sync = shardtrain.accelerator.synchronize
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        loss = engine(data[:, :-1], data[:, 1:])
        engine.backward(loss)
        engine.step()
    sync()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.micro * cfg.block_size * world
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    if rank == 0:
        queue.put({"stage": stage, "compiled": compiled, "leaf": leaf, "tokens_s": tokens / elapsed,
                   "step_ms": elapsed / args.steps * 1e3, "peak_gib": peak / 2 ** 30,
                   "loss": loss.item(), "params": n_params,
                   "flops_token": flops_per_token(cfg, n_params), "world": world})
    shardtrain.destroy()


def measure(args, stage, compiled, leaf):
    world = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 1)
    return run_ranks(_run, world, args, stage, compiled, leaf, device=args.device, timeout=900)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device here; `--device cpu --tiny` is a smoke run "
                         "on the CPU")
    peak = peak_tflops(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"shardtrain GPU benchmark: {device}, torch {torch.__version__}, bf16, "
          f"micro-batch {args.micro}, peak {peak or 'unknown'} TFLOP/s")
    stages = [int(s) for s in args.stages.split(",")]
    leaf = [c for c in args.leaf.split(",") if c]
    runs = [(s, False, []) for s in stages]
    if 3 in stages and leaf:
        runs.append((3, False, leaf))
    if not args.no_compile:
        runs.append((0, True, []))
    rows, failed = [], []
    for stage, compiled, leaf in runs:
        name = f"stage {stage}{' +compile' if compiled else ''}{' +leaf' if leaf else ''}"
        try:
            r = measure(args, stage, compiled, leaf)
        except SystemExit as error:  # one failed run does not cost the others
            print(f"{name:17} FAILED: {error}")
            failed.append(name)
            continue
        achieved = r["tokens_s"] * r["flops_token"] / 1e12
        r["mfu"] = achieved / (peak * r["world"]) if peak else None
        rows.append(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{name:17} {r['params'] / 1e6:6.1f}M params  "
              f"{r['tokens_s']:10.0f} tokens/s  {r['step_ms']:8.1f} ms/step  MFU {mfu:>6}  "
              f"peak {r['peak_gib']:.2f} GiB  loss {r['loss']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
