"""Rank bodies for test_failures.py: a rank that stops responding, dies, or takes another
branch in the middle of training."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

import torch

import shardtrain
from shardtrain import comm
from shardtrain.zero import GatheredParameters

STUCK_SECONDS = 10.0  # past rank 0's timeout (3 s) and roll call (5 s)


def _train(rank: int, config: Dict[str, Any], model: torch.nn.Module, fault, steps: int = 3,
           gas: int = 2, forward_kwargs=None, between=None) -> Dict[str, Any]:
    """Trains ``steps`` steps of ``gas`` micro-batches; ``fault(step, micro)`` runs on every
    rank before each backward (the case decides what a rank does differently there), and
    ``between(step)`` before each step's first forward."""
    engine, *_ = shardtrain.initialize(model=model, config=dict(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, **config))
    start = time.monotonic()
    try:
        for step in range(steps):
            if between is not None:
                between(step)
            for micro in range(gas):
                kwargs = forward_kwargs(step, micro) if forward_kwargs else {}
                loss = engine(torch.randn(2, 8), **kwargs).pow(2).mean()
                fault(step, micro)
                engine.backward(loss)
                engine.step()
    except comm.CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - start,
                "kind": type(err).__name__, "cause": type(err.__cause__).__name__}
    with GatheredParameters(list(engine.module.parameters())):  # whole at stage 3 too
        params = [p.detach().clone() for p in engine.module.parameters()]
    return {"error": None, "seconds": time.monotonic() - start, "params": params}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def stuck_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 stops before the backward of step 2 (a long sleep, as a rank stuck in a data
    loader or a different branch would); the others reach the gradient reduction and wait."""
    def fault(step, micro):
        if rank == 1 and step == 1 and micro == 1:
            time.sleep(STUCK_SECONDS)
    return _train(rank, {}, _mlp(), fault)


def killed_rank(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1's process ends (``os._exit``) before the backward of step 2, micro-step 2."""
    def fault(step, micro):
        if rank == 1 and step == 1 and micro == 1:
            os._exit(3)
    return _train(rank, {}, _mlp(), fault)


