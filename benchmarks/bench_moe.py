"""Expert parallelism against the ways a mixture of experts trains without it, side by side in
one run: step time, bytes per rank per step through the comm layer, and model-state bytes
per rank.

The model: a token embedding, L blocks of ``x + MoE(LayerNorm(x))`` (top-2 gating of E
experts, each a two-layer MLP of width 4H; capacity factor 1.0, so every buffer has a fixed
size), a final norm and a head. Every setup trains it from the same initialisation on the
same global batches, on W processes (gloo, CPU by default), AdamW, ZeRO stage 2 unless named:

* ``dense``: ``ep_size`` 1, every rank holds and updates every expert (data parallelism);
* ``leaf3``: ``ep_size`` 1 at ZeRO-3, each MoE layer a leaf module, gathered whole when it
  runs (how a model's own MoE block trains without expert parallelism);
* ``ep<N>``: ``ep_size`` N, each rank holds E/N experts; tokens travel by all-to-all;
* ``ddp``: torch's ``DistributedDataParallel`` on the model with every expert, torch's AdamW
  and clipping (the same training as ``dense``): the baseline of the "vs DDP" ratios.

With ``--model mixtral`` the model is transformers' ``MixtralForCausalLM`` (a few million
parameters: 4 layers of 8 experts, hidden 128, top-2) and ``ep<N>`` is AutoEP
(``expert_parallel.autoep_size`` N: dropless routing by the model's own router); ``leaf3``
makes each ``MixtralSparseMoeBlock`` the leaf module. Its all-to-all volume per rank per step,
on average over the ranks: per layer, the expert counts (E int64s) and four exchanges of the
(token, expert) rows, ``tokens * 2 * H`` values of 4 bytes each (what a rank sends out in
forward it receives back in backward, and the same for the way back); a single rank's share
depends on how many of its tokens the others' experts draw, so the figure is the ranks' mean.

Bytes per step per rank are the sizes of the tensors this rank hands to each collective
(``comm.add_observer``; a group of one rank moves nothing), by the group they go over. The
all-to-all's analytic volume per rank per step: per layer, two all-to-alls in forward
(tokens out, outputs back) and two in backward, each of this rank's ``[E, C, H]`` buffer,
``C = ceil(2 * tokens / E)`` (top-2, factor 1.0), 4 bytes a value.

    python benchmarks/bench_moe.py                      # 4 ranks, CPU, a minute or two
    python benchmarks/bench_moe.py --tiny --world 2     # the smoke run
    python benchmarks/bench_moe.py --model mixtral      # AutoEP on a Mixtral
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)
from bench_parallel import Counter as _GroupCounter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"small": dict(hidden=128, experts=8, layers=4, vocab=512),
          "tiny": dict(hidden=32, experts=4, layers=2, vocab=64),
          "mixtral": dict(hidden=128, experts=8, layers=4, vocab=1024, ffn=256, mixtral=1),
          "mixtral_tiny": dict(hidden=32, experts=4, layers=2, vocab=64, ffn=48, mixtral=1)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="processes (default 4)")
    p.add_argument("--tiny", action="store_true", help="the tiny model, 2 steps (smoke run)")
    p.add_argument("--model", choices=["layer", "mixtral"], default="layer",
                   help="layer: shardtrain.moe.MoE blocks (default); mixtral: transformers' "
                        "Mixtral with AutoEP")
    p.add_argument("--micro", type=int, default=4, help="sequences per rank (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per setup (default 8)")
    p.add_argument("--setups", help="comma-separated subset, e.g. dense,ep4")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.seq = 2, 16
    return args


def setups(world: int) -> Dict[str, Dict[str, int]]:
    out = {"dense": {"ep": 1, "stage": 2}, "leaf3": {"ep": 1, "stage": 3}}
    for ep in (2, 4, 8):
        if ep <= world and world % ep == 0:
            out[f"ep{ep}"] = {"ep": ep, "stage": 2}
    out["ddp"] = {"ep": 1, "stage": 0, "ddp": True}  # torch's own, the baseline of the ratios
    return out


class Counter(_GroupCounter):
    """Bytes handed to collectives, by group (bench_parallel's count), the all-to-alls apart."""

    def __call__(self, op: str, tensor: torch.Tensor, group) -> None:
        if op == "all_to_all" and self.on and group is not None and group.size() > 1:
            self.bytes["all_to_all"] = self.bytes.get("all_to_all", 0) + \
                tensor.numel() * tensor.element_size()
            return
        super().__call__(op, tensor, group)


def build_mixtral(fields: Dict[str, int]) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    h = fields["hidden"]
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=fields["vocab"], hidden_size=h, intermediate_size=fields["ffn"],
        num_hidden_layers=fields["layers"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=fields["experts"], num_experts_per_tok=2,
        max_position_embeddings=1024, attn_implementation="sdpa"))


