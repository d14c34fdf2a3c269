"""The mixture-of-experts layer over 2 ranks (one process group runs every case of
``cases_moe``): experts split over the expert-parallel group give the single-process layer's
outputs, load-balancing loss, expert counts and gradients for top-1 (random token selection,
first-come, dropless) and top-2 (capacity, dropless with the residual and jittered router);
the engine trains layers with every expert on every rank and with experts split over the
ranks as one process does (ZeRO stages 0-2), and refuses what split experts do not compose
with by name."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks

WORLD = 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def run():
    return None, run_ranks("cases_moe:all_cases", WORLD, timeout=180)


@pytest.fixture(scope="module")
def run4():
    return None, run_ranks("cases_moe:four_ranks", 4, timeout=180)


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


@pytest.mark.parametrize("stage,ep", [(2, 1), (0, 2), (1, 2), (2, 2), (3, 2)])
def test_the_engine_trains_moe_as_one_process_does(run, stage, ep):
    """Losses, clipped global norms and every weight (a split expert's against the one-process
    weight of the same global expert) equal single-process training on the global batch."""
    for rank in range(WORLD):
        got = result(run, f"engine_s{stage}_ep{ep}", rank)
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
        assert got["norms"] == pytest.approx(got["ref_norms"], abs=ATOL)
        assert got["weights"] < ATOL


@pytest.mark.parametrize("stage,ep", [(0, 2), (1, 2), (2, 2), (3, 2), (2, 1)])
def test_model_state_bytes_per_rank_follow_the_formula(run, stage, ep):
    """fp32 AdamW (4 + 4 + 8 bytes a parameter): the dense parameters' share by the ZeRO
    formula over the 2 data-parallel ranks, plus this rank's experts' over the ranks holding
    the same ones (one here; at stage 3 as at stage 2), within 10% (shards are padded)."""
    from shardtrain.memory import zero_formula_bytes
    for rank in range(WORLD):
        got = result(run, f"engine_s{stage}_ep{ep}", rank)["memory"]
        want = zero_formula_bytes(got["dense"], WORLD, stage, 4, 4, 8) + \
            zero_formula_bytes(got["experts"], WORLD // ep, min(stage, 2), 4, 4, 8)
        assert got["bytes"] == pytest.approx(want, rel=0.1), (got, want)
        if ep > 1:
            assert got["experts"] > got["dense"]  # the experts are most of what a rank holds


def test_bf16_with_split_experts_trains_as_with_whole_ones(run):
    """bf16 (fp32 masters) at ZeRO-2: experts split over 2 ranks give the losses of every
    expert on every rank in bf16 (the same bf16 arithmetic per token), and both follow the
    fp32 one-process run within bf16's precision."""
    for rank in range(WORLD):
        split = result(run, "engine_s2_ep2_bf16", rank)
        whole = result(run, "engine_s2_ep1_bf16", rank)
        assert split["losses"] == pytest.approx(whole["losses"], abs=1e-2)
        assert split["losses"] == pytest.approx(split["ref_losses"], abs=0.15)


def test_deepspeeds_moe_script_pattern_trains_through_the_alias(run):
    """deepspeed.moe.layer.MoE (ep_size 2), deepspeed.moe.utils' expert groups and
    deepspeed.initialize at ZeRO-2: the optimizer's groups are DeepSpeed's (the dense one,
    then the experts' named ep_size_2 with moe set), and training equals one process's."""
    for rank in range(WORLD):
        got = result(run, "deepspeed_script", rank)
        assert got["names"] == ["parameters", "ep_size_2"] and got["moe"] == [False, True]
        assert got["expert_params"] == 4  # two local experts' weight and bias
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)


def test_load_pretrained_fills_each_ranks_experts(run):
    """The unsplit model's file (every expert under its global index) loaded into split
    experts: each rank's experts are the file's experts of the same global index, and the
    experts other ranks hold are not unexpected."""
    for rank in range(WORLD):
        got = result(run, "pretrained", rank)
        assert got["missing"] == [] and got["unexpected"] == [] and got["weights"] == 0.0


