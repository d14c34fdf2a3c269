"""AutoEP's pure parts in one process: the ``expert_parallel`` block's checks, the record of
stacked experts, and the split experts module on one rank (every expert local) against the
model's own experts module."""
from __future__ import annotations

import pytest
import torch

from shardtrain.layout import ExpertSplit, ParamLayout
from shardtrain.moe._groups import expert_groups
from shardtrain.moe.auto import SplitExperts, find_moe_blocks, parse_block


def test_the_block_follows_deepspeeds_keys_and_names_each_mistake():
    config = parse_block({"enabled": True, "autoep_size": 4, "preset_model": "qwen3_moe",
                          "use_grouped_mm": False, "load_balance_coeff": None})
    assert (config.enabled, config.autoep_size) == (True, 4)
    assert config.preset.experts_pattern == "experts" and config.preset.expert_w3 is None
    custom = parse_block({"enabled": True, "moe_layer_pattern": r"h\.\d+\.moe",
                          "expert_w3": "up", "has_shared_experts": False})
    assert custom.preset.moe_layer_pattern == r"h\.\d+\.moe" and custom.preset.expert_w3 == "up"
    assert not parse_block(None).enabled
    with pytest.raises(ValueError, match="autoep_size must be a positive integer"):
        parse_block({"autoep_size": 0})
    with pytest.raises(ValueError, match="moe_layer_pattern '\\(' is not a regular expression"):
        parse_block({"moe_layer_pattern": "("})
    with pytest.raises(ValueError, match="router_pattern must be the name of one attribute"):
        parse_block({"router_pattern": "mlp.gate"})
    assert parse_block({"score_func": "sigmoid", "route_scale": 2.0}).routing == {
        "score_func": "sigmoid", "route_scale": 2.0}
    assert parse_block({"top_k": "auto", "route_norm": None}).routing == {}
    with pytest.raises(ValueError, match="score_func must be 'auto', 'softmax' or 'sigmoid'"):
        parse_block({"score_func": "relu"})
    with pytest.raises(NotImplementedError, match="score_apply = 'pre' is not provided"):
        parse_block({"score_apply": "pre"})


def test_stacked_experts_record_the_unsplit_shape():
    layout = ParamLayout((2, 6, 4), expert=ExpertSplit(None, 2, 4, 3))
    assert layout.full_shape == (8, 6, 4) and layout.numel == 192 and layout.local_numel == 48
    assert ExpertSplit(None, 2, 4, 3).global_name("m.experts.down_proj") == "m.experts.down_proj"


def _mixtral_block():
    """A one-layer Mixtral's MoE block and the same experts split over one rank (every expert
    local), with 4 experts of hidden size 16."""
    import transformers as tf
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2))
    preset = parse_block({"enabled": True, "preset_model": "mixtral"}).preset
    [block] = find_moe_blocks(model, preset)
    return block, SplitExperts(block.experts, preset, 4, expert_groups(1))


def test_split_experts_on_one_rank_are_the_models_experts():
    block, split = _mixtral_block()
    assert block.name == "model.layers.0.mlp" and block.num_experts == 4
    x = torch.randn(10, 16)
    _, weights, index = block.module.gate(x)
    assert torch.allclose(split(x, index, weights), block.experts(x, index, weights), atol=1e-6)


def test_a_slot_routed_nowhere_adds_nothing():
    block, split = _mixtral_block()
    x = torch.randn(6, 16)
    _, weights, index = block.module.gate(x)
    nowhere, zero = index.clone(), weights.detach().clone()
    nowhere[::2, 1] = 4  # the second slot of every other token goes nowhere: the same as
    zero[::2, 1] = 0.0   # a slot whose weight is zero
    assert torch.allclose(split(x, nowhere, weights), block.experts(x, index, zero), atol=1e-6)
