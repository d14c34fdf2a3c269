"""Resuming converted DeepSpeed checkpoints, run on every rank of one process group (see
test_import_deepspeed.py).

Each case builds the fixtures' model with shardtrain at some ZeRO stage on this world size,
loads one converted checkpoint, reports what the load restored (counters, learning rate, loss
scale, scheduler state, this rank's masters and optimizer states), then trains the steps
DeepSpeed trained after its save, on the same batches, and reports the losses.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import ds_tiny_model as tiny
import shardtrain
from _dist import run_cases
from shardtrain import comm
from shardtrain.optim import WarmupLR

# (checkpoint, stage, bf16, load optimizer states, the client optimizer's name or None)
Plan = Sequence[Tuple[str, int, bool, bool, Optional[str]]]


def case_key(name: str, stage: int, with_optimizer: bool = True) -> str:
    return f"{name}@s{stage}" + ("" if with_optimizer else "-weights-only")


def resume_all(rank: int, world_size: int, root: str, plan: Plan) -> Dict[str, Any]:
    """Every case of ``plan``; a case that raises is reported, not fatal (``run_cases``)."""
    torch.manual_seed(0)
    cases = {case_key(name, stage, optim): functools.partial(
        resume, os.path.join(root, name), stage, bf16, optim, client)
        for name, stage, bf16, optim, client in plan}
    return run_cases(cases, rank, world_size)


def build(stage: int, bf16: bool, world: int, client: Optional[str] = None,
          extra: Optional[Dict[str, Any]] = None):
    """The fixtures' engine: the config's optimizer and scheduler, or the client optimizer
    ``client`` with a WarmupLR passed beside it, as DeepSpeed's run had them."""
    model = tiny.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    config = {**tiny.config(stage, bf16, world, client=client is not None), **(extra or {})}
    if client is None:
        return shardtrain.initialize(model=model, model_parameters=params, config=config)[0]
    optimizer = tiny.client_optimizer(client, params)
    scheduler = WarmupLR(optimizer, **tiny.CLIENT_WARMUP)
    return shardtrain.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                 config=config)[0]


def resume(path: str, stage: int, bf16: bool, with_optimizer: bool, client: Optional[str],
           rank: int, world: int) -> Dict[str, Any]:
    engine = build(stage, bf16, world, client)
    engine.load_checkpoint(path, load_optimizer_states=with_optimizer)
    loaded = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
              "skipped_steps": engine.skipped_steps, "lr": engine.get_lr()[0],
              "scale": engine.get_loss_scale(), "scheduler": engine.lr_scheduler.state_dict(),
              "slots": slots(engine)}
    trained = train(engine, rank, world)
    trained.update(loaded=loaded, global_steps=engine.global_steps,
                   global_samples=engine.global_samples)
    return trained


def slots(engine) -> Dict[str, Dict[str, Any]]:
    """This rank's fp32 masters (the weights themselves in fp32) and optimizer states (Adam's
    moments and step, SGD's momentum)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = {}
    for slot in engine.optimizer_slots():
        if slot.tensor is None:
            continue
        state = engine.optimizer.state.get(slot.tensor, {})
        if not state:  # loaded without the optimizer states, before any step
            continue
        entry = {"lo": slot.lo, "hi": slot.hi,
                 "fp32": slot.tensor.detach().float().reshape(-1).clone()}
        for key, value in state.items():
            if key == "step":
                entry[key] = float(value)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = value.detach().reshape(-1).clone()
        out[names[id(slot.param)]] = entry
    return out


def train(engine, rank: int, world: int) -> Dict[str, Any]:
    """DeepSpeed's continued steps: per step, the mean loss over ranks and micro-steps; this
    rank's loss of each micro-step; the learning rate after each step."""
    means: List[float] = []
    micro: List[List[float]] = []
    lrs: List[float] = []
    for step in range(tiny.SAVE_AT, tiny.SAVE_AT + tiny.CONTINUE):
        row = []
        for m in range(tiny.GAS):
            x, y = tiny.micro_batch(step, m, rank, world)
            loss = tiny.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            row.append(float(loss.detach()))
        total = torch.tensor([sum(row)], dtype=torch.float64)
        comm.all_reduce(total)
        means.append(float(total) / (world * tiny.GAS))
        micro.append(row)
        lrs.append(engine.get_lr()[0])
    return {"losses": means, "micro": micro, "lrs": lrs}


def load_universal(rank: int, world_size: int, fixture: str, save_dir: str,
                   stage0: str) -> Dict[str, Any]:
    """``checkpoint.load_universal``: ``engine.load_checkpoint`` on DeepSpeed's universal
    checkpoint directly (at stage 1, not the source's 2), then on the engine's own checkpoint
    with the key still set, then on a damaged copy of the DeepSpeed one. Without the key:
    the stage-0 client-optimizer checkpoint ``stage0`` loaded as it is (its frozen parameter
    named by the engine's module)."""
    import glob
    import shutil
    import tempfile

    def engine_for():
        model = tiny.make_model()
        config = {**tiny.config(1, False, world_size), "checkpoint": {"load_universal": True}}
        return shardtrain.initialize(model=model, config=config)[0]

    def direct(r, w):
        engine = engine_for()
        path, _ = engine.load_checkpoint(fixture)
        trained = train(engine, r, w)
        engine.save_checkpoint(save_dir)
        left = glob.glob(os.path.join(tempfile.gettempdir(), "shardtrain-universal-*"))
        trained.update(path=path, left=left, steps=engine.global_steps)
        engine.destroy()
        return trained

    def own(r, w):
        engine = engine_for()
        path, _ = engine.load_checkpoint(save_dir)
        out = {"path": path, "steps": engine.global_steps}
        engine.destroy()
        return out

    def damaged(r, w):
        copy = os.path.join(save_dir, "damaged")
        if r == 0:
            shutil.copytree(fixture, copy)
            shutil.rmtree(os.path.join(copy, "global_step4", "zero", "block.fc.weight"))
        comm.barrier()
        engine = engine_for()
        try:
            engine.load_checkpoint(copy)
        except ValueError as err:
            return {"message": str(err), "steps": engine.global_steps}
        finally:
            engine.destroy()
        return {"message": None}

    def plain(r, w):
        engine = build(0, False, w, "AdamW")
        path, _ = engine.load_checkpoint(stage0)
        trained = train(engine, r, w)
        trained.update(path=path, steps=engine.global_steps)
        engine.destroy()
        return trained

    return run_cases({"direct": direct, "own": own, "damaged": damaged, "plain": plain}, rank,
                     world_size)
