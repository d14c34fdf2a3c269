"""AutoTP's rules without a process group: the config block's checks, how a layer spec
reads ``shape``, and AutoTP on a group of one rank."""
from __future__ import annotations

import copy

import pytest
import torch

import gpt
from shardtrain import comm
from shardtrain.parallel import SplitSpec, apply_autotp, autotp_splits
from shardtrain.parallel._autotp_config import parse_block
from shardtrain.parallel._presets import PRESETS


def _specs(*specs):
    return {"partition_config": {"layer_specs": list(specs)}}


@pytest.mark.parametrize("block, message", [
    ({"partition_config": {"strict": True}},
     "tensor_parallel.partition_config.strict (= True) is not a known key: use one of layer_specs, "
     "use_default_specs, strict_mode, lm_head_patterns."),
    ({"autotp_size": 0}, "tensor_parallel.autotp_size is 0: use a positive integer"),
    ({"preset_model": "gpt2"}, "tensor_parallel.preset_model is 'gpt2': use one of llama, mistral, "
                               "qwen2, mixtral, phi3"),
    (_specs({"patterns": []}), "layer_specs[0].patterns is empty"),
    (_specs({"patterns": ["("]}), "layer_specs[0].patterns: '(' is not a valid regular expression"),
    (_specs({"patterns": ["x"], "partition_type": "row", "gather_output": True}),
     "layer_specs[0].gather_output is true for a 'row' spec"),
    (_specs({"patterns": ["x"], "shape": [2, [3, 4]]}),
     "a list of sizes is allowed only at the partition dim 0"),
    (_specs({"patterns": ["x"], "shape": [0, -1]}), "entry 0 must be a positive integer or -1"),
    (_specs({"patterns": ["x"], "partition_dim": -1}), "partition_dim is -1: use a non-negative"),
    ({"partition_config": {"use_default_specs": "yes"}},
     "tensor_parallel.partition_config.use_default_specs is 'yes': use true or false."),
])
def test_the_block_is_checked_key_by_key(block, message):
    with pytest.raises(ValueError) as err:
        parse_block(block, tuple(PRESETS))
    assert message in str(err.value)


def test_a_layer_spec_reads_shape_as_the_parameters_own_dims():
    spec = parse_block(_specs({"patterns": ["x"], "shape": [[32, 16, 16], -1]}),
                       tuple(PRESETS)).layer_specs[0]
    assert spec.split_for("qkv.weight", (64, 8)) == SplitSpec(0, (32, 16, 16))
    with pytest.raises(ValueError, match=r"sum to 64, but qkv.weight \(60, 8\) has 60"):
        spec.split_for("qkv.weight", (60, 8))
    experts = parse_block(_specs({"patterns": ["x"], "shape": [-1, 2, -1], "partition_dim": 1}),
                          tuple(PRESETS)).layer_specs[0]
    assert experts.split_for("gate_up", (4, 16, 8)) == SplitSpec(1, (8, 8))
    with pytest.raises(ValueError, match="has 3 dims but w has shape"):
        experts.split_for("w", (16, 8))


def test_autotp_on_a_group_of_one_leaves_the_outputs_as_they_were():
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config("tiny", vocab_size=64))
    ref = copy.deepcopy(model)
    plan = apply_autotp(model, comm.WORLD, _specs(
        {"patterns": [r".*\.(query|key|value|fc)\.weight$"]},
        {"patterns": [r".*\.proj\.weight$"], "partition_type": "row"},
        {"patterns": ["lm_head"], "gather_output": True}))
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(ids), ref(ids))
    assert model.lm_head.weight is model.tok_emb.weight
    assert plan.head == "vocab-parallel, gathered"
    assert "tok_emb.weight" in plan.splits and "lm_head.weight" in plan.splits
    with pytest.raises(ValueError, match=r"already tensor-parallel \(tok_emb.weight is a shard\)"):
        apply_autotp(model, comm.WORLD, {})


def test_autotp_splits_plans_what_apply_autotp_splits_without_touching_the_model():
    """The plan ``shardtrain estimate`` reads: the names and SplitSpecs apply_autotp then
    gives the model (tied names included), computed without a group on the meta device."""
    block = _specs({"patterns": [r".*\.(query|key|value|fc)\.(weight|bias)$"]},
                   {"patterns": [r".*\.proj\.weight$"], "partition_type": "row"},
                   {"patterns": ["lm_head"]})
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config("tiny", vocab_size=64))
    with torch.device("meta"):
        planned = gpt.GPT(gpt.gpt_config("tiny", vocab_size=64))
    before = {n: type(m) for n, m in planned.named_modules()}
    want = apply_autotp(model, comm.WORLD, block).splits
    assert autotp_splits(planned, 1, block) == want
    assert {n: type(m) for n, m in planned.named_modules()} == before
    assert not any(hasattr(p, "tp_split") for p in planned.parameters())
    assert {"tok_emb.weight", "lm_head.weight", "blocks.0.mlp.fc.bias"} <= set(want)
