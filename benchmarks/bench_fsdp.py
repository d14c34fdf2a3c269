"""shardtrain ZeRO stages 1, 2 and 3 against torch FSDP2 (``fully_shard``), side by side in one run.

Every engine trains the same GPT-style model (examples/gpt.py preset "small", about 4M
parameters, sequence 128, micro-batch 8 per rank) from the same initialisation (seed 0) on
the same batches, with AdamW (no weight decay) and no clipping, on 2 CPU processes with one
thread each (gloo). FSDP2 shards each GPT block, then the root, as its users do. Pairs:

* shardtrain stage 2 vs FSDP2 ``reshard_after_forward=False`` (the ZeRO-2 analogue);
* shardtrain stage 3 vs FSDP2 ``reshard_after_forward=True`` (the ZeRO-3 analogue);
* shardtrain stage 1 vs FSDP2 ``reshard_after_forward=False`` too: the closest analogue, as
  FSDP2 has no mode that keeps whole parameters between steps. At gas > 1 this partner
  accumulates unsharded gradients under ``set_requires_gradient_sync(False)`` and
  reduce-scatters on the last micro-step, as stage 1 does; at gas 1 it is the stage-2 partner.

Timed blocks rotate through the engines so that drift on a shared machine hits all alike.
Per pair: median step times and their ratio (also for the fastest block, and for rank 0's CPU
time, which time spent waiting does not inflate), the largest loss difference over all steps,
and the bytes of model states per rank next to the ZeRO formula. FSDP2's bytes are counted
after a backward: sharded parameters (``to_local()``), gradients and optimizer states.

shardtrain stage 3 runs with shardtrain's (DeepSpeed's) defaults unless told otherwise: on
this small model that keeps the attention weights whole (``--stage3-persistence``) and
every gathered group alive from its forward to its backward (``--stage3-reuse``); pass
``--stage3-persistence 0 --stage3-reuse 0`` for the exact reshard_after_forward=True pattern.

    python benchmarks/bench_fsdp.py                       # stages 1,2,3, gas 1, 1-3 min on 2 cores
    python benchmarks/bench_fsdp.py --stages 3 --blocks 3 --steps 1       # a quick look
    python benchmarks/bench_fsdp.py --gas 4 --blocks 4 --steps 1 --json fsdp.json
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

# FSDP2 engines by name: (reshard_after_forward, gradient sync on every micro-step).
FSDP_VARIANTS = {
    "fsdp2_keep": (False, True),          # ZeRO-2 analogue
    "fsdp2_keep_nosync": (False, False),  # the stage-1 partner when gas > 1
    "fsdp2_reshard": (True, True),        # ZeRO-3 analogue
}
FSDP_LABELS = {"fsdp2_keep": "FSDP2 raf=False", "fsdp2_keep_nosync": "FSDP2 raf=False+no_sync",
               "fsdp2_reshard": "FSDP2 raf=True"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--model", default="small", help="examples/gpt.py preset (default small)")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--n-embd", type=int, help="override the preset's width")
    p.add_argument("--micro", type=int, default=8, help="micro-batch per rank (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to pair (default 1,2,3)")
    p.add_argument("--gas", default="1", help="accumulation steps to run (default 1)")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks per engine (default 8)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per block (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--stage3-persistence", type=int,
                   help="stage3_param_persistence_threshold of shardtrain stage 3 (default: "
                        "shardtrain's, 100000 elements, which keeps the attention weights of "
                        "'small' whole; 0 shards every parameter, as FSDP2 does)")
    p.add_argument("--stage3-reuse", type=int,
                   help="stage3_max_reuse_distance of shardtrain stage 3 (default: shardtrain's, "
                        "1e9 elements, which keeps every group gathered from its forward to its "
                        "backward; 0 re-gathers in backward, as reshard_after_forward=True does)")
    p.add_argument("--stage3-leaf", default="",
                   help="comma-separated module classes that shardtrain stage 3 gathers whole "
                        "(zero_optimization.leaf_module.classes), e.g. Block: one all-gather per "
                        "block, as FSDP2 wraps each block (default: none)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def plan(stages, gas):
    """The pairs (shardtrain engine, FSDP2 engine) and the engines to build, in the order
    their timed blocks start (each pair side by side)."""
    pairs = []
    for s in stages:
        if s == 3:
            partner = "fsdp2_reshard"
        elif s == 1 and gas > 1:
            partner = "fsdp2_keep_nosync"
        else:
            partner = "fsdp2_keep"
        pairs.append((f"zero{s}", partner))
    names = []
    for pair in pairs:
        names += [n for n in pair if n not in names]
    return pairs, names


def _batches(cfg, n, world, micro, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, world, micro, cfg.block_size + 1), generator=g)


def _engine_step(engine, tokens, rank, gas):
    loss_sum = 0.0
    for k in range(gas):
        batch = tokens[k, rank]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach()
    return float(loss_sum) / gas


def _fsdp_step(fsdp, tokens, rank, gas):
    model, opt, sync_each = fsdp
    loss_sum = 0.0
    for k in range(gas):
        batch = tokens[k, rank]
        if not sync_each:  # accumulate unsharded gradients; reduce-scatter on the last one
            model.set_requires_gradient_sync(k == gas - 1)
        loss = model(batch[:, :-1], batch[:, 1:])
        (loss / gas).backward()
        loss_sum += loss.detach()
    opt.step()
    opt.zero_grad()
    return float(loss_sum) / gas


def _build_fsdp(gpt, cfg, device, mesh, reshard, sync_each):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = gpt.GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    return model, opt, sync_each


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _state_bytes_fsdp(fsdp, tokens, rank, gas):
    """Model-state bytes of an FSDP2 rank, counted after a backward (when gradients exist):
    the sharded parameters' local tensors, their gradients' and the optimizer states'."""
    from shardtrain.memory import count_bytes
    model, opt, sync_each = fsdp
    for k in range(gas):
        batch = tokens[k, rank]
        if not sync_each:
            model.set_requires_gradient_sync(k == gas - 1)
        (model(batch[:, :-1], batch[:, 1:]) / gas).backward()
    params = list(model.parameters())
    out = count_bytes({
        "params": [_local(p) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "optimizer": [_local(v) for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)]})
    opt.zero_grad()
    return out


