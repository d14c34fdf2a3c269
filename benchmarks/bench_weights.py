"""Weights and checkpoints at ZeRO stage 3: memory per rank, and time against DCP.

A GPT-style model (examples/gpt.py, preset "small" by default) trains one step at ZeRO
stage 3 on ``--world`` CPU processes, so each rank holds 1/world of it. Then, in one run:

* ``save_16bit_model`` (full weights, streamed from rank 0), ``save_checkpoint``
  (synchronous, then asynchronous), ``load_checkpoint``, ``load_pretrained`` of the saved
  weights and, when available, the Hugging Face export of the checkpoint: for each, the time
  (between barriers: the slowest rank counts) and, per rank, the peak growth of anonymous
  host memory and of device memory (``shardtrain.memory.peak_memory``), next to the
  model-state bytes the rank holds;
* the asynchronous save: how long ``save_checkpoint`` blocks, how long the same training steps
  take with the save in flight and without, so the training time it hides is visible;
* ``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load``) of the same model sharded by
  FSDP2 (``fully_shard`` per block and on the root) with the same optimizer state: time and
  bytes written, as the ratio shardtrain / DCP.

    python benchmarks/bench_weights.py                     # 2 ranks, about a minute
    python benchmarks/bench_weights.py --world 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict

import torch

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
MICRO = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="processes (default 2)")
    p.add_argument("--model", default="small", help="examples/gpt.py preset (default small)")
    p.add_argument("--n-layer", type=int, help="override the preset's layer count")
    p.add_argument("--steps", type=int, default=4, help="training steps timed around the "
                                                        "asynchronous save (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _model(args) -> torch.nn.Module:
    import gpt
    overrides = {"n_layer": args.n_layer} if args.n_layer else {}
    torch.manual_seed(0)
    return gpt.GPT(gpt.gpt_config(args.model, **overrides))


def _batch(step: int, model: torch.nn.Module) -> torch.Tensor:
    seq = min(128, model.config.block_size)
    return torch.randint(0, 65, (MICRO, seq + 1), generator=torch.Generator().manual_seed(step))


def _engine(args, asynchronous: bool = False):
    import shardtrain
    engine, *_ = shardtrain.initialize(model=_model(args), config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "checkpoint": {"async_save": asynchronous},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    _train(engine, 1)
    return engine


def _train(engine, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        tokens = _batch(step, engine.module)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()


def _measure(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Seconds (slowest rank, between barriers) and this rank's peak memory growth."""
    from shardtrain import comm
    from shardtrain.memory import peak_memory
    comm.barrier()
    start = time.perf_counter()
    with peak_memory() as peak:
        fn()
    comm.barrier()
    return {"seconds": time.perf_counter() - start, "host": peak["host"], "device": peak["device"]}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _ours(args, where: Path) -> Dict[str, Any]:
    import shardtrain
    engine = _engine(args)
    out: Dict[str, Any] = {"states": engine.model_state_bytes()["total"],
                           "params": sum(p.ds_numel for p in engine.module.parameters())}
    out["save_16bit_model"] = _measure(lambda: engine.save_16bit_model(where, "model.safetensors"))
    out["save_checkpoint"] = _measure(lambda: engine.save_checkpoint(where / "ckpt", tag="sync"))
    out["save_checkpoint"]["bytes"] = _dir_bytes(where / "ckpt" / "sync")
    fresh = _engine(args)
    out["load_checkpoint"] = _measure(lambda: fresh.load_checkpoint(where / "ckpt", tag="sync"))
    out["load_pretrained"] = _measure(lambda: shardtrain.load_pretrained(
        fresh, where / "model.safetensors"))
    out.update(_export(where))
    return out


def _export(where: Path) -> Dict[str, Any]:
    """The Hugging Face export of the checkpoint by rank 0 alone, when this shardtrain has it."""
    from shardtrain import checkpoint, comm
    export = getattr(checkpoint, "export_pretrained", None)
    if export is None:
        return {}
    run = (lambda: export(where / "ckpt", where / "hf", tag="sync", max_shard_size="4MB")) \
        if comm.get_rank() == 0 else (lambda: None)
    return {"export": _measure(run)}


