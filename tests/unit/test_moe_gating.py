"""Mixture-of-experts routing (shardtrain.moe.gating) and the expert helpers, in one process:
capacity, which tokens an over-full expert keeps, exp_counts before dropping, the
load-balancing loss, top-2's renormalised gates and slot order, dropless buffers, and the
optimizer groups DeepSpeed's helpers build."""
from __future__ import annotations

import pytest
import torch

from shardtrain.moe import MoE, capacity, is_moe_param
from shardtrain.moe import gating
from shardtrain.moe._groups import layout
from shardtrain.moe.utils import (configure_moe_param_groups, has_moe_layers,
                                  split_params_into_different_moe_groups_for_optimizer)


def logits_choosing(choices, experts=2, strength=4.0):
    """Logits whose softmax prefers ``choices[s]`` for token ``s``."""
    out = torch.zeros(len(choices), experts)
    for s, e in enumerate(choices):
        out[s, e] = strength + 0.1 * s  # distinct gate values per token
    return out


def kept(routing):
    """{expert: [tokens in slot order]} from the dispatch mask."""
    out = {}
    for e in range(routing.dispatch.shape[1]):
        slots = routing.dispatch[:, e, :].nonzero().tolist()
        out[e] = [s for s, _ in sorted(slots, key=lambda sc: sc[1])]
    return out


def test_capacity_is_the_ceiling_of_the_share_and_at_least_the_minimum():
    assert capacity(10, 4, 1.0, 4) == 4
    assert capacity(100, 4, 1.25, 4) == 32
    assert capacity(9, 2, 1.0, 0) == 5


def test_top1_without_rts_keeps_the_first_tokens_and_counts_before_dropping():
    logits = logits_choosing([0, 0, 0, 0, 0, 0, 1, 1])
    r = gating.top1(logits, capacity_factor=1.0, min_capacity=0, use_rts=False)
    assert r.combine.shape == (8, 2, 4)  # capacity ceil(8 / 2 * 1.0)
    assert kept(r) == {0: [0, 1, 2, 3], 1: [6, 7]}
    assert r.exp_counts.tolist() == [6, 2] and r.exp_counts.device.type == "cpu"
    gates = torch.softmax(logits, dim=1)
    for s, e in ((0, 0), (3, 0), (6, 1)):
        assert r.combine[s, e].sum().item() == pytest.approx(gates[s, e].item())
    assert r.combine[4].sum() == 0 and r.combine[5].sum() == 0  # dropped: no output
    mask = torch.nn.functional.one_hot(logits.argmax(1), 2).float()
    expected = (gates.mean(0) * mask.mean(0)).sum() * 2
    assert r.l_aux.item() == pytest.approx(expected.item())


def test_top1_with_rts_keeps_the_tokens_of_the_highest_draws():
    logits = logits_choosing([0, 0, 0, 0, 0, 0, 1, 1])
    r = gating.top1(logits, 1.0, 0, use_rts=True, generator=torch.Generator().manual_seed(5))
    draws = torch.rand(8, 2, generator=torch.Generator().manual_seed(5))
    expected = sorted(sorted(range(6), key=lambda s: -draws[s, 0].item())[:4])
    assert sorted(kept(r)[0]) == expected and kept(r)[1] == [6, 7]
    again = gating.top1(logits, 1.0, 0, use_rts=True, generator=torch.Generator().manual_seed(5))
    assert torch.equal(r.combine, again.combine)  # the same draws, the same routing


