"""shardtrain (ZeRO stage 0) against torch DDP, side by side in one run.

Both train the same GPT-style model (about 4M parameters, sequence 128) from the same
initialisation on the same batches, on 2 CPU processes with one thread each (gloo). Timed
blocks alternate between the two so that drift on a shared machine hits both alike; the
report is the ratio of median step times, the largest loss difference, and the bytes of
model states each rank holds.

    python benchmarks/bench_ddp.py                 # gas 1 and 4, about 3 minutes on 2 cores
    python benchmarks/bench_ddp.py --gas 1 --blocks 3 --steps 3    # a quick look
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--model", default="small", help="examples/gpt.py preset (default small)")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    p.add_argument("--micro", type=int, default=8, help="micro-batch per rank (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--gas", default="1,4", help="accumulation steps to run (default 1,4)")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per engine (default 5)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per block (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _batches(cfg, n, world, micro, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, world, micro, cfg.block_size + 1), generator=g)


def _ddp_step(model, opt, tokens, rank, gas):
    loss_sum = 0.0
    for k in range(gas):
        batch = tokens[k, rank]
        sync = k == gas - 1
        ctx = model.no_sync() if not sync else _null()
        with ctx:
            loss = model(batch[:, :-1], batch[:, 1:])
            (loss / gas).backward()
        loss_sum += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return float(loss_sum) / gas


def _engine_step(engine, tokens, rank, gas):
    loss_sum = 0.0
    for k in range(gas):
        batch = tokens[k, rank]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach()
    return float(loss_sum) / gas


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _state_bytes_ddp(model, opt):
    from shardtrain.memory import count_bytes
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return count_bytes({"params": params, "grads": grads, "optimizer": states})


def _worker(rank, world, port, args, gas, queue):
    torch.set_num_threads(args.threads)
    import gpt
    import shardtrain
    from torch.nn.parallel import DistributedDataParallel as DDP

    shardtrain.init_distributed()
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v}
    cfg = gpt.gpt_config(args.model, block_size=args.seq, **overrides)
    device = shardtrain.accelerator.device()
    torch.manual_seed(0)
    ddp_model = DDP(gpt.GPT(cfg).to(device), gradient_as_bucket_view=True,
                    device_ids=[device.index] if device.type == "cuda" else None)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3, weight_decay=0.0)
    torch.manual_seed(0)
    engine, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config={
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0, "zero_optimization": {"stage": 0, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}})
    n_params = sum(p.numel() for p in engine.module.parameters())

    total = 1 + args.blocks * args.steps  # one warm-up step each
    data = _batches(cfg, total * gas, world, args.micro).view(total, gas, world, args.micro, -1)
    data = data.to(device)
    times = {"ddp": [], "engine": []}
    losses = {"ddp": [], "engine": []}
    losses["ddp"].append(_ddp_step(ddp_model, ddp_opt, data[0], rank, gas))
    losses["engine"].append(_engine_step(engine, data[0], rank, gas))
    for block in range(args.blocks):
        order = ("ddp", "engine") if block % 2 == 0 else ("engine", "ddp")
        for name in order:
            shardtrain.comm.barrier()
            shardtrain.accelerator.synchronize()
            start = time.perf_counter()
            for s in range(args.steps):
                step_data = data[1 + block * args.steps + s]
                if name == "ddp":
                    losses[name].append(_ddp_step(ddp_model, ddp_opt, step_data, rank, gas))
                else:
                    losses[name].append(_engine_step(engine, step_data, rank, gas))
            shardtrain.accelerator.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        queue.put({"gas": gas, "params": n_params, "times": times, "losses": losses,
                   "bytes_engine": engine.model_state_bytes(),
                   "bytes_ddp": _state_bytes_ddp(ddp_model, ddp_opt)})
    shardtrain.destroy()


def measure(args, gas):
    return run_ranks(_worker, args.world, args, gas, device=args.device)


def report(result):
    t_ddp = statistics.median(result["times"]["ddp"])
    t_eng = statistics.median(result["times"]["engine"])
    diff = max(abs(a - b) for a, b in zip(result["losses"]["ddp"], result["losses"]["engine"]))
    mib = 1024 * 1024
    print(f"gas={result['gas']}  params={result['params'] / 1e6:.2f}M  "
          f"step: ddp {t_ddp * 1e3:.1f} ms, shardtrain {t_eng * 1e3:.1f} ms, "
          f"ratio {t_eng / t_ddp:.3f}  max|loss diff| {diff:.2e}")
    print(f"        model states per rank: shardtrain {result['bytes_engine']['total'] / mib:.1f} "
          f"MiB, ddp {result['bytes_ddp']['total'] / mib:.1f} MiB (params+grads+Adam; "
          f"formula 16 B/param = {16 * result['params'] / mib:.1f} MiB)")
    return {"gas": result["gas"], "ratio": t_eng / t_ddp, "ddp_ms": t_ddp * 1e3,
            "engine_ms": t_eng * 1e3, "max_loss_diff": diff,
            "engine_bytes": result["bytes_engine"], "ddp_bytes": result["bytes_ddp"]}


def main(argv=None):
    args = parse_args(argv)
    print(f"shardtrain vs torch DDP: {args.world} ranks x {args.threads} thread, model "
          f"'{args.model}', seq {args.seq}, micro-batch {args.micro}, torch {torch.__version__}")
    rows = [report(measure(args, int(g))) for g in args.gas.split(",")]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
