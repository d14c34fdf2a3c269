"""The mixture-of-experts layer over 2 ranks (one process group runs every case of
``cases_moe``): experts split over the expert-parallel group give the single-process layer's
outputs, load-balancing loss, expert counts and gradients for top-1 (random token selection,
first-come, dropless) and top-2 (capacity, dropless with the residual and jittered router);
the engine trains a layer with every expert on every rank as one process does, and refuses
expert parallelism in training by name."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks

WORLD = 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def run():
    return None, run_ranks("cases_moe:all_cases", WORLD, timeout=180)


@pytest.mark.parametrize("name", ["top1_rts", "top1_first", "top1_dropless", "top2",
                                  "top2_sampled_residual"])
def test_split_experts_give_the_single_process_layer(run, name):
    for rank in range(WORLD):
        got = result(run, name, rank)
        assert got["out"] < ATOL and got["l_aux"] < ATOL, got
        assert got["counts"][0] == got["counts"][1]
        assert got["experts"] < ATOL and got["dense"] < ATOL, got


def test_capacity_drops_tokens_and_dropless_does_not(run):
    """capacity_factor 0.5 with 10 tokens over 4 experts: buffers of 2 (top-1) and 3 (top-2)
    cannot hold every token; dropless routing loses none."""
    assert sum(result(run, "top1_first", r)["dropped"] for r in range(WORLD)) > 0
    assert sum(result(run, "top1_dropless", r)["dropped"] for r in range(WORLD)) == 0


def test_the_engine_trains_a_layer_with_every_expert_on_every_rank(run):
    got = result(run, "engine_ep1", 0)
    assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
    assert got["weights"] < ATOL


def test_expert_parallelism_in_training_is_refused_by_name(run):
    message = result(run, "refuses_ep2", 0)
    assert "'0' (ep_size 2)" in message and "ep_size=1" in message