def test_top1_dropless_sizes_the_buffers_by_the_fullest_expert():
    logits = logits_choosing([0, 0, 0, 0, 0, 0, 1, 1])
    r = gating.top1(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    assert r.combine.shape == (8, 2, 6) and kept(r) == {0: [0, 1, 2, 3, 4, 5], 1: [6, 7]}
    agreed = gating.top1(logits, 1.0, 0, drop_tokens=False, use_rts=False, agree=lambda c: 9)
    assert agreed.combine.shape == (8, 2, 9)  # another rank's fullest expert


def test_top1_used_token_leaves_tokens_out():
    logits = logits_choosing([0, 1, 0, 1])
    r = gating.top1(logits, 1.0, 0, used_token=torch.tensor([1, 1, 0, 1]), use_rts=False)
    assert kept(r) == {0: [0], 1: [1, 3]} and r.exp_counts.tolist() == [1, 2]


def test_top2_fills_first_choices_before_second_and_renormalises():
    torch.manual_seed(0)
    logits = torch.randn(6, 3)
    r = gating.top2(logits, capacity_factor=0.5, min_capacity=0, second_sampling=False)
    cap = capacity(6, 3, 1.0, 0)  # top-2 counts the factor twice
    assert r.combine.shape == (6, 3, cap)
    order = logits.argsort(dim=1, descending=True)
    first, second = order[:, 0], order[:, 1]
    assert r.exp_counts.tolist() == (torch.bincount(first, minlength=3)
                                     + torch.bincount(second, minlength=3)).tolist()
    for e in range(3):
        firsts = [s for s in range(6) if first[s] == e]
        seconds = [s for s in range(6) if second[s] == e]
        assert kept(r)[e] == (firsts + seconds)[:cap]  # every first choice before a second
    gates = torch.softmax(logits, dim=1)
    for s in range(6):
        both = [e for e in range(3) if r.dispatch[s, e].any()]
        if len(both) == 2:  # neither dropped: the two gates sum to one
            assert r.combine[s].sum().item() == pytest.approx(1.0)
            ratio = r.combine[s, first[s]].sum() / r.combine[s, second[s]].sum()
            assert ratio.item() == pytest.approx((gates[s, first[s]] / gates[s, second[s]]).item())
    me, ce = gates.mean(0), torch.nn.functional.one_hot(first, 3).float().mean(0)
    assert r.l_aux.item() == pytest.approx(((me * ce).mean() * 9).item())


def test_top2_dropless_keeps_every_token():
    torch.manual_seed(1)
    r = gating.top2(torch.randn(10, 4), 0.1, 0, drop_tokens=False, second_sampling=False)
    assert int(r.dispatch.sum()) == 20  # two experts for each of ten tokens


def test_moe_layer_arguments_are_checked_by_name():
    expert = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="num_experts 3 is not divisible by ep_size 2"):
        MoE(4, expert, num_experts=3, ep_size=2)
    with pytest.raises(NotImplementedError, match="k=3"):
        MoE(4, expert, num_experts=4, k=3)
    with pytest.raises(ValueError, match="noisy_gate_policy 'Gaussian'"):
        MoE(4, expert, num_experts=4, noisy_gate_policy="Gaussian")
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(4, expert, num_experts=4, use_tutel=True)
    with pytest.raises(ValueError, match="ep_size 3 does not divide the 4"):
        layout(4, 3)
    assert layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def test_a_layer_of_one_rank_runs_and_marks_its_experts():
    torch.manual_seed(0)
    moe = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2, use_residual=True,
              top2_2nd_expert_sampling=False)
    out, l_aux, counts = moe(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8) and l_aux.dim() == 0 and counts.sum().item() == 20
    experts = [p for p in moe.parameters() if is_moe_param(p)]
    assert len(experts) == 8 and {p.group_name for p in experts} == {"ep_size_1"}
    assert has_moe_layers(torch.nn.Sequential(moe)) == (True, 4)
    assert has_moe_layers(torch.nn.Linear(1, 1)) == (False, 0)
    assert list(moe.global_expert_ids) == [0, 1, 2, 3]


def test_optimizer_groups_split_expert_parameters_off():
    moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2)
    params = list(moe.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": params, "name": "parameters", "lr": 0.1}, max_group_size=20)
    dense, *expert = groups
    assert dense["name"] == "parameters" and not any(is_moe_param(p) for p in dense["params"])
    # each expert Linear(4, 4) is 16 + 4 elements: one expert per group of at most 20
    assert [len(g["params"]) for g in expert] == [2, 2]
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in expert)
    assert sum(len(g["params"]) for g in groups) == len(params)
    again = configure_moe_param_groups(groups)
    assert again is groups  # moe groups exist already
    with pytest.raises(TypeError, match="must be a list"):
        configure_moe_param_groups(tuple(params))


def test_an_expert_split_names_the_expert_in_the_unsplit_model():
    from shardtrain.layout import ExpertSplit
    split = ExpertSplit(index=1, num_local=2, ep_size=4, ep_rank=3)
    assert split.global_name("blocks.0.moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight") \
        == "blocks.0.moe.deepspeed_moe.experts.deepspeed_experts.7.0.weight"
    assert [split.global_name("m.deepspeed_experts.1.w", r) for r in range(4)] == \
        ["m.deepspeed_experts.1.w", "m.deepspeed_experts.3.w", "m.deepspeed_experts.5.w",
         "m.deepspeed_experts.7.w"]
    with pytest.raises(ValueError, match="not the name of local expert 1"):
        split.global_name("m.deepspeed_experts.0.w")


def test_deepspeeds_gating_functions_return_its_tuple():
    """deepspeed.moe.sharded_moe's top1gating/top2gating: (l_aux, combine_weights,
    dispatch_mask, exp_counts) of the same rules, dropless too (one process: no group)."""
    from shardtrain.deepspeed.moe.sharded_moe import top1gating, top2gating
    torch.manual_seed(2)
    logits = torch.randn(12, 4)
    got = top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False)
    want = gating.top1(logits, 1.0, 0, drop_tokens=False, use_rts=False).as_tuple()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    want = gating.top2(logits, 1.0, 0, second_sampling=False).as_tuple()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
