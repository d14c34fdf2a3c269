"""Rank bodies for test_oom.py: out-of-memory errors provoked on purpose, and their reports.

On the CPU two ways: a memory budget (``SHARDTRAIN_MEMORY_BUDGET``, read when the engine is
built) that the measured model states plus activations exceed, and a real allocator failure
in a stage-3 gather, under an address-space limit (``RLIMIT_AS``) a little above what the
process already maps, so that the gathered rows of one large layer cannot be allocated.
"""
from __future__ import annotations

import os
import resource
import traceback
from typing import Any, Callable, Dict, Optional

import torch

import shardtrain
from _dist import run_cases
from shardtrain.autotune import MEMORY_BUDGET_ENV
from shardtrain.telemetry._oom import SNAPSHOT_ENV

MICRO, GAS = 8, 2
BIG = 4096  # a 4096 x 4096 layer: 64 MiB gathered at stage 3


def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 4))


def with_big_layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, BIG), torch.nn.Tanh(),
                               torch.nn.Linear(BIG, BIG), torch.nn.Tanh(), torch.nn.Linear(BIG, 4))


def build(model: torch.nn.Module, stage: int, budget: Optional[int] = None,
          snapshot: Optional[str] = None):
    """An engine built with ``budget`` and ``snapshot`` in its environment (then removed)."""
    env = {MEMORY_BUDGET_ENV: budget, SNAPSHOT_ENV: snapshot}
    os.environ.update({k: str(v) for k, v in env.items() if v is not None})
    try:
        engine, *_ = shardtrain.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}})
    finally:
        for k in env:
            os.environ.pop(k, None)
    return engine


def micro_batch(width: int = 16) -> torch.Tensor:
    return torch.randn(MICRO, width)


def caught(train: Callable[[], None]) -> Dict[str, Any]:
    """The out-of-memory error ``train`` raises: its kind, message and cause."""
    try:
        train()
    except RuntimeError as err:
        return {"type": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err),
                "cause": type(err.__cause__).__name__,
                "traceback": traceback.format_exc()}
    raise AssertionError("no out-of-memory error was raised")


def train_steps(engine, steps: int = 3, width: int = 16) -> None:
    for _ in range(steps * GAS):
        engine.backward(engine(micro_batch(width)).pow(2).mean())
        engine.step()


def budget_in_forward(stage: int) -> Callable[[int, int], Dict[str, Any]]:
    """A budget below the model states alone: the first forward is over it."""
    def case(rank: int, world_size: int) -> Dict[str, Any]:
        engine = build(small(), stage, budget=1000, snapshot="/nonexistent/snapshots")
        return caught(lambda: train_steps(engine))
    return case


def budget_in_step(rank: int, world_size: int) -> Dict[str, Any]:
    """A budget that holds the parameters, gradients and a micro-batch's activations but not
    the optimizer states the first step creates: the step of step 1 (its second micro-step)
    is over it. The levels are measured on an engine without a budget first."""
    engine = build(small(), 2)
    before = engine.model_state_bytes()["total"]
    train_steps(engine, steps=1)
    after = engine.model_state_bytes()["total"]
    assert after > before + 1000, (before, after)
    engine = build(small(), 2, budget=(before + after) // 2)
    return caught(lambda: train_steps(engine))


class AddressSpaceLimit:
    """Allows ``headroom`` bytes of address space above what the process maps now."""

    def __init__(self, headroom: int):
        self.headroom = headroom

    def __enter__(self) -> None:
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + self.headroom, self.saved[1]))

    def __exit__(self, *exc: Any) -> None:
        resource.setrlimit(resource.RLIMIT_AS, self.saved)


def gather_in_forward(rank: int, world_size: int) -> Dict[str, Any]:
    """Stage 3: the big layer's gathered rows (64 MiB) do not fit 40 MiB of headroom."""
    engine = build(with_big_layer(), 3)

    def forward() -> None:
        with AddressSpaceLimit(40 << 20):
            engine(micro_batch())
    return caught(forward)


def gather_in_backward(rank: int, world_size: int) -> Dict[str, Any]:
    """Stage 3: the forward runs unlimited and releases the big layer; its gather for
    backward then does not fit."""
    engine = build(with_big_layer(), 3)
    loss = engine(micro_batch()).pow(2).mean()

    def backward() -> None:
        with AddressSpaceLimit(40 << 20):
            engine.backward(loss)
    return caught(backward)


CASES = {
    "budget_forward_stage0": budget_in_forward(0),
    "budget_forward_stage3": budget_in_forward(3),
    "budget_step_stage2": budget_in_step,
    "gather_forward_stage3": gather_in_forward,
    "gather_backward_stage3": gather_in_backward,
}


def run_all(rank: int, world_size: int, only=None) -> Dict[str, Any]:
    return run_cases(CASES, rank, world_size, only)


def cuda_snapshot(rank: int, world_size: int, snapshot: str) -> Dict[str, Any]:
    """On CUDA, under a budget of 512 MiB: a micro-batch of 32768 x 1024 (128 MiB per
    activation) through eight layers runs out of memory in forward; the snapshot is on."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.Tanh()]
    engine = build(torch.nn.Sequential(*layers), 0, budget=512 << 20, snapshot=snapshot)
    got = caught(lambda: engine(torch.randn(32768, 1024)))
    got["files"] = sorted(os.listdir(snapshot)) if os.path.isdir(snapshot) else []
    return got