def extra_all_reduce(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 issues one all-reduce the others do not (a metric logged on one rank only)
    before the backward of step 2, micro-step 2."""
    def fault(step, micro):
        if rank == 1 and step == 1 and micro == 1:
            comm.all_reduce(torch.ones(3))
    return _train(rank, {}, _mlp(), fault)


class Blocks(torch.nn.Module):
    """Identical blocks: a rank that skips one still gathers parameters of the same sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, skip: Optional[int] = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return self.head(x)


def skipped_module(rank: int, world_size: int) -> Dict[str, Any]:
    """At ZeRO stage 3, rank 1 skips the forward of ``blocks.1`` in step 2. Both ranks' reports
    are checked, and each reads the other's trail through the store rank 0 hosts: no rank ends
    before every rank has written its report."""
    got = _train(rank, {"zero_optimization": {"stage": 3,
                                              "stage3_param_persistence_threshold": 0}},
                 Blocks(), lambda step, micro: None, gas=1,
                 forward_kwargs=lambda step, micro: {"skip": 1 if rank == 1 and step == 1
                                                     else None})
    _rank0_waits_for_every_report(rank, world_size)
    return got


def _rank0_waits_for_every_report(rank: int, world_size: int, seconds: float = 30.0) -> None:
    """Rank 0, which hosts the store, ends only once every rank has written its report: a
    file per rank (named by this launch's port) says so, outside the broken process group."""
    marks = [f"/tmp/shardtrain-failures-{os.environ['MASTER_PORT']}-{r}" for r in range(world_size)]
    open(marks[rank], "w").close()
    if rank != 0:
        return
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(m) for m in marks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for mark in marks:
        if os.path.exists(mark):
            os.remove(mark)


def bucket_sizes(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 cuts its gradient buckets smaller (another reduce_bucket_size): with the
    divergence check on, the step's check finds it before the update."""
    zero = {"stage": 2, "reduce_bucket_size": 40 if rank == 1 else 200}
    return _train(rank, {"zero_optimization": zero, "diagnostics": {"divergence_check": "step"}},
                  _mlp(), lambda step, micro: None)


def check_on_off(rank: int, world_size: int) -> Dict[str, Any]:
    """The same training with the divergence check off, per step and per collective: the
    parameters must be equal bit for bit."""
    out = {}
    for mode in ("off", "step", "collective"):
        for stage in (0, 3):
            torch.manual_seed(1 + rank)
            got = _train(rank, {"zero_optimization": {"stage": stage},
                                "diagnostics": {"divergence_check": mode}},
                         _mlp(), lambda step, micro: None)
            out[(mode, stage)] = got
    return out


class Swapped(Blocks):
    """Rank 1 runs ``blocks.2`` before ``blocks.1``: every gather pairs with one of the same
    size, so nothing hangs, but the ranks exchange shards of different modules."""

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        order = [0, 2, 1, 3] if swap else [0, 1, 2, 3]
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x)


def swapped_modules(rank: int, world_size: int) -> Dict[str, Any]:
    """At stage 3 without prefetching, rank 1 runs two modules in another order in step 2;
    the per-collective check finds it at the first gather after, before anything pairs."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0}
    model = Swapped()
    return _train(rank, {"zero_optimization": zero,
                         "diagnostics": {"divergence_check": "collective"}},
                  model, lambda step, micro: None, gas=1,
                  forward_kwargs=lambda step, micro: {"swap": rank == 1 and step == 1})


def metric_dtype(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 all-reduces a metric as int32, the others as float32: the same bytes, so the
    backend pairs them and sums garbage without an error; the per-step check finds it."""
    def fault(step, micro):
        if step == 1 and micro == 0:
            comm.all_reduce(torch.ones(4, dtype=torch.int32 if rank == 1 else torch.float32))
    return _train(rank, {"diagnostics": {"divergence_check": "step"}}, _mlp(), fault)


def bounds(rank: int, world_size: int) -> Dict[str, Any]:
    """collective_timeout 1.5 s, slow_collective_timeout 30 s: rank 1 is 2.5 s late in the first
    step (warm-up) and 2.5 s late outside a step (rank 0 "evaluates" while rank 1 waits at a
    barrier), both within the long bound; then 3 s late inside step 4, past the short one."""
    def fault(step, micro):
        if rank == 1 and (step, micro) in ((0, 0), (3, 1)):
            time.sleep(2.5 if step == 0 else 3.0)

    def between(step):
        if step == 2:
            if rank == 0:
                time.sleep(2.5)
            comm.barrier()
    return _train(rank, {"diagnostics": {"collective_timeout": 1.5, "slow_collective_timeout": 30}},
                  _mlp(), fault, steps=5, between=between)


def stuck_stage(rank: int, world_size: int) -> Dict[str, Any]:
    """Pipeline stage 1 (rank 1) stops in the forward of step 2's second micro-batch (a long
    sleep in its loss); stage 0 runs on to that micro-batch's backward and waits for the
    gradient stage 1 does not send."""
    from shardtrain.pipe import LayerSpec, PipelineModule
    calls = []

    def loss_fn(out, labels):
        calls.append(1)
        if len(calls) == 4:  # step 2, micro-batch 2
            time.sleep(STUCK_SECONDS)
        return torch.nn.functional.mse_loss(out, labels)

    module = PipelineModule([LayerSpec(torch.nn.Linear, 8, 8), torch.nn.Tanh(),
                             LayerSpec(torch.nn.Linear, 8, 1)], num_stages=2, loss_fn=loss_fn,
                            partition_method="uniform")
    engine, *_ = shardtrain.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    start = time.monotonic()
    try:
        for _ in range(3):
            engine.train_batch(iter([(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(2)]))
    except comm.CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}