def _worker(rank, world, port, args, gas, queue):
    torch.set_num_threads(args.threads)
    import gpt
    import shardtrain
    from torch.distributed.device_mesh import init_device_mesh

    shardtrain.init_distributed()
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v}
    cfg = gpt.gpt_config(args.model, block_size=args.seq, **overrides)
    device = shardtrain.accelerator.device()
    mesh = init_device_mesh(device.type, (world,))
    pairs, names = plan([int(s) for s in args.stages.split(",")], gas)

    engines = {}
    for name in names:
        if name.startswith("zero"):
            zero = {"stage": int(name[4:]), "overlap_comm": True}
            if args.stage3_persistence is not None and zero["stage"] == 3:
                zero["stage3_param_persistence_threshold"] = args.stage3_persistence
            if args.stage3_reuse is not None and zero["stage"] == 3:
                zero["stage3_max_reuse_distance"] = args.stage3_reuse
            if zero["stage"] == 3:
                zero["leaf_module"] = {"classes": [c for c in args.stage3_leaf.split(",") if c]}
            torch.manual_seed(0)
            engines[name], *_ = shardtrain.initialize(model=gpt.GPT(cfg), config={
                "train_micro_batch_size_per_gpu": args.micro,
                "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
                "zero_optimization": zero,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}})
        else:
            engines[name] = _build_fsdp(gpt, cfg, device, mesh, *FSDP_VARIANTS[name])
    n_params = gpt.GPT(cfg).num_parameters()

    def step(name, tokens):
        if name.startswith("zero"):
            return _engine_step(engines[name], tokens, rank, gas)
        return _fsdp_step(engines[name], tokens, rank, gas)

    total = 1 + args.blocks * args.steps  # one warm-up step each
    data = _batches(cfg, (total + 1) * gas, world, args.micro)  # + one for byte counting
    data = data.view(total + 1, gas, world, args.micro, -1).to(device)
    times = {name: [] for name in names}
    cpu_times = {name: [] for name in names}  # this process's CPU time, all its threads
    losses = {name: [step(name, data[0])] for name in names}
    for block in range(args.blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            shardtrain.comm.barrier()
            shardtrain.accelerator.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            for s in range(args.steps):
                losses[name].append(step(name, data[1 + block * args.steps + s]))
            shardtrain.accelerator.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
            cpu_times[name].append((time.process_time() - cpu_start) / args.steps)
    state_bytes = {}
    for name in names:
        if name.startswith("zero"):
            state_bytes[name] = engines[name].model_state_bytes()
        else:
            state_bytes[name] = _state_bytes_fsdp(engines[name], data[total], rank, gas)
    if rank == 0:
        queue.put({"gas": gas, "params": n_params, "pairs": pairs, "times": times,
                   "cpu_times": cpu_times, "losses": losses, "bytes": state_bytes})
    shardtrain.destroy()


def measure(args, gas):
    return run_ranks(_worker, args.world, args, gas, device=args.device)


def report(result, world):
    from shardtrain.memory import zero_formula_bytes
    mib = 1024 * 1024
    n = result["params"]
    print(f"gas={result['gas']}  params={n / 1e6:.2f}M")
    print(f"  {'pair':34} {'shardtrain ms':>13} {'FSDP2 ms':>9} {'ratio':>6} {'best':>6} "
          f"{'cpu':>6} {'max|dloss|':>10} {'st MiB':>7} {'FSDP2 MiB':>9} {'formula MiB':>11}")
    rows = []
    for ours, theirs in result["pairs"]:
        stage = int(ours[4:])
        t_ours = statistics.median(result["times"][ours])
        t_theirs = statistics.median(result["times"][theirs])
        best = min(result["times"][ours]) / min(result["times"][theirs])
        c_ours = statistics.median(result["cpu_times"][ours])
        c_theirs = statistics.median(result["cpu_times"][theirs])
        diff = max(abs(a - b) for a, b in zip(result["losses"][ours], result["losses"][theirs]))
        b_ours, b_theirs = result["bytes"][ours], result["bytes"][theirs]
        formula = zero_formula_bytes(n, world, stage, 4, 4, 8)
        label = f"ZeRO-{stage} vs {FSDP_LABELS[theirs]}"
        print(f"  {label:34} {t_ours * 1e3:13.1f} {t_theirs * 1e3:9.1f} "
              f"{t_ours / t_theirs:6.3f} {best:6.3f} {c_ours / c_theirs:6.3f} {diff:10.2e} "
              f"{b_ours['total'] / mib:7.2f} {b_theirs['total'] / mib:9.2f} "
              f"{formula / mib:11.2f}")
        rows.append({"gas": result["gas"], "stage": stage, "fsdp2": theirs,
                     "reshard_after_forward": FSDP_VARIANTS[theirs][0],
                     "shardtrain_ms": t_ours * 1e3, "fsdp2_ms": t_theirs * 1e3,
                     "ratio": t_ours / t_theirs, "best_block_ratio": best,
                     "max_loss_diff": diff,
                     "shardtrain_cpu_ms": c_ours * 1e3, "fsdp2_cpu_ms": c_theirs * 1e3,
                     "cpu_ratio": c_ours / c_theirs,
                     "shardtrain_bytes": b_ours, "fsdp2_bytes": b_theirs,
                     "formula_bytes": formula,
                     "shardtrain_block_ms": [t * 1e3 for t in result["times"][ours]],
                     "fsdp2_block_ms": [t * 1e3 for t in result["times"][theirs]],
                     "shardtrain_losses": result["losses"][ours],
                     "fsdp2_losses": result["losses"][theirs]})
    print("  ms: median over blocks of the wall time per optimizer step; ratio: shardtrain / "
          "FSDP2; best: the same\n  for the fastest block of each; cpu: the same for rank 0's "
          "CPU time (all its threads), which waiting\n  does not count. MiB: model states per "
          f"rank (fp32 params + grads + Adam); formula: ZeRO's\n  4 + 4 + 8 B/param at the "
          f"shardtrain stage, {world} ranks. FSDP2 shards parameters between steps at both\n"
          f"  settings: its formula is stage 3's, {zero_formula_bytes(n, world, 3) / mib:.2f} "
          "MiB. Per engine (MiB):")
    for name in sorted({t for _, t in result["pairs"]} | {o for o, _ in result["pairs"]}):
        parts = ", ".join(f"{k} {v / mib:.2f}" for k, v in result["bytes"][name].items()
                          if k != "total")
        print(f"    {name:18} {parts}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    print(f"shardtrain ZeRO vs torch FSDP2: {args.world} ranks x {args.threads} thread, "
          f"{args.device}, model '{args.model}', seq {args.seq}, micro-batch {args.micro}, "
          f"torch {torch.__version__}")
    rows = []
    for g in args.gas.split(","):
        rows += report(measure(args, int(g)), args.world)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
