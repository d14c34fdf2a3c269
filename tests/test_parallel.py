"""The engine on a device mesh over real processes: tensor- and sequence-parallel ranks composed
with ZeRO's data parallelism train exactly as one process does on the same global batch (cases
in ``cases_parallel.py``)."""
from __future__ import annotations

import pytest

from _dist import run_ranks

STAGES = (0, 1, 2, 3)


def _check(results, name, tol=2e-5):
    for rank, got in enumerate(results):
        case = got[name]
        assert "error" not in case, f"rank {rank}:\n{case.get('error')}"
        assert case["same_in_group"], (rank, "ranks of one replica read different samples")
        assert case["loss_err"] < tol, (rank, name, case["loss_err"])
        assert case["weight_err"] < tol, (rank, name, case["weight_err"])
        assert case["norm_err"] < tol, (rank, name, case["norm_err"])
        assert case["moved"] > 1e-3  # the comparison is only telling if training moved them


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "dp2xsp2"])
def sequence(request):
    return request.param, run_ranks("cases_parallel:sequence_parallel", request.param, timeout=300)


@pytest.mark.parametrize("stage", STAGES)
def test_sequence_parallel_training_matches_one_process(sequence, stage):
    world, results = sequence
    _check(results, f"stage{stage}")
    for got in results:
        case = got[f"stage{stage}"]
        assert case["dp"] == world // 2 and case["replicas"] == world // 2
        assert all(shape == (2, 8) for shape in case["shapes"])  # half of each 16-token row


@pytest.fixture(scope="module", params=[(2, 2), (4, 2), (4, 4)], ids=["tp2", "dp2xtp2", "tp4"])
def tensor(request):
    world, tp = request.param
    return world, tp, run_ranks("cases_parallel:tensor_parallel", world, timeout=400, tp=tp)


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("stage", STAGES)
def test_tensor_parallel_training_matches_one_process(tensor, model, stage):
    world, tp, results = tensor
    _check(results, f"{model}_stage{stage}")
    for got in results:
        case = got[f"{model}_stage{stage}"]
        assert case["dp"] == world // tp and case["replicas"] == world // tp


@pytest.mark.parametrize("case", ["llama_head_split", "llama_tied_head_split"])
def test_a_vocabulary_parallel_head_trains_exactly(tensor, case):
    """The head split over the vocabulary (tied to the input embedding or not): the loss is
    computed from each rank's logits slice without gathering the vocabulary."""
    _check(tensor[2], case)
