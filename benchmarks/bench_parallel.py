"""Tensor and sequence parallelism on a device mesh: step time, bytes each rank communicates
per step (counted through shardtrain's comm layer) against the analytic volume, and peak
memory per rank; next to torch's own recipe (``parallelize_module`` + FSDP2, as torchtitan
composes them) on the same model in the same run.

A Hugging Face ``LlamaForCausalLM`` built from a config (nothing downloaded) trains on
``--world`` processes (gloo on CPU, NCCL with ``--device cuda``) on every mesh that world
allows: plain data parallelism, data x tensor parallelism (``tensor_parallel.autotp_size``,
the llama preset), tensor parallelism over every rank, and data x Ulysses sequence
parallelism (``sequence_parallel_size``). Every mesh reads the same global batches.

Bytes per step per rank are the sizes of the tensors this rank hands to each collective
(what ``comm.add_observer`` sees; a group of one rank moves nothing and is not counted),
split by the group they go over, against the volume the layout implies, per micro-batch of
B sequences of T tokens, L layers of width H (fp32, 4 bytes):

* tensor-parallel group: the row-parallel layers' all-reduce of their output in forward
  (o_proj, down_proj: 2 per layer) and the column-parallel layers' all-reduce of their
  input's gradient in backward, once per shared input (q, k and v read one; gate and up
  another: 2 per layer), each ``B*T*H*4`` bytes;
* sequence-parallel group: Ulysses's all-to-all of q, k, v and the attention output, in
  forward and again in backward, each this rank's ``B*T/S`` tokens of its heads;
* ZeRO's group (the data- x sequence-parallel ranks, N of them): the gradients of this
  rank's P parameters (its tensor-parallel slice), ``4P`` all-reduced at stage 0; at stages
  1 and 2 ``4P`` reduce-scattered and ``4P/N`` all-gathered (the updated shard);
* the rest (loss, gradient norm, overflow flags): scalars, counted in the total.

The torch side (``--torch``, meshes with tensor parallelism) splits the same projections with
``ColwiseParallel``/``RowwiseParallel`` over the tensor dimension of a 2-D ``DeviceMesh`` and
shards each decoder layer and the root with ``fully_shard`` over the data dimension; DTensor's
collectives do not pass through shardtrain's comm layer, so only its step time, loss and
memory are reported.

    python benchmarks/bench_parallel.py                       # 4 ranks, CPU, a few minutes
    python benchmarks/bench_parallel.py --tiny --world 2      # the smoke run (seconds)
    python benchmarks/bench_parallel.py --device cuda --world 4 --json parallel.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]

MODELS = {  # LlamaConfig fields
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1024),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=128),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="processes (default 4)")
    p.add_argument("--tiny", action="store_true", help="the tiny model, 2 steps (smoke run)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch per replica (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="ZeRO stage of every mesh (default 1; at 3, which shards as FSDP2 does, "
                        "ZeRO's bytes are measured without an analytic volume)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mesh (default 6)")
    p.add_argument("--meshes", help="comma-separated subset of the meshes, e.g. dp4,dp2xtp2")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                   help="also run parallelize_module + FSDP2 on the tensor-parallel meshes "
                        "(default on)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.steps = min(args.seq, 32), min(args.steps, 2)
    return args


def meshes(world: int, heads: int) -> Dict[str, Tuple[int, int]]:
    """Name -> (tensor-parallel size, sequence-parallel size) of the meshes ``world`` allows."""
    out = {f"dp{world}": (1, 1)}
    if world % 2 == 0 and world > 2:
        out[f"dp{world // 2}xtp2"] = (2, 1)
    if heads % world == 0:
        out[f"tp{world}"] = (world, 1)
    if world % 2 == 0 and heads % 2 == 0:
        out[f"dp{world // 2}xsp2" if world > 2 else "sp2"] = (1, 2)
    return out


def _llama(fields: Dict[str, Any], seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**fields, max_position_embeddings=seq,
                                        attn_implementation="sdpa"))


def _global_batch(step: int, replicas: int, micro: int, seq: int, vocab: int) -> torch.Tensor:
    """The same global batch for every mesh: ``replicas`` rows of ``micro`` sequences; a
    mesh with fewer data-parallel replicas reads several rows in one micro-batch."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (replicas * micro, seq), generator=g)


class Counter:
    """Bytes handed to collectives, by the group they go over (only groups of 2 or more)."""

    def __init__(self):
        self.bytes: Dict[str, int] = {}
        self.on = False

    def __call__(self, op: str, tensor: torch.Tensor, group) -> None:
        if not self.on or (group is not None and group.size() == 1):
            return
        name = "world" if group is None else group.name
        self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()


