"""The engine on a device mesh over real processes: tensor- and sequence-parallel ranks composed
with ZeRO's data parallelism train exactly as one process does on the same global batch (cases
in ``cases_parallel.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from _dist import run_ranks

CASES = str(Path(__file__).resolve().parent / "cases_parallel.py")

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


PAIRS = [("dp2xtp2", "dp4"), ("dp2xsp2", "dp4"), ("tp4", "dp2xtp2"), ("dp4", "dp2xsp2"),
         ("tp2xsp2", "dp4")]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("mesh-ckpt"))
    return run_ranks("cases_parallel:resume_on_another_mesh", 4, timeout=400, save_dir=save_dir,
                     pairs=PAIRS)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_checkpoint_resumes_exactly_on_another_mesh(resumed, pair, stage):
    """TP 2 -> 1 (dp2 x tp2 -> dp4), SP 2 -> 1 (dp2 x sp2 -> dp4), TP 4 -> dp2 x tp2 and back
    to a mesh from plain data parallelism: the resumed run's losses and full weights are the
    uninterrupted run's."""
    name = f"{pair[0]}->{pair[1]}@{stage}"
    for rank, got in enumerate(resumed):
        case = got[name]
        assert case["names"], rank
        assert case["loss_err"] < 2e-5, (rank, case["losses"])
        assert case["weight_err"] < 2e-5, (rank, case["weight_err"])
    assert resumed[0][name]["consolidated"]


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    return run_ranks("cases_parallel:mesh_contract", 4, timeout=300,
                     save_dir=str(tmp_path_factory.mktemp("pretrained")))


