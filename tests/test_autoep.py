"""AutoEP (the ``expert_parallel`` block) over 2 and 4 ranks (one process group per world
size runs every case of ``cases_autoep``): transformers' MoE models and a custom one, their
experts split over the ranks, train as the unsplit model does in one process; checkpoints
move between expert-parallel sizes; mistakes are named."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks

ATOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from cases_autoep import DS_AUTOEP
    from shardtrain.checkpoint import import_deepspeed
    converted = tmp_path_factory.mktemp("ds-autoep")  # in one process, before the ranks
    import_deepspeed(DS_AUTOEP, converted, tag="s2")
    return None, run_ranks("cases_autoep:all_cases", 2, timeout=300,
                           ds_checkpoint=str(converted))


@pytest.fixture(scope="module")
def run4():
    return None, run_ranks("cases_autoep:four_ranks", 4, timeout=300)


def _same_training(got):
    assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
    assert got["norms"] == pytest.approx(got["ref_norms"], abs=ATOL)
    assert got["names"] and got["weights"] < ATOL, got["weights"]


@pytest.mark.parametrize("name", ["mixtral_s0", "mixtral_s1", "mixtral_s2", "mixtral_s3",
                                  "qwen2_moe_s2", "qwen3_moe_s1", "deepseek_v3_s3",
                                  "custom_s2", "client_optimizer"])
def test_autoep_trains_as_the_unsplit_model_in_one_process(run, name):
    """Dropless routing by the model's own router: losses (with its router-auxiliary loss),
    clipped global norms and every weight of the unsplit model (experts joined over the
    ranks) equal one process's on the global batch; also with the optimizer built from the
    model's parameters before initialize (pointed at this rank's new expert parameters)."""
    for rank in range(2):
        _same_training(result(run, name, rank))


def test_bf16_with_split_experts_trains_as_with_whole_ones(run):
    """bf16 (fp32 masters) at ZeRO-2: the experts split over 2 ranks give the losses of the
    same engine without AutoEP (bf16's rounding: 1e-2), and both stay near fp32's."""
    for rank in range(2):
        split, whole = result(run, "bf16_ep2", rank), result(run, "bf16_dense", rank)
        assert split["losses"] == pytest.approx(whole["losses"], abs=1e-2)
        assert split["losses"] == pytest.approx(split["ref_losses"], abs=5e-2)


def test_engine_mpu_answers_for_the_expert_groups(run, run4):
    """engine.mpu's expert lookups (Megatron's names): ep 2 on 2 ranks is the world; on 4,
    ranks [0, 1] and [2, 3] hold other experts, [0, 2] and [1, 3] the same ones; ep 4 is
    the world, each expert on one rank."""
    for rank in range(2):
        assert result(run, "mixtral_s2", rank)["mpu"] == {"ep": (2, rank), "edp": (1, 0),
                                                           "ep_ranks": "world"}
    for rank in range(4):
        assert result(run4, "ep2_s2", rank)["mpu"] == {
            "ep": (2, rank % 2), "edp": (2, rank // 2),
            "ep_ranks": [rank - rank % 2, rank - rank % 2 + 1]}
        assert result(run4, "ep4_s1", rank)["mpu"]["ep"] == (4, rank)


@pytest.mark.parametrize("name,world,ep,stage", [
    ("mixtral_s0", 2, 2, 0), ("mixtral_s1", 2, 2, 1), ("mixtral_s2", 2, 2, 2),
    ("mixtral_s3", 2, 2, 3), ("ep2_s2", 4, 2, 2), ("ep4_s1", 4, 4, 1)])
def test_model_state_bytes_per_rank_follow_the_formula(run, run4, name, world, ep, stage):
    """fp32 AdamW (4 + 4 + 8 bytes a parameter): the dense parameters by the ZeRO formula over
    every rank, plus this rank's 1/ep of the experts by the formula over the ranks holding
    the same ones (at stage 3 as at stage 2), within 10% (shards are padded)."""
    from shardtrain.memory import zero_formula_bytes
    for rank in range(world):
        got = result(run if world == 2 else run4, name, rank)["memory"]
        want = zero_formula_bytes(got["dense"], world, stage, 4, 4, 8) + \
            zero_formula_bytes(got["experts"] // ep, world // ep, min(stage, 2), 4, 4, 8)
        assert got["bytes"] == pytest.approx(want, rel=0.1), (got, want)


def test_checkpoints_describe_the_unsplit_model(run):
    """Saved with the experts split over 2 ranks at ZeRO-2: resumed with them split at ZeRO-1
    and by a model without the expert_parallel block at ZeRO-3, each the uninterrupted run's
    third loss; consolidated into the one-process model's weights under its own names, as
    engine.save_16bit_model writes them (the experts joined)."""
    for rank in range(2):
        got = result(run, "checkpoint", rank)
        assert got["first"] == pytest.approx(got["ref_losses"][:2], abs=ATOL)
        for name in ("ep2_s1", "dense_s3"):
            assert got[name] == pytest.approx(got["ref_losses"][2], abs=ATOL), name
        for key in ("weights", "16bit"):  # consolidated; engine.save_16bit_model's file
            assert got[key][0] and got[key][1] < ATOL, key
        # DeepSpeed's _consolidated_16bit_state_dict: every expert, on rank 0 only
        want = {"model.layers.0.mlp.experts.gate_up_proj": [4, 96, 32],
                "model.layers.0.mlp.experts.down_proj": [4, 32, 48]}
        got_shapes = got["consolidated"]
        assert (got_shapes is None) == (rank != 0)
        assert rank != 0 or all(got_shapes[n] == s for n, s in want.items())


def test_four_ranks_ep2_by_expert_data_parallel_2_and_ep4(run4):
    """ep 2 x expert-data-parallel 2 (ZeRO-2 Mixtral, ZeRO-3 Qwen3-MoE) and ep 4 (ZeRO-1):
    one process's training; a checkpoint saved with ep 2 x edp 2 resumes with ep 4 and with
    no expert parallelism."""
    for rank in range(4):
        for name in ("ep2_s2", "ep2_s3", "ep4_s1"):
            _same_training(result(run4, name, rank))
        got = result(run4, "checkpoint", rank)
        assert got["first"] == pytest.approx(got["ref_losses"][:2], abs=ATOL)
        for name in ("ep4_s2", "dense_s0"):
            assert got[name] == pytest.approx(got["ref_losses"][2], abs=ATOL), name
        for key in ("weights", "16bit"):
            assert got[key][0] and got[key][1] < ATOL, key


@pytest.mark.parametrize("world,name", [(2, "sp2_ep2_s2"), (4, "dp2xsp2_ep4_s3")])
def test_with_sequence_parallelism(run, run4, world, name):
    """Ulysses with the experts split over the ranks that see other tokens (sp 2 with ep 2 at
    ZeRO-2; dp 2 x sp 2 with ep 4 at ZeRO-3): one process's losses, norm and weights."""
    for rank in range(world):
        got = result(run if world == 2 else run4, name, rank)
        assert got["loss_err"] < ATOL and got["weight_err"] < ATOL, got
        assert got["norm_err"] < ATOL and got["moved"] > 1e-3


