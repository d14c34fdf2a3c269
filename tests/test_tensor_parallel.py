"""Tensor parallelism over real processes (gloo): layers split by AutoTP compute what the
plain model computes, shard by shard (cases in ``cases_tensor_parallel.py``)."""
from __future__ import annotations

import pytest

from _dist import result, run_ranks
from shardtrain.parallel import SplitSpec

FP32 = 1e-5
GPT_CASES = ("gpt", "gpt_head_gathered", "gpt_head_local")
HF_CASES = ("llama", "llama_head_tied", "llama_head_untied", "phi3", "phi3_head", "qwen2",
            "mixtral")


@pytest.fixture(scope="module")
def two():
    return 2, run_ranks("cases_tensor_parallel:two_ranks", 2, timeout=150)


@pytest.fixture(scope="module")
def four():
    return 4, run_ranks("cases_tensor_parallel:four_ranks", 4, timeout=150)


def _exact(got: dict, case: str) -> None:
    assert got["output"] < FP32, (case, got["output"])
    assert got["loss"] < FP32, (case, got["loss"])
    assert got["grad"] < FP32, (case, got["worst"], got["grad"])
    assert got["grad_rel"] < 1e-4, (case, got["grad_rel"])  # against each gradient's scale


@pytest.mark.parametrize("case", GPT_CASES + HF_CASES)
def test_outputs_losses_and_gradients_match_the_plain_model_on_two_ranks(two, case):
    for rank in range(2):
        _exact(result(two, case, rank), case)