def build(fields: Dict[str, int], ep: int) -> torch.nn.Module:
    from shardtrain.moe import MoE
    h, e = fields["hidden"], fields["experts"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(h)
            expert = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(),
                                         torch.nn.Linear(4 * h, h))
            self.moe = MoE(h, expert, num_experts=e, ep_size=ep, k=2, capacity_factor=1.0,
                           min_capacity=0, top2_2nd_expert_sampling=False)

        def forward(self, x):
            out, _, _ = self.moe(self.norm(x))
            return x + out

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(fields["vocab"], h)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(fields["layers"]))
            self.norm = torch.nn.LayerNorm(h)
            self.head = torch.nn.Linear(h, fields["vocab"])

        def forward(self, ids, labels):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    return Model()


def analytic_all_to_all(fields: Dict[str, int], tokens: int) -> int:
    e, h = fields["experts"], fields["hidden"]
    if fields.get("mixtral"):  # dropless: the rows themselves, and the counts
        return fields["layers"] * (4 * tokens * 2 * h * 4 + e * 8)
    capacity = math.ceil(2 * tokens / e)
    return fields["layers"] * 4 * e * capacity * h * 4


def _worker(rank, world, port, args, fields, name, setup, queue):
    torch.set_num_threads(args.threads)
    import shardtrain
    from shardtrain import comm
    shardtrain.init_distributed()
    if setup.get("ddp"):
        return _ddp_worker(rank, world, args, fields, name, queue)
    config = {"train_micro_batch_size_per_gpu": args.micro,
              "zero_optimization": {"stage": setup["stage"]},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    mixtral = bool(fields.get("mixtral"))
    if setup["stage"] == 3:  # every weight partitioned; each MoE layer gathered whole
        leaf = "MixtralSparseMoeBlock" if mixtral else "MoE"
        config["zero_optimization"].update(leaf_module={"classes": [leaf]},
                                           stage3_param_persistence_threshold=0)
    if mixtral and setup["ep"] > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": setup["ep"],
                                     "preset_model": "mixtral"}
    counter = Counter()
    comm.add_observer(counter, with_group=True)
    model = build_mixtral(fields) if mixtral else build(fields, setup["ep"])
    engine, *_ = shardtrain.initialize(model=model, config=config)
    times, losses = [], []
    for step, mine in enumerate(_batches(args, fields, world, rank)):
        counter.on = step > 0  # the first step warms up
        start = time.perf_counter()
        if mixtral:  # the model shifts its labels itself
            loss = engine(input_ids=mine[:, :-1], labels=mine[:, :-1]).loss
        else:
            loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        if step > 0:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    states = engine.model_state_bytes()
    mean = torch.tensor([float(counter.bytes.get("all_to_all", 0))])
    comm.all_reduce(mean)  # the ranks' mean: each one's share of the rows differs
    counter.bytes["all_to_all"] = int(mean.item()) // world
    if not counter.bytes["all_to_all"]:
        del counter.bytes["all_to_all"]
    if rank == 0:
        queue.put({"name": name, "times": times, "losses": losses, "states": states,
                   "bytes": {k: v // args.steps for k, v in counter.bytes.items()}})
    engine.destroy()
    shardtrain.destroy()


def _batches(args, fields, world: int, rank: int):
    """Each step's micro-batch of this rank (the same stream for every setup)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps + 1):
        rows = torch.randint(0, fields["vocab"], (world * args.micro, args.seq + 1), generator=g)
        yield rows[rank * args.micro:(rank + 1) * args.micro]


def _ddp_worker(rank, world, args, fields, name, queue):
    """torch's DistributedDataParallel on the model with every expert on every rank, AdamW
    (DeepSpeed's defaults the engine's setups use: lr 1e-3, weight decay 0.01) and clipping at
    1.0 (the engine's default): the same training as ``dense``."""
    import shardtrain
    mixtral = bool(fields.get("mixtral"))
    model = build_mixtral(fields) if mixtral else build(fields, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    times, losses = [], []
    for step, mine in enumerate(_batches(args, fields, world, rank)):
        start = time.perf_counter()
        if mixtral:
            loss = ddp(input_ids=mine[:, :-1], labels=mine[:, :-1]).loss
        else:
            loss = ddp(mine[:, :-1], mine[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step > 0:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:  # fp32 parameters, gradients and Adam's two moments; DDP all-reduces the
        queue.put({"name": name, "times": times, "losses": losses,  # gradients
                   "states": {"total": 16 * params}, "bytes": {"world": 4 * params}})
    shardtrain.destroy()


def report(fields, args, results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    tokens = args.micro * args.seq
    kind = "Mixtral (AutoEP)" if fields.get("mixtral") else "shardtrain.moe.MoE"
    print(f"\nmodel: {kind}, {fields['layers']} MoE layers of {fields['experts']} experts, hidden "
          f"{fields['hidden']}; {args.world} ranks x {args.micro} x {args.seq} tokens; "
          f"torch {torch.__version__}")
    base = statistics.median(results[0]["times"])
    ddp = next((statistics.median(r["times"]) for r in results if r["name"] == "ddp"), None)
    rows = []
    print(f"  {'setup':7} {'step ms':>8} {'vs dense':>8} {'vs DDP':>7} {'states KiB':>10} "
          f"{'all-to-all KiB':>14} {'analytic':>9} {'other KiB':>10}  loss")
    for r in results:
        t = statistics.median(r["times"])
        a2a = r["bytes"].get("all_to_all", 0)
        ep = int(r["name"][2:]) if r["name"].startswith("ep") else 1
        other = sum(r["bytes"].values()) - a2a
        expect = analytic_all_to_all(fields, tokens) if ep > 1 else 0
        vs_ddp = f"{t / ddp:7.3f}" if ddp else f"{'-':>7}"
        print(f"  {r['name']:7} {t * 1e3:8.1f} {t / base:8.3f} {vs_ddp} "
              f"{r['states']['total'] / 1024:10.0f} "
              f"{a2a / 1024:14.0f} {expect / 1024:9.0f} {other / 1024:10.0f}  "
              f"{r['losses'][-1]:.4f}")
        rows.append({"setup": r["name"], "step_s": t, "vs_ddp": t / ddp if ddp else None,
                     "states": r["states"]["total"],
                     "all_to_all": a2a, "analytic": expect, "other": other,
                     "losses": r["losses"]})
    print("  states: this rank's parameters, gradients, masters and optimizer states; "
          "all-to-all: bytes a rank handed to the expert-parallel all-to-alls per step (the "
          "ranks' mean); "
          "other: every other collective (gradient reduction, gathers, norms; for ddp the "
          "gradients DDP all-reduces, its states fp32 parameters, gradients and Adam's).")
    return rows


def main(argv=None):
    args = parse_args(argv)
    name = "small" if args.model == "layer" else "mixtral"
    fields = MODELS[f"{name}_tiny" if args.tiny and args.model == "mixtral" else
                    "tiny" if args.tiny else name]
    chosen = setups(args.world)
    if args.setups:
        chosen = {k: v for k, v in chosen.items() if k in args.setups.split(",")}
    sys.path.insert(0, str(ROOT / "src"))
    results = [run_ranks(_worker, args.world, args, fields, name, setup)
               for name, setup in chosen.items()]
    rows = report(fields, args, results)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
