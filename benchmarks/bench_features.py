"""What optimizer offload, activation checkpointing and torch.compile cost and save.

On the GPT-style model (examples/gpt.py preset "small", sequence 128), one process:

* step time at ZeRO stage 2 with ``offload_optimizer: {device: cpu}`` against without (on a
  CPU-only machine both live in the same memory, so the times should be close; on CUDA the
  optimizer step moves to the host);
* bytes autograd keeps for backward in one forward, with and without activation
  checkpointing of every block, and the step time of each;
* step time compiled (inductor) against eager.

    python benchmarks/bench_features.py                 # CPU, about 3 minutes on 2 cores
    python benchmarks/bench_features.py --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="small")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


class CheckpointedGPT:
    """Wraps gpt.GPT's forward so that each block runs under activation checkpointing."""

    @staticmethod
    def forward(model, idx, targets):
        from shardtrain.activation_checkpointing import checkpoint
        pos = torch.arange(idx.size(1), device=idx.device)
        x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
        for block in model.blocks:
            x = checkpoint(block, x)
        logits = model.lm_head(model.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build(args, zero=None, checkpointed=False, compiled=False):
    import gpt
    import shardtrain
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config(args.model))
    if checkpointed:
        model.forward = lambda idx, targets=None, m=model: CheckpointedGPT.forward(m, idx, targets)
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, **(zero or {})}})
    if compiled:
        engine.compile()
    return engine


def timed(engine, data, steps):
    sync = __import__("shardtrain").accelerator.synchronize
    times = []
    for i in range(steps + 2):  # two warm-up steps (compilation happens there)
        batch = data[i % len(data)]
        sync()
        start = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, loss.item()


def saved_bytes(engine, batch) -> int:
    seen = set()
    total = [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine(batch[:, :-1], batch[:, 1:])
    engine.zero_grad()
    return total[0]


def main(argv=None):
    args = parse_args(argv)
    os.environ["SHARDTRAIN_ACCELERATOR"] = args.device
    torch.set_num_threads(args.threads)
    import gpt
    cfg = gpt.gpt_config(args.model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (4, args.micro, cfg.block_size + 1), generator=g)
    rows = {}
    plain = build(args)
    rows["eager"] = timed(plain, data, args.steps)
    rows["saved_plain"] = saved_bytes(plain, data[0])
    rows["offload"] = timed(build(args, {"offload_optimizer": {"device": "cpu"}}), data,
                            args.steps)
    ckpt = build(args, checkpointed=True)
    rows["checkpointed"] = timed(ckpt, data, args.steps)
    rows["saved_checkpointed"] = saved_bytes(ckpt, data[0])
    if not args.skip_compile:
        rows["compiled"] = timed(build(args, compiled=True), data, args.steps)
    mib = 2 ** 20
    print(f"shardtrain features, {args.device}, model '{args.model}' "
          f"({sum(p.numel() for p in plain.module.parameters()) / 1e6:.1f}M), "
          f"micro-batch {args.micro} x {cfg.block_size}, ZeRO stage 2, torch {torch.__version__}")
    print(f"  step, eager                 {rows['eager'][0]:8.1f} ms")
    print(f"  step, optimizer offloaded   {rows['offload'][0]:8.1f} ms   "
          f"ratio {rows['offload'][0] / rows['eager'][0]:.3f}")
    print(f"  step, checkpointed blocks   {rows['checkpointed'][0]:8.1f} ms   "
          f"ratio {rows['checkpointed'][0] / rows['eager'][0]:.3f}")
    print(f"  saved for backward          {rows['saved_plain'] / mib:8.1f} MiB plain, "
          f"{rows['saved_checkpointed'] / mib:.1f} MiB checkpointed "
          f"({rows['saved_checkpointed'] / rows['saved_plain']:.2f}x)")
    if "compiled" in rows:
        print(f"  step, compiled (inductor)   {rows['compiled'][0]:8.1f} ms   "
              f"ratio {rows['compiled'][0] / rows['eager'][0]:.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