@pytest.mark.parametrize("case", GPT_CASES + ("llama_dp2", "llama_head_tied_dp2"))
def test_four_ranks_tp4_and_tp2_by_dp2(four, case):
    for rank in range(4):
        _exact(result(four, case, rank), case)
    assert [result(four, "tp_ranks", r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    if case == "gpt":
        assert result(four, case, 0)["model"]["n_head"] == 1  # 4 heads over 4 ranks


def test_gpt_layers_split_and_heads_made_local(two):
    got = result(two, "gpt", 1)
    assert got["split_params"] == sorted(
        f"blocks.{i}.{name}" for i in range(2)
        for name in ("attn.query.weight", "attn.query.bias", "attn.key.weight",
                     "attn.value.weight", "attn.value.bias", "attn.proj.weight",
                     "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight"))
    assert got["splits"]["blocks.0.mlp.fc.weight"] == SplitSpec(0, (128,))
    assert got["splits"]["blocks.0.mlp.proj.weight"] == SplitSpec(1, (128,))
    assert got["model"] == {"tied": True, "embedding": "Embedding", "lm_head": "Linear",
                            "n_head": 1}
    assert got["head"] == "replicated" and got["loss_function"] is None


def test_a_split_head_keeps_the_tied_embedding_one_parameter(two):
    for case in ("gpt_head_gathered", "gpt_head_local"):
        got = result(two, case, 0)
        assert got["model"]["tied"], case
        assert got["model"]["embedding"] == "VocabParallelEmbedding"
        assert got["model"]["lm_head"] == "ColumnParallelLinear"
        assert got["splits"]["tok_emb.weight"] == got["splits"]["lm_head.weight"] == \
            SplitSpec(0, (64,))
    assert result(two, "gpt_head_gathered", 0)["head"] == "vocab-parallel, gathered"
    assert result(two, "gpt_head_local", 0)["head"] == "vocab-parallel"


def test_llama_preset_by_model_type(two):
    got = result(two, "llama", 0)
    assert got["head"] == "replicated"
    assert got["splits"]["model.layers.0.self_attn.k_proj.weight"] == SplitSpec(0, (32,))
    assert got["splits"]["model.layers.1.self_attn.o_proj.weight"] == SplitSpec(1, (64,))
    assert len(got["split_params"]) == 14  # 7 projections x 2 layers; norms, embeddings whole
    assert got["model"]["attn_config_heads"] == (2, 1)  # the attention blocks' copy
    assert got["model"]["model_config_heads"] == (4, 2)  # the model's config, saved whole
    assert "the llama preset" in got["describe"]


def test_hugging_face_heads_split_use_the_vocab_parallel_loss(two):
    tied = result(two, "llama_head_tied", 1)
    assert tied["model"] == dict(tied["model"], tied=True, embedding="VocabParallelEmbedding",
                                 lm_head="ColumnParallelLinear")
    assert tied["loss_function"] == "vocab_parallel_cross_entropy"
    untied = result(two, "llama_head_untied", 1)
    assert not untied["model"]["tied"] and untied["model"]["embedding"] == "Embedding"
    assert "model.embed_tokens.weight" not in untied["splits"]
    assert untied["splits"]["lm_head.weight"] == SplitSpec(0, (128,))


def test_phi3_fused_qkv_follows_grouped_query_attention(two):
    got = result(two, "phi3", 0)
    assert got["splits"]["model.layers.0.self_attn.qkv_proj.weight"] == SplitSpec(0, (64, 32, 32))
    assert got["splits"]["model.layers.0.mlp.gate_up_proj.weight"] == SplitSpec(0, (128, 128))
    assert got["model"]["num_key_value_heads"] == 1
    assert got["model"]["attn_config_heads"] == (2, 1)


def test_mixtral_fused_experts_are_split_and_the_router_kept_whole(two):
    got = result(two, "mixtral", 0)
    assert got["splits"]["model.layers.0.mlp.experts.gate_up_proj"] == SplitSpec(1, (96, 96))
    assert got["splits"]["model.layers.0.mlp.experts.down_proj"] == SplitSpec(2, (96,))
    assert "model.layers.0.mlp.gate.weight" not in got["splits"]
    assert "kept whole by skip rules: model.layers.0.mlp.gate.weight" in got["describe"]


def test_bf16_runs_close_to_the_bf16_reference(two):
    got = result(two, "llama_bf16", 0)
    assert got["output"] < 0.1 and got["loss"] < 0.05, got


def test_building_blocks_gradients_and_collectives(two):
    for rank in range(2):
        got = result(two, "blocks", rank)
        assert got["gather_backward"] and got["scatter_backward"]
        assert got["forward_ops"] == ["all_reduce"]   # the row layer's sum
        assert got["backward_ops"] == ["all_reduce"]  # the column layer's input gradient
        # q, k and v read one input: their gradients are summed before one all-reduce
        assert got["shared_backward_ops"] == ["all_reduce"]
        assert got["shared_grad_err"] < 1e-5
        assert got["entries_left"] == 0  # nothing held after the block's forward
    assert result(two, "blocks", 1)["up_repr"] == (
        "ColumnParallelLinear(in_features=8, out_features=8, bias=True, tp=2, rank=1, "
        "gather_output=False)")


ERRORS = {
    "no_rules": "ValueError: no tensor-parallel rules for GPT (model_type None has no preset): "
                "set tensor_parallel.preset_model to one of llama, mistral, qwen2, mixtral, phi3, "
                "or give tensor_parallel.partition_config.layer_specs.",
    "unmatched_pattern": "ValueError: tensor_parallel.partition_config.layer_specs[0]: pattern "
                         "'.*\\\\.attention\\\\.q\\\\.weight$' matches no parameter of GPT (names "
                         "look like tok_emb.weight, pos_emb.weight, blocks.0.ln1.weight, "
                         "blocks.0.ln1.bias): fix the pattern; it is matched with re.match against "
                         "full parameter names.",
    "not_linear": "ValueError: norm.weight (8,) belongs to LayerNorm norm, not to an nn.Linear or "
                  "nn.Embedding: other parameters are split only when all of their module's "
                  "parameters (weight, bias) are, with both a column and a row spec (fused "
                  "experts). Change the pattern so that it does not match it, or make it a "
                  "'skip' spec.",
    "not_divisible": "ValueError: up.weight (5, 8) (matched by "
                     "tensor_parallel.partition_config.layer_specs[0]) in up (Linear): cannot "
                     "split size 5 along dim 0 into 2 equal tensor-parallel pieces: choose a "
                     "tensor-parallel size that divides 5, or keep this parameter replicated "
                     "(a 'skip' layer spec).",
    "heads": "ValueError: model.layers.0.self_attn.config.num_key_value_heads is 1: 1 heads cannot "
             "be split over 2 tensor-parallel ranks; choose a tensor-parallel size that divides 1.",
    "strict": "ValueError: tensor_parallel.partition_config.strict_mode: no layer spec matches the "
              "Linear layer(s) blocks.0.attn.key, blocks.0.attn.value, blocks.0.attn.proj, "
              "blocks.0.mlp.fc, blocks.0.mlp.proj and 5 more: add a layer spec for them "
              "(partition_type 'skip' keeps one replicated), or set strict_mode false.",
    "unknown_key": "ValueError: tensor_parallel.autotp (= 2) is not a known key: use one of "
                   "autotp_size, preset_model, partition_config, tp_overlap_comm.",
    "bad_type": "ValueError: tensor_parallel.partition_config.layer_specs[0].partition_type is "
                "'columns': use one of column, row, skip.",
    "size": "ValueError: tensor_parallel.autotp_size is 8 but the tensor-parallel group has 2 "
            "ranks: build the mesh with comm.init_mesh(tp=8), or set autotp_size to 2.",
    "row_head": "ValueError: tensor_parallel.partition_config.layer_specs[0] splits the LM head "
                "lm_head.weight as 'row': an LM head is split over its vocabulary only (a "
                "column spec without shape).",
    "tied_replicated_head": "ValueError: tok_emb.weight is tied to lm_head.weight (one Parameter), "
                            "which stays whole: split the Linear layer sharing it too (a column "
                            "spec over its vocabulary, e.g. for lm_head), or none of them.",
    "split_spec": "ValueError: cannot split part 1 of (6, 3), size 3 along dim 0 into 2 equal "
                  "tensor-parallel pieces: choose a tensor-parallel size that divides 3, or keep "
                  "this parameter replicated (a 'skip' layer spec).",
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_mistakes_are_refused_with_the_value_and_the_fix(two, name):
    assert result(two, "errors", 0)[name] == ERRORS[name]


def test_a_refused_model_is_left_as_it_was(two):
    assert result(two, "errors", 1)["untouched"] is True