def test_load_pretrained_reads_each_ranks_experts(run):
    """A Hugging Face Mixtral directory (the Hub's layout: each expert apart,
    ``block_sparse_moe.experts.<e>.w1/w2/w3``) loaded into the engine (ZeRO-3, 4 experts
    split over 2 ranks): the unsplit model's weights are the file's, and each rank read its
    own two experts' tensors alone, half of the experts' values; from a file of stacked
    experts (ZeRO-2), its experts' rows alone."""
    for rank in range(2):
        got = result(run, "pretrained", rank)
        assert got["file_names"] == ["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                                     "model.layers.0.block_sparse_moe.experts.0.w2.weight",
                                     "model.layers.0.block_sparse_moe.experts.0.w3.weight"]
        assert got["missing"] == [] and got["unexpected"] == []
        assert got["weights"] == 0.0
        assert got["experts_read"] == [2 * rank, 2 * rank + 1]
        assert got["read"] == got["expert_numel"] // 2
        # the same weights stacked in one tensor each (shardtrain's files): its rows alone
        assert got["stacked"] == 0.0 and got["stacked_read"] == got["expert_numel"] // 2


@pytest.mark.parametrize("stage", [0, 3])
def test_with_autotp(run4, stage):
    """tp 2 x dp 2, ep 2: AutoTP splits attention and each expert's ffn dimension, AutoEP the
    experts over the ranks that see other tokens: one process's losses, norm and weights."""
    for rank in range(4):
        got = result(run4, f"tp2_ep2_s{stage}", rank)
        assert got["loss_err"] < ATOL and got["weight_err"] < ATOL, got
        assert got["norm_err"] < ATOL and got["moved"] > 1e-3


