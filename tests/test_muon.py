"""Muon at ZeRO stages 0-3 on 2 ranks matches a single-process Muon + AdamW on the same global
batch (fp32, with gradient clipping and accumulation); its parameter split; a stage-2
checkpoint resumes exactly at stage 2 and at stage 0 on 2 ranks, and on 1 rank; bf16
parameters with fp32 masters step alike at stages 0 and 2 (cases_muon.py)."""
from __future__ import annotations

import pytest

from _dist import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def runs():
    return run_ranks("cases_muon:run_all", WORLD, timeout=180)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_matches_single_process_reference(runs, stage):
    for rank in range(WORLD):
        got = runs[rank][stage]
        assert got["losses"] == pytest.approx(runs[rank]["ref_losses"], abs=1e-5), rank
        assert max(got["diffs"]) < 1e-5, (rank, got["diffs"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_takes_the_weight_matrices_and_adamw_the_rest(runs, stage):
    # fc1.weight (16x8) and fc2.weight (5x16) to Muon; the embedding, biases and norm to AdamW
    for rank in range(WORLD):
        got = runs[rank][stage]
        assert got["split"] == [True, False], got
        held = 16 * 8 + 5 * 16
        assert got["muon_numel"] == (held if stage == 0 else held // WORLD), got


def test_stage2_checkpoint_resumes_exactly(runs):
    for rank in range(WORLD):
        for stage, diff in runs[rank]["resume"]["diffs"].items():
            assert diff < 1e-6, (rank, stage, diff)


def test_stage2_checkpoint_resumes_on_one_rank(runs):
    # the momentum slices of 2 ranks, re-cut for one: training goes on as on 2 ranks
    alone = run_ranks("cases_muon:resume_alone", 1, timeout=120, directory=runs[0]["directory"])[0]
    want = runs[0]["resume"]["want"]
    assert max(float((alone[n] - want[n]).abs().max()) for n in want) < 1e-5


def test_bf16_parameters_step_the_same_at_stages_0_and_2(runs):
    for rank in range(WORLD):
        assert runs[rank]["bf16"] < 1e-5, runs[rank]["bf16"]


def test_cpu_optimizer_offload_is_refused_by_name(runs):
    assert "offload_optimizer" in runs[0]["offload"] and "muon" in runs[0]["offload"]