def analytic(fields: Dict[str, Any], tp: int, sp: int, dp: int, micro: int, seq: int,
             stage: int, local_params: int) -> Dict[str, int]:
    """Bytes per step per rank the layout implies (see the module docstring)."""
    h, layers = fields["hidden_size"], fields["num_hidden_layers"]
    head_dim = h // fields["num_attention_heads"]
    tokens = micro * (seq // sp)  # this rank's tokens per micro-batch
    out = {}
    if tp > 1:
        out["tp"] = layers * (2 + 2) * tokens * h * 4
    if sp > 1:
        kv = max(fields["num_key_value_heads"], sp) * head_dim  # kv heads copied up to S
        out["sp"] = 2 * layers * (2 * tokens * h + 2 * tokens * kv) * 4
    n = dp * sp
    if n > 1 and stage < 3:
        out["zero"] = 4 * local_params if stage == 0 else 4 * local_params + 4 * local_params // n
    return out


def _ratios(measured: Dict[str, int], want: Dict[str, int]) -> Dict[str, float]:
    return {k: measured.get(k, 0) / v for k, v in want.items() if v}


def _shardtrain_run(args, fields, name: str, tp: int, sp: int, world: int, device: str):
    import shardtrain
    from shardtrain import comm
    from shardtrain.memory import peak_memory
    from shardtrain.parallel import shard_sequence
    dp = world // (tp * sp)
    micro = args.micro * tp * sp  # the same global batch on every mesh
    config = {"train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "sequence_parallel_size": sp}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    counter = Counter()
    comm.add_observer(counter, with_group=True)
    with peak_memory() as peak:
        engine, *_ = shardtrain.initialize(model=_llama(fields, args.seq), config=config)
        replica = engine.mesh.coordinate()["dp"]
        times, losses = [], []
        with peak_memory() as train:  # the steps alone, above the set-up
            for step in range(args.steps + 1):
                rows = _global_batch(step, world, args.micro, args.seq, fields["vocab_size"])
                mine = rows.view(dp, -1, args.seq)[replica]
                batch = {"input_ids": mine, "labels": mine.clone()}
                if sp > 1:
                    batch = shard_sequence(batch, engine.mesh.sp)
                batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                counter.on = step > 0  # the first step warms up
                _sync(device)
                start = time.perf_counter()
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                _sync(device)
                if step > 0:
                    times.append(time.perf_counter() - start)
                losses.append(float(loss.detach()))
        counter.on = False
    comm.remove_observer(counter)
    local = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel
                for p in engine.module.parameters())
    states = engine.model_state_bytes()
    engine.destroy()
    per_step = {k: v // args.steps for k, v in counter.bytes.items()}
    by_class = {"tp": per_step.get("tp", 0), "sp": per_step.get("sp", 0),
                "zero": per_step.get("zero", 0) + per_step.get("dp", 0)}
    want = analytic(fields, tp, sp, dp, micro, args.seq, args.stage, local)
    return {"mesh": name, "engine": "shardtrain", "step_s": statistics.median(times),
            "losses": losses, "bytes": by_class, "total_bytes": sum(per_step.values()),
            "analytic": want, "ratio": _ratios(by_class, want), "peak_host": peak["host"],
            "peak_device": peak["device"], "train_peak_host": train["host"],
            "train_peak_device": train["device"], "model_state_bytes": states["total"],
            "local_params": local}


def _torch_run(args, fields, name: str, tp: int, world: int, device: str):
    """torchtitan's recipe: the projections split by ``parallelize_module`` over the mesh's
    "tp" dimension, every decoder layer and the root sharded by ``fully_shard`` over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from shardtrain.memory import peak_memory
    dp = world // tp
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    with peak_memory() as peak:
        model = _llama(fields, args.seq).to(device)
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        if dp > 1:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        replica = mesh["dp"].get_local_rank()
        times, losses = [], []
        with peak_memory() as train:  # the steps alone, above the set-up
            for step in range(args.steps + 1):
                rows = _global_batch(step, world, args.micro, args.seq, fields["vocab_size"])
                mine = rows.view(dp, -1, args.seq)[replica].to(device)
                _sync(device)
                start = time.perf_counter()
                loss = model(input_ids=mine, labels=mine).loss
                loss.backward()
                _clip_dtensor_grads(model, 1.0)
                opt.step()
                opt.zero_grad()
                _sync(device)
                if step > 0:
                    times.append(time.perf_counter() - start)
                losses.append(float(loss.detach()))
    return {"mesh": name, "engine": "torch TP+FSDP2" if dp > 1 else "torch TP",
            "step_s": statistics.median(times), "losses": losses, "peak_host": peak["host"],
            "peak_device": peak["device"], "train_peak_host": train["host"],
            "train_peak_device": train["device"], "model_state_bytes": _torch_states(model, opt)}


def _torch_states(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, their gradients (as many; alive from backward to
    ``zero_grad``) and optimizer states, DTensors by their local shards."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(local(p) for p in params) * 2 + sum(local(v) for v in states)


def _clip_dtensor_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Clips by the global norm when the gradients live on different meshes (2-D for the
    split projections, 1-D for the rest), as torchtitan's clipping does: one norm per mesh,
    made whole, then combined."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_mesh: Dict[Any, List[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = float(torch.stack(norms).norm())
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker(rank, world, port, args, job, queue):
    """One mesh and one engine on this set of processes (a fresh set per run, so that each
    one's peak memory starts from the same level)."""
    import logging
    import shardtrain
    from shardtrain import comm
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    shardtrain.init_distributed()
    fields = MODELS["tiny" if args.tiny else "small"]
    name, tp, sp, engine = job
    if engine == "shardtrain":
        row = _shardtrain_run(args, fields, name, tp, sp, world, args.device)
    else:
        row = _torch_run(args, fields, name, tp, world, args.device)
    every = comm.all_gather_object(row)
    if rank == 0:
        queue.put(every)
    shardtrain.destroy()  # the ranks meet, then close their connections


def jobs(args) -> List[Tuple[str, int, int, str]]:
    fields = MODELS["tiny" if args.tiny else "small"]
    chosen = meshes(args.world, fields["num_attention_heads"])
    if args.meshes:
        chosen = {k: v for k, v in chosen.items() if k in args.meshes.split(",")}
    out = []
    for name, (tp, sp) in chosen.items():
        out.append((name, tp, sp, "shardtrain"))
        if args.torch and tp > 1:
            out.append((name, tp, sp, "torch"))
    return out


def summarise(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One run's row: the slowest rank's median step, the loss of the global batch (the mean
    over ranks: every replica has as many ranks), the largest peak memory, every rank's
    bytes per step."""
    row = dict(ranks[0])
    row["step_s"] = max(r["step_s"] for r in ranks)
    row["losses"] = [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks))]
    row["peak_host"] = max(r["peak_host"] or 0 for r in ranks)
    row["peak_device"] = max(r["peak_device"] or 0 for r in ranks)
    row["train_peak_host"] = max(r["train_peak_host"] or 0 for r in ranks)
    row["train_peak_device"] = max(r["train_peak_device"] or 0 for r in ranks)
    if "bytes" in row:
        row["bytes_per_rank"] = [r["bytes"] for r in ranks]
        row["ratio"] = {k: max(r["ratio"][k] for r in ranks) for k in row["ratio"]}
    row["model_state_bytes"] = max(r["model_state_bytes"] for r in ranks)
    return row


def report(rows: List[Dict[str, Any]], args) -> Dict[str, Any]:
    base = {r["mesh"]: r["step_s"] for r in rows if r["engine"] == "shardtrain"}
    print(f"{'mesh':<10}{'engine':<16}{'step ms':>9}{'loss':>9}{'peak MiB':>10}{'steps MiB':>10}"
          f"{'states MiB':>11}  bytes/step/rank: measured / analytic (ratio)")
    for r in rows:
        peak = (r["peak_device"] or r["peak_host"]) / 2**20
        steps = (r["train_peak_device"] or r["train_peak_host"]) / 2**20
        states = f"{r['model_state_bytes'] / 2**20:>11.2f}"
        volume = "  ".join(f"{k} {_mib(r['bytes'][k])}/{_mib(v)} ({r['ratio'][k]:.3f})"
                           for k, v in r["analytic"].items()) if "analytic" in r else \
            f"step {r['step_s'] / base[r['mesh']]:.2f}x shardtrain's"
        print(f"{r['mesh']:<10}{r['engine']:<16}{1000 * r['step_s']:>9.1f}{r['losses'][-1]:>9.4f}"
              f"{peak:>10.1f}{steps:>10.1f}{states}  {volume}")
    return {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}M"


def main(argv=None):
    args = parse_args(argv)
    rows = [summarise(run_ranks(worker, args.world, args, job, device=args.device))
            for job in jobs(args)]
    result = report(rows, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