def test_checkpoints_with_autotp_describe_the_unsplit_model(run4):
    """Saved with tp 2 x ep 2 (each rank: 2 of the 4 experts, half of each one's ffn rows):
    resumed with the same split at ZeRO-3 and with AutoTP alone, and consolidated into the
    one-process weights."""
    for rank in range(4):
        got = result(run4, "tp2_checkpoint", rank)
        assert got["local"]["model.layers.0.mlp.experts.gate_up_proj"] == [2, 48, 32]
        assert got["first"] == pytest.approx(got["ref_losses"][:2], abs=ATOL)
        for name in ("tp2_ep2_s3", "tp2_dense_s1"):
            assert got[name] == pytest.approx(got["ref_losses"][2], abs=ATOL), name
        for key in ("weights", "16bit"):
            assert got[key][0] and got[key][1] < ATOL, key


@pytest.mark.parametrize("name", ["s1", "s2", "s2_rule"])
def test_deepspeeds_own_autoep_run_gives_the_same_losses(run, name):
    """DeepSpeed 0.19.8's AutoEP (its own router, grouped experts and all-to-all) trained a tiny
    Mixtral over 2 ranks; the same config, weights and data through the alias give its losses:
    both route exactly as the model does, and with DeepSpeed's routing keys (top_k 3, sigmoid
    scores, renormalised, times 1.5) both route by DeepSpeed's rule."""
    for rank in range(2):
        got = result(run, f"deepspeed_{name}", rank)
        assert got["losses"] == pytest.approx(got["deepspeed"], abs=ATOL)


def test_deepspeeds_autoep_checkpoint_converts_and_resumes(run):
    """import_deepspeed reads DeepSpeed's AutoEP layout (experts stacked per rank as w1/w2/w3
    under its router's name) into the model's own (gate_up_proj, down_proj, gate): resumed
    with AutoEP and without, the next step's loss is DeepSpeed's."""
    for rank in range(2):
        got = result(run, "deepspeed_checkpoint", rank)
        for name in ("autoep_s2", "dense_s1"):
            assert got[name] == pytest.approx(got["deepspeed"], abs=ATOL), name


def test_frozen_split_experts_are_saved_whole_and_load_anywhere(run):
    for rank in range(2):
        got = result(run, "frozen_experts", rank)
        assert got["split_s1"] == 0.0 and got["whole_s3"] == 0.0, got


def test_a_model_built_under_zero_init(run):
    """Built under zero.Init, filled from a Hub-layout directory, split by AutoEP at ZeRO-3:
    one process's losses and clipped norms."""
    for rank in range(2):
        got = result(run, "zero_init", rank)
        assert got["losses"] == pytest.approx(got["ref_losses"], abs=ATOL)
        assert got["norms"] == pytest.approx(got["ref_norms"], abs=ATOL)


def test_mistakes_are_named(run):
    got = result(run, "refusals", 0)
    assert "preset_model 'mixtral' matches no MoE block of LlamaForCausalLM" in got["no_block"]
    assert "no preset for LlamaForCausalLM (model_type 'llama')" in got["no_preset"]
    assert "'mixtral_v9' is not a preset: choose one of" in got["unknown_preset"]
    assert "has 3 experts, which autoep_size 2 does not divide: choose an autoep_size among " \
        "[1, 3]" in got["indivisible"]
    assert "expert_parallel.num_expert_groups = 2 is not provided" in got["routing"]
    assert "expert_parallel.top_k: 5 experts per token, of 4: set top_k between 1 and 4" in \
        got["top_k"]
    assert "expert_parallel has unknown keys ['autoep']" in got["unknown_key"]
    assert "has no child 'router' (router_pattern)" in got["missing_part"]
    assert "have no stacked weights ['w1']" in got["weights"]
