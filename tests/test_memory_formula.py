"""Each ZeRO stage holds what its formula says while the optimizer steps (fp32 AdamW, 2
ranks): parameters, gradients and optimizer states, measured as the bytes of every live
tensor on each rank (cases_memory.py), within 5% of ``zero_formula_bytes``."""
from __future__ import annotations

import pytest

from _dist import run_ranks
from shardtrain.memory import zero_formula_bytes

WORLD = 2


@pytest.fixture(scope="module")
def measured():
    return run_ranks("cases_memory:run_all", WORLD, timeout=240)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_live_bytes_at_the_step_follow_the_zero_formula(measured, stage):
    for rank in range(WORLD):
        got = measured[rank][stage]
        want = zero_formula_bytes(got["numel"], WORLD, stage, 4, 4, 8)
        assert got["at_step"] == pytest.approx(want, rel=0.05), (rank, got, want)
