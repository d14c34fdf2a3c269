"""``shardtrain.load_pretrained`` on 2 CPU ranks: a ``save_pretrained`` checkpoint (one file,
and small shards with an index) of a GPT-2 built from a config (nothing downloaded) loaded
at ZeRO stages 0-3, with optimizer offload, in bf16, and into a model built under
``zero.Init`` before any engine exists (see ``cases_pretrained``).

Checked: the weights equal the file's (the tied head included); training afterwards equals
single-process training from the same weights (fp32, 1e-5); the optimizer's copies (offloaded
slices, bf16 masters) equal the loaded weights; at stages 0-2 each rank reads whole tensors,
at stage 3 and under zero.Init the rows that cover its shard (less than one row more at each
end), about half the file per rank; strict errors name the keys, shape mismatches are
refused, the same on both ranks, with the model unchanged. ``transformers``' own ZeRO-3
``from_pretrained`` through the ``deepspeed`` alias gives the same shards, and each rank
receives its shards, not whole tensors.
"""
from __future__ import annotations

import functools
import importlib.metadata
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

import cases_hf as ch  # noqa: E402
import cases_pretrained as cp  # noqa: E402
from _dist import result, run_ranks  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from shardtrain.zero._shards import shard_range  # noqa: E402
from test_hf import close  # noqa: E402

WORLD = 2
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SAVED_SEED = 7


def saved_state():
    """The checkpoint's tensors as save_pretrained writes them (the tied head once)."""
    state = ch.build_model(SAVED_SEED).state_dict()
    return {k: v.clone().contiguous() for k, v in state.items() if k != "lm_head.weight"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    model = ch.build_model(SAVED_SEED)
    model.save_pretrained(str(root / "one"))
    model.save_pretrained(str(root / "sharded"), max_shard_size="20KB")
    changed = saved_state()
    del changed["transformer.h.0.ln_1.bias"]
    changed["score.weight"] = torch.ones(2, ch.EMBD)
    save_file(changed, str(root / "changed.safetensors"))
    save_file(dict(saved_state(), **{"transformer.wte.weight": torch.zeros(ch.VOCAB + 4, ch.EMBD)}),
              str(root / "bigger.safetensors"))
    return root, run_ranks("cases_pretrained:run_all", WORLD, timeout=300, env=OFFLINE,
                           root=str(root))


@functools.lru_cache(maxsize=None)
def reference():
    return ch.reference_train(ch.build_model(SAVED_SEED), ch.make_tokens(WORLD, steps=cp.STEPS))


def with_tied_head(state):
    return dict(state, **{"lm_head.weight": state["transformer.wte.weight"]})


def test_the_checkpoint_has_several_shards(run):
    files = sorted(p.name for p in (run[0] / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (run[0] / "sharded" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("case", [c for c, spec in cp.LOADS.items() if not spec[3]])
def test_loaded_weights_train_like_one_process(run, case):
    """The weights equal the file's on every rank, and two steps of training from them give
    the losses and weights of single-process training from the same file."""
    want, ref = with_tied_head(saved_state()), reference()
    for rank in range(WORLD):
        got = result(run, case, rank)
        assert got["result"] == ([], [])
        assert got["tied"], "the head is no longer the embedding"
        close(got["loaded"], want, atol=0)
        torch.testing.assert_close(got["losses"], ref["losses"][:, :, rank], atol=1e-5, rtol=1e-5)
    close(result(run, case)["params"], ref["params"])


@pytest.mark.parametrize("case", ["stage2_offload", "stage3_offload", "stage3_bf16"])
def test_the_optimizer_copies_hold_the_loaded_weights(run, case):
    """Offloaded fp32 slices and bf16's fp32 masters are refreshed from the loaded weights
    (compared copy by copy in the case), so the next step starts from the file's values."""
    for rank in range(WORLD):
        assert result(run, case, rank)["masters"] > 0


def test_a_bf16_model_holds_the_file_values_rounded_to_bf16(run):
    want = with_tied_head(saved_state())
    for rank in range(WORLD):
        close(result(run, "stage3_bf16", rank)["loaded"],
              {k: v.to(torch.bfloat16).float() for k, v in want.items()}, atol=0)


def read_bound(shape, lo: int, hi: int) -> int:
    """The most a rank may read for elements [lo, hi): they, and less than a row each side."""
    return (hi - lo) + 2 * (math.prod(shape[1:]) - 1) if hi > lo else 0


@pytest.mark.parametrize("case", list(cp.LOADS))
def test_each_rank_reads_what_it_keeps(run, case):
    """Stages 0-2 (and the small parameters stage 3 keeps whole): the whole tensor. A shard:
    the rows that cover it. Nothing else, and no tensor twice (the tied head is read once)."""
    total = sum(v.numel() for v in saved_state().values())
    for rank in range(WORLD):
        got = result(run, case, rank)
        reads, kept = got["reads"], got["layout"]
        assert set(reads) == set(saved_state())
        for name, (shape, sharded) in kept.items():
            numel = math.prod(shape)
            if not sharded:
                assert reads[name] == numel, (name, rank)
                continue
            lo, hi = shard_range(numel, WORLD, rank)
            assert reads[name] <= read_bound(shape, lo, hi), (name, rank, reads[name])
        share = sum(reads.values()) / total
        if cp.LOADS[case][0] < 3:
            assert share == 1.0
        else:  # about 1/2: the shards, row edges, and the small parameters kept whole
            assert share < 0.6, (case, rank, share)


def test_strict_refusals_name_the_keys_and_change_nothing(run):
    for rank in range(WORLD):
        got = result(run, "refusals", rank)
        assert "missing from the file: 1 (transformer.h.0.ln_1.bias)" in got["changed"]
        assert "in the file but not in the model: 1 (score.weight)" in got["changed"]
        assert "strict=False" in got["changed"]
        assert ("'transformer.wte.weight' has shape [101, 32] in the file but [97, 32] in the "
                "model") in got["bigger"]
        assert got["unchanged"]
        assert got["lists"] == (["transformer.h.0.ln_1.bias"], ["score.weight"])
        after, before, want = got["after"], got["before"], saved_state()
        assert torch.equal(after["transformer.h.0.ln_1.bias"], before["transformer.h.0.ln_1.bias"])
        assert torch.equal(after["transformer.h.1.mlp.c_fc.weight"],
                           want["transformer.h.1.mlp.c_fc.weight"])


def test_from_pretrained_under_zero3_receives_shards_not_whole_tensors(run):
    """transformers' ZeRO-3 path through the alias: zero.Init partitions as modules are built,
    then each module is gathered, filled on rank 0 and stored with modifier_rank=0. Each rank
    receives only its shards at both points (scatters), where whole tensors were broadcast
    before: half as much on 2 ranks, 1/N on N."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the deepspeed alias is not installed (shardtrain deepspeed-alias install)")
    if "+shardtrain" not in version:
        pytest.skip(f"deepspeed {version} is not the shardtrain alias")
    want = with_tied_head(saved_state())
    for rank in range(WORLD):
        got = result(run, "from_pretrained_zero3", rank)
        assert got["same_shards"], "from_pretrained and load_pretrained keep different shards"
        for name, value in got["loaded"].items():
            assert torch.equal(value, want[name]), name
        traffic, chunks = got["traffic"], sum(got["chunks"])
        assert "broadcast" not in traffic, traffic
        assert traffic["all_gather"] == chunks  # each module gathered once, to be filled
        # zero.Init's shards, then the filled shards (plus the head built before it is tied)
        assert 2 * chunks <= traffic["scatter"] <= 2 * chunks + max(got["chunks"]), traffic