REFUSALS = {
    "world": "ConfigError: world size 4 is not divisible by tensor_parallel.autotp_size 3 x "
             "sequence_parallel_size 1 = 3: launch a multiple of 3 ranks, or choose sizes whose "
             "product divides 4.",
    "tp_heads": "ValueError: model.layers.0.self_attn.config.num_key_value_heads is 2: 2 heads "
                "cannot be split over 4 tensor-parallel ranks; choose a tensor-parallel size "
                "that divides 2.",
    "sp_heads": "ValueError: the model has 2 attention heads (num_attention_heads), not "
                "divisible by the sequence-parallel size 4: use a sequence_parallel_size among "
                "[1, 2].",
    "unmatched": "ValueError: tensor_parallel.partition_config.layer_specs[0]: pattern "
                 "'.*\\\\.attention\\\\.q\\\\.weight$' matches no parameter of GPT (names look "
                 "like tok_emb.weight, pos_emb.weight, blocks.0.ln1.weight, blocks.0.ln1.bias): "
                 "fix the pattern; it is matched with re.match against full parameter names.",
    "not_splittable": "ValueError: blocks.0.ln1.weight (32,) belongs to LayerNorm blocks.0.ln1, "
                      "not to an nn.Linear or nn.Embedding: other parameters are split only "
                      "when all of their module's parameters (weight, bias) are, with both a "
                      "column and a row spec (fused experts). Change the pattern so that it "
                      "does not match it, or make it a 'skip' spec.",
    "mpu_and_tp": "ValueError: initialize(mpu=...) brings its own groups, but the config also "
                  "asks for tensor_parallel size 2 and sequence_parallel_size 1: keep one of "
                  "them.",
    "zero_init": "ValueError: model.embed_tokens.weight is partitioned by ZeRO-3 (the model was "
                 "built under shardtrain.zero.Init): tensor parallelism splits whole weights. "
                 "Build the model without zero.Init (ZeRO-3 then shards each tensor-parallel "
                 "slice over the data-parallel ranks), or train it without tensor_parallel.",
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_initialize_refuses_a_bad_mesh_with_the_number_and_the_fix(contract, name):
    """A world the sizes do not divide, heads the tensor- or sequence-parallel size does not
    divide, a pattern that matches nothing, a layer that cannot be split, an mpu with a
    mesh of its own: every rank raises the same message, and the model it was given is
    left as it was."""
    for rank, got in enumerate(contract):
        assert got[name] == {"error": REFUSALS[name], "untouched": True}, rank


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("mesh", ["dp4", "dp2xtp2", "tp4", "dp2xsp2"])
def test_parameter_bytes_per_rank_follow_the_mesh(contract, mesh, stage):
    """A tensor-parallel rank holds 1/tp of each split weight (the llama preset splits the
    attention and MLP projections); stage 3 shards what is left over the data- x
    sequence-parallel ranks."""
    tp, sp = {"dp4": (1, 1), "dp2xtp2": (2, 1), "tp4": (4, 1), "dp2xsp2": (1, 2)}[mesh]
    for rank, got in enumerate(contract):
        case = got[f"bytes_{mesh}_{stage}"]
        assert "error" not in case, case.get("error")
        assert case["got"] == case["want"], (rank, case)
        assert len(case["split"]) == (14 if tp > 1 else 0)  # 7 projections x 2 layers
        if stage == 0:
            assert case["got"] < case["full"] or tp == 1
    # `shardtrain estimate` predicts what the engine holds; stage 3 pads each of the 16
    # sharded parameters to an even chunk (at most 3 elements of 4 bytes over 4 ranks)
    report = estimate_mesh(tp, sp)
    estimated = report["stages"][stage]["params"]
    assert abs(estimated - contract[0][f"bytes_{mesh}_{stage}"]["got"]) <= 16 * 3 * 4, estimated


def estimate_mesh(tp: int, sp: int) -> dict:
    import contextlib
    import io
    import json
    from shardtrain.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", "--json", "--model", f"{CASES}:llama", "--model-kwargs",
                     '{"num_key_value_heads": 4}', "--nproc", "4", "--dtype", "fp32",
                     "--tensor-parallel", str(tp), "--sequence-parallel", str(sp),
                     "--persistence-threshold", "4096"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("stage", [1, 3])
def test_a_users_own_groups_through_mpu_train_exactly(contract, stage):
    """initialize(mpu=...) with model-parallel pairs of adjacent ranks and data-parallel ranks
    across them: gradients are averaged over the data-parallel group only, each pair reads
    the same samples, and training matches one process on the global batch."""
    _check(contract, f"mpu_stage{stage}")
    for rank, got in enumerate(contract):
        assert got[f"mpu_stage{stage}"]["mpu"] == {
            "model_parallel_rank": rank % 2, "model_parallel_world_size": 2,
            "data_parallel_rank": rank // 2, "data_parallel_world_size": 2, "dp_world_size": 2}


@pytest.mark.parametrize("mesh", ["dp2xtp2", "dp2xsp2"])
def test_bf16_on_a_mesh_tracks_the_fp32_reference(contract, mesh):
    """bf16 weights with fp32 masters: the losses and the clipped global norm stay within
    bf16's resolution of the fp32 single-process run."""
    for rank, got in enumerate(contract):
        case = got[f"bf16_{mesh}"]
        assert "error" not in case, case.get("error")
        assert case["same_in_group"]
        assert case["loss_err"] < 2e-3, (rank, case["loss_err"])
        got_norm, want_norm = case["norms"]
        assert abs(got_norm - want_norm) < 1e-2 * want_norm, (rank, case["norms"])
        # gradients are reduced in fp32 on a sequence-parallel mesh (DeepSpeed's
        # seq_parallel_communication_data_type default), in bf16 otherwise
        want = "float32" if mesh == "dp2xsp2" else "bfloat16"
        assert case["wire"] == [want] and case["comm_dtype"] == want, (rank, case["wire"])


def test_seq_parallel_communication_data_type_chooses_the_gradients_wire(contract):
    """``seq_parallel_communication_data_type: "bf16"`` on dp 2 x sp 2: the gradient
    reductions run in bf16 (the default is fp32), and training still tracks the reference."""
    for rank, got in enumerate(contract):
        case = got["bf16_dp2xsp2_bf16_wire"]
        assert "error" not in case, case.get("error")
        assert case["wire"] == ["bfloat16"] and case["comm_dtype"] == "bfloat16", (rank, case)
        assert case["loss_err"] < 2e-3, (rank, case["loss_err"])


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_and_sequence_parallel_together_train_exactly(contract, stage):
    """tp 2 x sp 2 on 4 ranks: AutoTP splits the heads, Ulysses exchanges each rank's share
    of them over the sequence-parallel group. The engine's size attributes are DeepSpeed's."""
    _check(contract, f"tp2xsp2_stage{stage}")
    for got in contract:
        case = got[f"tp2xsp2_stage{stage}"]
        assert case["dp"] == 1 and all(shape == (2, 8) for shape in case["shapes"])
        assert case["sizes"] == {"world_size": 4, "dp_world_size": 1, "mp_world_size": 2,
                                 "sequence_parallel_size": 2, "seq_dp_world_size": 2}


@pytest.mark.parametrize("case", ["dp2xtp2_1", "dp2xtp2_3", "tp4_2"])
def test_pretrained_weights_load_into_a_tensor_parallel_engine(contract, case):
    """load_pretrained(engine, path) on a mesh: every rank keeps its slice of the file's
    unsplit tensors (at stage 3 its shard of the slice); the full weights are the file's and
    the loss is the plain model's."""
    for rank, got in enumerate(contract):
        result = got[f"pretrained_{case}"]
        assert "error" not in result, result.get("error")
        assert result["names"] and result["err"] == 0.0, (rank, result)
        assert result["loss_err"] < 1e-5, (rank, result)


def test_an_optimizer_built_before_initialize_trains_the_split_weights(contract):
    """dp 2 x tp 2: an optimizer built from the model's parameters before initialize (the HF
    Trainer's way) is pointed at AutoTP's slices, and trains as the config's optimizer does."""
    for rank, got in enumerate(contract):
        case = got["client_optimizer"]
        assert "error" not in case, case.get("error")
        assert case["client"] == case["config"], (rank, case)


def test_deepspeeds_clip_grad_norm_with_mpu_measures_the_whole_model(contract):
    """``deepspeed.runtime.utils.clip_grad_norm_(params, max, mpu=engine.mpu)`` on dp 2 x tp 2:
    the 2-norm and the inf-norm are the unsplit model's on the global batch (split slices add
    up over the tensor-parallel group, replicated parameters count once), and clipping to
    0.25 leaves a norm of 0.25."""
    for rank, got in enumerate(contract):
        case = got["clip_with_mpu"]
        assert "error" not in case, case.get("error")
        assert 0 < case["split"] < case["params"], case
        for kind, want in case["want"].items():
            assert abs(case["got"][kind] - want) < 1e-5 * max(1.0, want), (rank, kind, case)
        assert abs(case["after"] - 0.25) < 1e-5, (rank, case)