def test_frozen_split_experts_are_saved_under_their_global_names(run):
    """Frozen experts split over 2 ranks: the checkpoint (and save_16bit_model) holds every
    one; loaded into a model holding all of them, each is the saving engine's."""
    for rank in range(WORLD):
        got = result(run, "frozen_experts", rank)
        assert got["names"] and got["weights"] == 0.0


def test_what_split_experts_do_not_compose_with_is_refused_by_name(run):
    got = result(run, "refusals", 0)
    assert "DeepCompile with expert-parallel MoE layers" in got["deepcompile"]


def test_four_ranks_ep2_by_expert_data_parallel_2(run4):
    """Experts on ranks [0, 1] and again on [2, 3]: each expert's gradient summed over its two
    replicas, the layer's and the engine's results (ZeRO-0, 2 and 3) as one process's."""
    for rank in range(4):
        got = result(run4, "top2", rank)
        assert got["out"] < ATOL and got["experts"] < ATOL and got["dense"] < ATOL, got
        for stage in (0, 2, 3):
            got = result(run4, f"engine_s{stage}_ep2", rank)
            assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
            assert got["norms"] == pytest.approx(got["ref_norms"], abs=ATOL)
            assert got["weights"] < ATOL


def test_the_expert_groups_are_deepspeeds_layout(run4):
    """ep 2 over 4 ranks: expert-parallel [0, 1] and [2, 3], expert-data-parallel [0, 2] and
    [1, 3], as deepspeed.utils.groups answers for 'ep_size_2'."""
    for rank in range(4):
        got = result(run4, "lookups", rank)
        assert got["ep"] == (2, rank % 2) and got["edp"] == (2, rank // 2)
        assert got["ranks"] == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2])


def test_checkpoints_of_split_experts_describe_the_unsplit_model(run):
    """Saved with experts split over 2 ranks at ZeRO-2, the checkpoint resumes training exactly
    with split experts at ZeRO-1 and with every expert on every rank at ZeRO-3, and
    consolidates into the one-process model's weights, every expert under its own name, as
    engine.save_16bit_model writes them."""
    for rank in range(WORLD):
        got = result(run, "checkpoint", rank)
        assert got["first"] == pytest.approx(got["ref_losses"][:2], abs=ATOL)
        assert got["split_s1"] == pytest.approx(got["ref_losses"][2], abs=ATOL)
        assert got["dense_s3"] == pytest.approx(got["ref_losses"][2], abs=ATOL)
        assert got["names"] and got["weights"] < ATOL
        assert got["16bit"][0] and got["16bit"][1] < ATOL  # save_16bit_model: every expert


def test_checkpoints_move_between_expert_parallel_sizes_on_four_ranks(run4):
    """Saved with ep 2 x expert-data-parallel 2 at ZeRO-2; resumed with ep 4 at ZeRO-1 and
    with every expert on every rank at ZeRO-0: the uninterrupted run's third loss."""
    for rank in range(4):
        got = result(run4, "checkpoint", rank)
        assert got["first"] == pytest.approx(got["ref_losses"][:2], abs=ATOL)
        for name in ("ep4_s1", "dense_s0"):
            assert got[name] == pytest.approx(got["ref_losses"][2], abs=ATOL), name
        assert got["names"] and got["weights"] < ATOL


def test_tensor_parallel_dense_layers_with_split_experts(run4):
    """tp 2 x dp 2 with AutoTP on the dense MLP and the experts split over the data-parallel
    ranks of each tensor-parallel coordinate: the groups, one process's losses, and a
    checkpoint that consolidates into the one-process model's weights."""
    for rank in range(4):
        got = result(run4, "tp2_ep2", rank)
        assert got["ep"] == [rank % 2, rank % 2 + 2]  # the ranks that see other tokens
        assert got["replicas"] == [rank - rank % 2, rank - rank % 2 + 1]  # the same tokens
        assert got["fc_in"] == [8, 8]  # AutoTP's column split: half of 16 rows
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
        assert got["weights"] < ATOL
