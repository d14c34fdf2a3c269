"""ZeRO stage 3 over real processes: the hard cases, against single-process PyTorch.

(The shared cases of test_engine_dist.py also run at stage 3: plain steps, accumulation,
clipping, tied GPT weights, frozen and unused parameters, fp16 overflow, bf16, memory.)
"""
from __future__ import annotations

import pytest
import torch

import cases_zero3 as cz
import gpt
from _dist import result, run_ranks
from cases_engine import adamw, make_data
from shardtrain.zero._shards import shard_range


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def run(request):
    world = request.param
    return world, run_ranks("cases_zero3:run_all", world, timeout=240)


def close(got, want, atol=1e-5):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=1e-5, msg=key)


def same_on_every_rank(run, name, key="params"):
    world = run[0]
    first = result(run, name, 0)[key]
    for rank in range(1, world):
        other = result(run, name, rank)[key]
        for k in first:
            assert torch.equal(first[k], other[k]), f"rank {rank} differs on {k}"


@pytest.mark.parametrize("name", ["znet", "znet_tight", "znet_forwards_first"])
def test_hard_cases_match_reference(run, name):
    """Frozen layer, buffer, module called twice, parameter used twice, a weight read in
    the loss outside any forward, a path that changes between steps, accumulation 2,
    clipping (and both micro-batches' forwards before their backwards): the same losses and
    weights as single-process training."""
    world = run[0]
    steps, gas = (3, 1) if name == "znet_tight" else (4, 2)
    ref = cz.reference_znet(make_data(steps, gas, world, 3), penalty=True)
    for rank in range(world):
        got = result(run, name, rank)
        torch.testing.assert_close(got["losses"], ref["losses"][:, :, rank], atol=1e-5,
                                   rtol=1e-5)
        assert all(got["shard_only"]), "a full parameter outlived its step"
        torch.testing.assert_close(got["buffer"], torch.full((cz.H,), 0.1))
    close(result(run, name)["params"], ref["params"])
    same_on_every_rank(run, name)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(run, reentrant):
    world = run[0]
    cfg, tokens = cz.gpt_tokens(world)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)  # the same maths without checkpointing
    opt = adamw(model.parameters())
    for s in range(tokens.shape[0]):
        opt.zero_grad()
        batch = tokens[s].reshape(world * 2, -1)
        model(batch[:, :-1], batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    got = result(run, "checkpointing")[reentrant]
    close(got["params"], cz._state(model))


def test_model_built_under_init(run):
    world = run[0]
    cfg, tokens = cz.gpt_tokens(world)
    torch.manual_seed(0)
    plain = gpt.GPT(cfg)
    for rank in range(world):
        got = result(run, "init", rank)
        assert got["partitioned"], "zero.Init left a full parameter on a rank"
        assert got["shapes"] == {n: tuple(p.shape) for n, p in plain.named_parameters()}
        for name, p in plain.named_parameters():  # initialised as a plain build
            assert torch.equal(got["initial"][name], p.detach()), name
    # and it trains to the same losses as the plain build
    opt = adamw(plain.parameters())
    losses = []
    for s in range(tokens.shape[0]):
        opt.zero_grad()
        per_rank = [plain(tokens[s, r, :, :-1], tokens[s, r, :, 1:]) for r in range(world)]
        loss = sum(per_rank) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        losses.append([x.item() for x in per_rank])
    for rank in range(world):
        got = result(run, "init", rank)["losses"]
        assert got == pytest.approx([per_step[rank] for per_step in losses], abs=1e-5)
    close(result(run, "init")["params"], cz._state(plain))


def test_gathered_parameters_and_16bit_save(run):
    world = run[0]
    info = result(run, "gathered_parameters")
    assert info["ds_shape"] == (cz.OUT, cz.H) and info["ds_numel"] == cz.OUT * cz.H
    assert info["released_shape"] == (0,)          # released: an empty tensor
    assert info["read_shape"] == (cz.OUT, cz.H)    # gathered inside the block
    want = torch.arange(cz.OUT * cz.H, dtype=torch.float32).view(cz.OUT, cz.H)
    for rank in range(world):  # rank 0's change reached every shard; the read-only one did not
        torch.testing.assert_close(result(run, "gathered_parameters", rank)["after"], want)
    torch.testing.assert_close(info["saved"], want)
    assert set(info["state"]) == set(cz.znet().state_dict())  # full state_dict, every key


def test_prefetching_and_persistence(run):
    """Default settings: after the first step the recorded order prefetches upcoming
    modules. With no prefetch budget everything is fetched when needed. Parameters at or
    under stage3_param_persistence_threshold (4 here) stay whole."""
    prefetched = result(run, "znet")["stats"]
    tight = result(run, "znet_tight")["stats"]
    assert prefetched["prefetched"] > 0
    assert tight["prefetched"] == 0 and tight["on_demand"] > prefetched["on_demand"]
    assert result(run, "znet")["persistent"] == {"head.bias": (cz.OUT,)}


def test_each_module_gathered_at_most_once_per_pass(run):
    for forward, total in result(run, "gather_count")["counts"]:
        assert forward > 0 and total <= 2 * forward, (forward, total)


def plain_gpt_training(world, tokens):
    """Single-process GPT training on the global batch, as zero3_config sets it up."""
    cfg = gpt.gpt_config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    opt = adamw(model.parameters())
    losses = []
    for s in range(tokens.shape[0]):
        opt.zero_grad()
        per_rank = [model(tokens[s, r, :, :-1], tokens[s, r, :, 1:]) for r in range(world)]
        (sum(per_rank) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append([x.item() for x in per_rank])
    return losses, cz._state(model)


def test_leaf_blocks_gather_once_and_train_the_same(run):
    """Blocks marked as leaves (leaf_module.classes ["Block"]): each block's 12 parameters
    come in one all-gather instead of 8 (one per module), and training is unchanged."""
    world = run[0]
    cfg, tokens = cz.gpt_tokens(world)
    losses, state = plain_gpt_training(world, tokens)
    per_module, per_leaf = result(run, "leaf_blocks")[False], result(run, "leaf_blocks")[True]
    assert per_module["leaves"] == []
    assert per_leaf["leaves"] == [f"blocks.{i}" for i in range(cfg.n_layer)]
    for (fwd_module, _), (fwd_leaf, total_leaf) in zip(per_module["counts"], per_leaf["counts"]):
        assert fwd_leaf == fwd_module - 7 * cfg.n_layer, (fwd_module, fwd_leaf)
        assert total_leaf <= 2 * fwd_leaf
    for rank in range(world):
        got = result(run, "leaf_blocks", rank)[True]
        assert got["losses"] == pytest.approx([per_step[rank] for per_step in losses], abs=1e-5)
    close(per_leaf["params"], state)
    close(per_module["params"], state)


def test_leaves_by_name_suffix_and_granularity(run):
    """names ["blocks.0"], name_suffixes ["mlp"] and stage3_module_granularity_threshold 900
    (the tiny GPT's attention modules have 838 elements per layer, its blocks 1152): the
    outermost marked modules are the units; what is inside them has no hooks of its own."""
    world = run[0]
    cfg, tokens = cz.gpt_tokens(world)
    got = result(run, "leaf_selection")
    n = cfg.n_layer
    assert got["leaves"] == ["blocks.0", "blocks.0.attn", "blocks.0.mlp"] + [
        f"blocks.{i}.{part}" for i in range(1, n) for part in ("attn", "mlp")]
    want_units = {"tok_emb", "pos_emb", "ln_f", "blocks.0"} | {
        f"blocks.{i}.{part}" for i in range(1, n) for part in ("ln1", "attn", "ln2", "mlp")}
    assert set(got["units"]) - {"lm_head"} == want_units
    losses, state = plain_gpt_training(world, tokens)
    for rank in range(world):
        assert result(run, "leaf_selection", rank)["losses"] == pytest.approx(
            [per_step[rank] for per_step in losses], abs=1e-5)
    close(got["params"], state)


def test_mixture_of_experts_with_a_leaf_block(run):
    """Experts chosen by the data differ between ranks; with the MoE block a leaf, stage 3
    trains it exactly like single-process training on the global batch."""
    world = run[0]
    x, y = make_data(4, 1, world, 6, seed=5)
    experts = [result(run, "leaf_moe", r)["experts"] for r in range(world)]
    assert any(len({tuple(e[s]) for e in experts}) > 1 for s in range(x.shape[0])), \
        "every rank ran the same experts: the case does not test what it should"
    model = cz.moe_net()
    opt = cz.sgd(model.parameters())
    losses = []
    for s in range(x.shape[0]):
        opt.zero_grad()
        per_rank = [torch.nn.functional.cross_entropy(model(x[s, 0, r]), y[s, 0, r]) for r in range(world)]
        (sum(per_rank) / world).backward()
        opt.step()
        losses.append([x.item() for x in per_rank])
    for rank in range(world):
        expected = [per_step[rank] for per_step in losses]
        assert result(run, "leaf_moe", rank)["losses"] == pytest.approx(expected, abs=1e-5)
    close(result(run, "leaf_moe")["params"], cz._state(model))
    same_on_every_rank(run, "leaf_moe")


def test_leaf_modules_with_zero_init_offload_and_checkpoints(run):
    """Leaf blocks under zero.Init with parameters and optimizer offloaded train exactly like
    per-module gathering; each run's checkpoint resumes in an engine with the other setting."""
    got = result(run, "leaf_init_offload_checkpoint")
    plain, leaf = got["plain"], got["leaf"]
    assert leaf["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    close(leaf["params"], plain["params"], atol=1e-6)
    for run_ in (plain, leaf):
        assert run_["resumed"]["losses"] == pytest.approx(run_["losses"][3:], abs=1e-6)
        close(run_["resumed"]["params"], run_["params"], atol=1e-6)


def test_weights_set_under_the_engine_reach_its_masters(run):
    """A partitioned weight and a bias stage 3 keeps whole, both written by rank 0 inside
    GatheredParameters(modifier_rank=0): every rank trains from the new values."""
    world = run[0]
    for name in ("bf16", "offload"):
        for rank in range(world):
            got = result(run, "gathered_parameters_reach_masters", rank)[name]
            assert got["bias_whole"], "head.bias was expected to stay whole (persistence 4)"
            assert torch.equal(got["weight"], torch.full((cz.OUT, cz.H), 0.25)), (name, rank)
            assert torch.equal(got["bias"], torch.full((cz.OUT,), 0.5)), (name, rank)


def test_modifier_values_arrive_as_shards(run):
    """DeepSpeed broadcasts the modifier's whole tensors at the end of
    GatheredParameters(modifier_rank=r), then each rank keeps its shard: shardtrain sends each
    rank only its shard (a scatter), and zero.Init cuts rank 0's values the same way. A
    parameter gathered before the block stays gathered, so it is broadcast whole, and every
    rank reads the modifier's value inside the outer block."""
    world = run[0]
    for rank in range(world):
        got = result(run, "modifier_traffic", rank)
        chunks = got["chunks"]
        assert got["built"] == {"scatter": chunks}
        assert got["written"] == {"all_gather": chunks, "scatter": chunks}
        head_chunk, head_numel = got["head"]
        assert got["nested"] == {"all_gather": head_chunk, "broadcast": head_numel}
        assert torch.equal(got["inside"], torch.full((cz.OUT, cz.H), -1.0))
        for name, shard in got["shards"].items():
            numel = cz.znet().get_parameter(name).numel()
            lo, hi = shard_range(numel, world, rank)
            want = -1.0 if name == "head.weight" else 2.0
            assert torch.equal(shard[: hi - lo], torch.full((hi - lo,), want)), name
            assert not shard[hi - lo:].any(), f"{name}: padding is not zero"
