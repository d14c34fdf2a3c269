"""Out-of-memory reports over real processes (2 ranks, gloo): an out-of-memory error provoked
on the CPU through a memory budget, or through a real allocator failure in a stage-3 gather,
is re-raised with where it happened (rank, step, micro-step, phase, the module gathered), the
micro-batch, the measured model states, the estimate's prediction and what to do.
(The unit lane checks the message builder: tests/unit/test_oom_report.py.)"""
from __future__ import annotations

import re

import pytest
import torch

import cases_oom as co
from _dist import result, run_ranks
from shardtrain.memory import format_bytes
from shardtrain.memory import zero_formula_bytes

WORLD = 2
NUMEL = sum(p.numel() for p in co.small().parameters())


@pytest.fixture(scope="module")
def run():
    return WORLD, run_ranks("cases_oom:run_all", WORLD, timeout=300)


def predicted(stage: int) -> str:
    """shardtrain estimate's figure for the small model (fp32, AdamW) over two ranks; at
    stage 3 its small parameters stay whole on every rank (the persistence threshold)."""
    total = zero_formula_bytes(NUMEL, WORLD, stage, 4, 4, 8)
    if stage == 3:
        total += 4 * NUMEL * (WORLD - 1) / WORLD
    return f"shardtrain estimate predicts {format_bytes(round(total))} of model states per rank " \
           f"at stage {stage} over {WORLD} ranks"


def head(message: str) -> str:
    return message.splitlines()[0]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_budget_below_the_model_states_stops_the_first_forward(run, stage):
    for rank in range(WORLD):
        got = result(run, f"budget_forward_stage{stage}", rank)
        assert got["type"] == "shardtrain.autotune.budget.OutOfMemoryError", got["type"]
        assert got["cause"] == "OutOfMemoryError"  # the budget's error, kept as the cause
        assert head(got["message"]) == (
            f"out of memory on rank {rank} at step 1, micro-step 1 of 2, in forward "
            f"(micro-batch of 8; train_micro_batch_size_per_gpu is 8)"), got["message"]
        message = got["message"]
        assert "above the memory budget SHARDTRAIN_MEMORY_BUDGET=1,000" in message
        assert re.search(r"measured on this rank: model states [\d.]+ KiB .*; activations of the "
                         r"last micro-batch [\d.]+ KiB", message), message
        assert predicted(stage) in message, message
        assert "lower train_micro_batch_size_per_gpu" in message
        assert ("raise zero_optimization.stage (now 0)" in message) == (stage == 0)
        assert "none is written on the CPU" in message  # SHARDTRAIN_MEMORY_SNAPSHOT was set
        assert "while gathering" not in message


def test_a_budget_below_the_first_optimizer_states_stops_the_step(run):
    for rank in range(WORLD):
        got = result(run, "budget_step_stage2", rank)
        message = got["message"]
        assert head(message) == (
            f"out of memory on rank {rank} at step 1, micro-step 2 of 2, in step "
            f"(micro-batch of 8; train_micro_batch_size_per_gpu is 8)"), message
        assert "the largest saved activations of the step" in message
        assert predicted(2) in message, message
        assert "offload the optimizer states" in message


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_allocator_failure_in_a_stage3_gather_names_the_module(run, phase):
    for rank in range(WORLD):
        got = result(run, f"gather_{phase}_stage3", rank)
        message = got["message"]
        # The CPU allocator's plain RuntimeError becomes the budget's out-of-memory error.
        assert got["type"] == "shardtrain.autotune.budget.OutOfMemoryError", got["traceback"]
        assert got["cause"] == "RuntimeError"
        assert head(message) == (
            f"out of memory on rank {rank} at step 1, micro-step 1 of 2, in {phase} "
            f"(micro-batch of 8; train_micro_batch_size_per_gpu is 8)"), message
        assert "DefaultCPUAllocator: can't allocate memory" in message
        assert "while gathering the parameters of module '2' (Linear) (ZeRO stage 3)" in message
        assert "shardtrain estimate predicts" in message and "at stage 3 over 2 ranks" in message


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_out_of_memory_writes_the_snapshot(tmp_path):
    snapshot = tmp_path / "snapshots"
    got = run_ranks("cases_oom:cuda_snapshot", 1, timeout=300, snapshot=str(snapshot),
                    env={"SHARDTRAIN_ACCELERATOR": "cuda"})[0]
    assert got["type"] == "torch.OutOfMemoryError", got["traceback"]
    assert head(got["message"]).startswith("out of memory on rank 0 at step 1, micro-step 1 of 2, "
                                           "in forward (micro-batch of 32768;"), got["message"]
    assert got["files"] == ["oom-rank0.pickle"]
    assert (snapshot / "oom-rank0.pickle").stat().st_size > 0
    assert f"memory snapshot: {snapshot / 'oom-rank0.pickle'}" in got["message"]
    assert "pytorch.org/memory_viz" in got["message"]
