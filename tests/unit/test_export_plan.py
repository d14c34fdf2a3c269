"""The plan of an export to the Hugging Face layout, from a meta.json alone (one process).

Which tensor is read (weights, masters, buffers) and in which dtype it is written, how shards
are filled (Hugging Face's rule, checked against ``huggingface_hub`` when it is installed),
the index and config.json, and the shard-size argument.
"""
from __future__ import annotations

import pytest
import torch

from shardtrain.checkpoint._export_plan import SINGLE, plan_export, shard_size_bytes

WORLD = 2


def entry(shape, dtype="float32", trainable=True, master=False):
    numel = 1
    for d in shape:
        numel *= d
    half = -(-numel // WORLD)
    pieces = ([[r, min(r * half, numel), min((r + 1) * half, numel)] for r in range(WORLD)]
              if trainable else [[0, 0, numel]])
    return {"shape": list(shape), "dtype": dtype, "numel": numel, "trainable": trainable,
            "master": master, "pieces": [p for p in pieces if p[2] > p[1]]}


def meta(dtype="bfloat16", master=True, config=None):
    """A bf16 run with fp32 masters: an embedding, a frozen matrix, a bias, an int buffer."""
    return {"params": {"emb.weight": entry([64, 16], dtype, master=master),
                       "frozen.weight": entry([16, 16], dtype, trainable=False),
                       "out.bias": entry([64], dtype, master=master)},
            "buffers": {"steps": entry([3], "int64", trainable=False),
                        "scale": entry([4], "float32", trainable=False)},
            "model_config": config}


def by_name(plan):
    return {t.name: t for _, group in plan.shards for t in group}


def test_default_dtype_reads_the_weights_as_saved():
    plan = plan_export(meta(), None, 10**9)
    tensors = by_name(plan)
    assert [name for name, _ in plan.shards] == [SINGLE] and plan.index is None
    assert list(tensors) == ["emb.weight", "frozen.weight", "out.bias", "steps", "scale"]
    assert tensors["emb.weight"].key == "param/emb.weight"
    assert tensors["emb.weight"].dtype == torch.bfloat16
    assert tensors["steps"].key == "buffer/steps" and tensors["steps"].dtype == torch.int64


def test_fp32_reads_the_masters_of_trainable_parameters():
    tensors = by_name(plan_export(meta(), torch.float32, 10**9))
    assert tensors["emb.weight"].key == "master/emb.weight"
    assert tensors["emb.weight"].entry["dtype"] == "float32"  # the master's entry
    assert tensors["frozen.weight"].key == "param/frozen.weight"  # no master: cast
    assert all(t.dtype == torch.float32 for n, t in tensors.items() if n != "steps")


def test_half_dtypes_cast_floating_parameters_and_keep_buffers():
    tensors = by_name(plan_export(meta("float32", master=False), torch.float16, 10**9))
    assert tensors["emb.weight"].key == "param/emb.weight"
    assert tensors["emb.weight"].dtype == torch.float16
    assert tensors["scale"].dtype == torch.float32  # buffers keep their dtype
    assert tensors["steps"].dtype == torch.int64


def test_shards_follow_hugging_faces_rule():
    # bytes in bf16: emb 2048, frozen 512, bias 128, steps 24, scale 16
    plan = plan_export(meta(), None, 1000)
    assert [[t.name for t in group] for _, group in plan.shards] == [
        ["emb.weight"], ["frozen.weight", "out.bias", "steps", "scale"]]
    assert [name for name, _ in plan.shards] == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]
    assert plan.index == {
        "metadata": {"total_parameters": 64 * 16 + 16 * 16 + 64, "total_size": 2728},
        "weight_map": {"emb.weight": "model-00001-of-00002.safetensors",
                       **{n: "model-00002-of-00002.safetensors"
                          for n in ["frozen.weight", "out.bias", "steps", "scale"]}}}


@pytest.mark.parametrize("limit", [1, 100, 600, 700, 2100, 2700, 10**6])
def test_shards_equal_huggingface_hubs_split(limit):
    hub = pytest.importorskip("huggingface_hub")
    plan = plan_export(meta(), None, limit)
    state = {t.name: torch.zeros(t.shape, dtype=t.dtype) for _, group in plan.shards
             for t in group}
    split = hub.split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    assert {name: [t.name for t in group] for name, group in plan.shards} \
        == split.filename_to_tensors
    if plan.index is not None:
        assert plan.index["metadata"]["total_size"] == split.metadata["total_size"]


def test_config_json_gets_the_written_dtype():
    recorded = {"model_type": "gpt2", "n_embd": 16, "dtype": None,
                "architectures": ["GPT2LMHeadModel"]}
    assert plan_export(meta(), None, 10**9).config is None
    assert plan_export(meta(config=recorded), None, 10**9).config == dict(recorded,
                                                                         dtype="bfloat16")
    assert plan_export(meta(config=recorded), torch.float32, 10**9).config["dtype"] == "float32"
    old = dict(recorded, torch_dtype="float32")  # written by transformers 4
    assert plan_export(meta(config=old), torch.float16, 10**9).config["torch_dtype"] == "float16"


@pytest.mark.parametrize("value,expected", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30),
                                            ("500MB", 5 * 10**8), ("1.5KB", 1500), (4096, 4096)])
def test_shard_sizes(value, expected):
    assert shard_size_bytes(value) == expected


@pytest.mark.parametrize("value,message", [("5XB", "'5XB' is not a size"), (0, "is 0"),
                                           ("-1GB", "not a size"), (True, "is True"),
                                           (2.5, "is 2.5")])
def test_bad_shard_sizes_say_what_to_write(value, message):
    with pytest.raises(ValueError, match="max_shard_size") as error:
        shard_size_bytes(value)
    assert message in str(error.value)
