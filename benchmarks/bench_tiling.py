"""Peak memory of a Llama-shaped MLP and of the logits + cross-entropy, untiled and tiled
along the sequence (shardtrain.parallel.TiledMLP, tiled_logits_loss), forward + backward of
one long sequence on CPU, measured with torch.profiler's memory timeline (every allocation
and free, by category).

    python benchmarks/bench_tiling.py                        # sequence 8192, tiles 1 4 16
    python benchmarks/bench_tiling.py --seq 16384 --tiles 1 2 8 32 --json tiling.json

Reported per run: the peak of all live CPU tensors during the step, the same less what was
live before it (parameters, the input), and the ratio to the untiled run; the tiled result
agrees with the untiled one (the largest difference is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from shardtrain.parallel import TiledMLP, tiled_logits_loss


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def peak_bytes(step: Callable[[], torch.Tensor]) -> Dict[str, float]:
    """Peak of live CPU tensor bytes while ``step`` runs (forward and backward)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        value = step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        with warnings.catch_warnings():  # deprecated for CUDA's snapshots; the CPU has no other
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(row) for row in sizes]
    return {"peak_mib": max(totals) / 2**20, "peak_over_start_mib": (max(totals) - totals[0]) / 2**20,
            "value": value}


def _mlp_runs(args) -> List[Dict[str, float]]:
    torch.manual_seed(0)
    mlp = LlamaMLP(args.hidden, args.inter)
    x = torch.randn(1, args.seq, args.hidden, requires_grad=True)
    rows = []
    for tiles in args.tiles:
        x.grad = None
        mlp.zero_grad(set_to_none=True)

        def step(tiles=tiles):
            out = mlp(x) if tiles == 1 else TiledMLP.apply(lambda m, t: m(t), mlp, x, tiles)
            out.square().mean().backward()
            return x.grad.clone()
        rows.append({"what": "mlp", "tiles": tiles, **peak_bytes(step)})
    return rows


def _loss_runs(args) -> List[Dict[str, float]]:
    torch.manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(1, args.seq, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.seq))
    rows = []
    for tiles in args.tiles:
        hidden.grad = None
        head.zero_grad(set_to_none=True)

        def step(tiles=tiles):
            if tiles == 1:
                loss = F.cross_entropy(head(hidden).float().flatten(0, 1), labels.flatten())
            else:
                loss = tiled_logits_loss(head, hidden, labels, tiles)
            loss.backward()
            return hidden.grad.clone()
        rows.append({"what": "logits+loss", "tiles": tiles, **peak_bytes(step)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--tiles", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tiles[0] != 1:
        args.tiles = [1] + args.tiles  # the untiled reference comes first
    torch.set_num_threads(1)
    print(f"sequence {args.seq}, hidden {args.hidden}, intermediate {args.inter}, vocab {args.vocab}")
    print(f"{'what':<12} {'tiles':>5} {'peak MiB':>9} {'over start':>10} {'vs untiled':>10} {'max |diff|':>10}")
    results = []
    for rows in (_mlp_runs(args), _loss_runs(args)):
        base = rows[0]
        for r in rows:
            diff = (r.pop("value") - base["value"]).abs().max().item() if r is not base else 0.0
            r["ratio"], r["max_abs_diff"] = r["peak_over_start_mib"] / base["peak_over_start_mib"], diff
            results.append(r)
        base.pop("value", None)
        for r in rows:
            print(f"{r['what']:<12} {r['tiles']:>5} {r['peak_mib']:>9.1f} {r['peak_over_start_mib']:>10.1f} "
                  f"{r['ratio']:>10.2f} {r['max_abs_diff']:>10.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