def _asynchronous(args, where: Path) -> Dict[str, Any]:
    """How long an asynchronous save blocks, and what the steps after it cost meanwhile."""
    from shardtrain.checkpoint import wait_for_checkpoint
    engine = _engine(args, asynchronous=True)
    quiet = _measure(lambda: _train(engine, args.steps, 1))
    blocked = _measure(lambda: engine.save_checkpoint(where / "async", tag="a"))
    busy = _measure(lambda: _train(engine, args.steps, 1 + args.steps))
    drained = _measure(wait_for_checkpoint)
    return {"steps_alone": quiet["seconds"], "save_blocks": blocked["seconds"],
            "steps_while_writing": busy["seconds"], "wait_after": drained["seconds"],
            "async_host": blocked["host"]}


def _dcp(args, where: Path) -> Dict[str, Any]:
    """The same model and optimizer under FSDP2, saved and loaded by torch's DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    model = _model(args)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _batch(0, model)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optim.step()

    def save():
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / "dcp"))

    def load():
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(where / "dcp"))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    out = {"save": _measure(save), "load": _measure(load)}
    out["save"]["bytes"] = _dir_bytes(where / "dcp")
    return out


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(args.threads)
    import shardtrain
    from shardtrain import comm
    shardtrain.init_distributed()
    base = comm.broadcast_object(str(args.dir or tempfile.mkdtemp(prefix="bench-weights-")))
    where = Path(base) / f"w{world}"
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
    comm.barrier()
    mine = {"ours": _ours(args, where), "async": _asynchronous(args, where),
            "dcp": _dcp(args, where)}
    every = comm.all_gather_object(mine)
    if rank == 0:
        queue.put(every)
    comm.barrier()
    shardtrain.destroy()


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:7.2f}"


def report(results, world: int) -> str:
    ours, dcp = results[0]["ours"], results[0]["dcp"]
    lines = [f"ZeRO stage 3, {world} ranks, {ours['params']:,} parameters "
             f"({ours['params'] * 4 / 2**20:.1f} MiB of fp32 weights); model states per rank "
             + ", ".join(_mib(r["ours"]["states"]).strip() + " MiB" for r in results),
             f"{'operation':<22}{'seconds':>9}  peak host growth per rank (MiB)  peak device (MiB)"]
    for name in ("save_16bit_model", "save_checkpoint", "load_checkpoint", "load_pretrained",
                 "export"):
        if name not in ours:
            continue
        hosts = " ".join(_mib(r["ours"][name]["host"]) for r in results)
        devices = " ".join(_mib(r["ours"][name]["device"]) for r in results)
        lines.append(f"{name:<22}{ours[name]['seconds']:>9.3f}  {hosts:<32}  {devices}")
    lines.append(f"{'DCP save (FSDP2)':<22}{dcp['save']['seconds']:>9.3f}  "
                 + " ".join(_mib(r["dcp"]["save"]["host"]) for r in results))
    lines.append(f"{'DCP load (FSDP2)':<22}{dcp['load']['seconds']:>9.3f}  "
                 + " ".join(_mib(r["dcp"]["load"]["host"]) for r in results))
    lines.append(f"ratios shardtrain / DCP: save {ours['save_checkpoint']['seconds'] / dcp['save']['seconds']:.2f}, "
                 f"load {ours['load_checkpoint']['seconds'] / dcp['load']['seconds']:.2f}; bytes written "
                 f"{ours['save_checkpoint']['bytes'] / 2**20:.1f} MiB vs {dcp['save']['bytes'] / 2**20:.1f} MiB")
    a = results[0]["async"]
    lines.append(f"asynchronous save: blocks {a['save_blocks']:.3f} s (synchronous: "
                 f"{ours['save_checkpoint']['seconds']:.3f} s); steps alone {a['steps_alone']:.3f} s, "
                 f"while writing {a['steps_while_writing']:.3f} s, then waited {a['wait_after']:.3f} s; "
                 f"hidden {ours['save_checkpoint']['seconds'] - a['save_blocks'] - a['wait_after']:.3f} s")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = run_ranks(_worker, args.world, args)
    print(report(results, args.world))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
