"""The engine as DeepSpeed's clients use it, over 2 real processes at ZeRO stages 0-3
(the cases are in ``cases_compat.py``)."""
from __future__ import annotations

import pytest
import torch

import cases_compat as cc
import cases_engine as ce
from _dist import result, run_ranks

WORLD = 2


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"stage{s}")
def run(request):
    stage = request.param
    return WORLD, run_ranks("cases_compat:run_all", WORLD, timeout=300, stage=stage), stage


def reference_params(world: int):
    data = ce.make_data(cc.STEPS, cc.GAS, world, cc.MICRO)
    return ce.reference(ce.make_model(), data, ce.adamw)["params"]


def test_in_place_arithmetic_on_the_loss_then_a_plain_backward(run):
    world, _, _ = run
    ref = reference_params(world)
    for rank in range(world):
        got = result(run, "in_place", rank)
        for precision, tol in (("fp32", 1e-6), ("bf16", 0.0), ("fp16", 0.0)):
            engine, plain = got[precision]["engine"], got[precision]["plain_in_place"]
            for name in engine:  # the two paths give the same weights
                torch.testing.assert_close(plain[name], engine[name], atol=tol, rtol=tol)
        for name, value in ref.items():  # and fp32 is single-process training
            torch.testing.assert_close(got["fp32"]["plain_in_place"][name], value, atol=1e-5, rtol=1e-5)


def test_safe_get_full_and_safe_set_full(run):
    world, _, stage = run
    ref_grads = result(run, "safe")["ref_grads"]
    for rank in range(world):
        got = result(run, "safe", rank)
        for precision, tol in (("fp32", 1e-6), ("bf16", 2e-2)):
            g = got[precision]
            assert "micro-step 0 is not a boundary" in g["mid_error"]
            for name, grad in ref_grads.items():
                torch.testing.assert_close(g["grads"][name].float(), grad, atol=tol, rtol=tol)
            # the step used the zeroed gradient: a fresh AdamW leaves the weight where it was
            torch.testing.assert_close(g["after_step"]["mid.weight"], g["fp32"]["mid.weight"])
            assert not torch.equal(g["after_step"]["fc1.weight"], g["fp32"]["fc1.weight"])
            assert torch.count_nonzero(g["exp_avg"]["mid.weight"]) == 0
            torch.testing.assert_close(g["exp_avg"]["fc1.weight"], 0.1 * ref_grads["fc1.weight"],
                                       atol=tol, rtol=tol)  # AdamW's first moment after one step
            assert torch.all(g["set_fp32"] == 0.25)
            assert g["unknown"] is None
    # the local slices: whole on every rank at stage 0, split across ranks at stages 1-3
    sizes = [result(run, "safe", r)["fp32"]["local"]["fc1.weight"] for r in range(world)]
    numel = ref_grads["fc1.weight"].numel()
    assert sizes == ([numel] * world if stage == 0 else [numel // world] * world)


def test_deepspeed_comm_passes_through_to_torch_distributed(run):
    world, _, stage = run
    if stage != 0:
        return
    for rank in range(world):
        got = result(run, "comm", rank)
        assert (got["rank"], got["world"]) == (rank, world)
        assert got["all_gather"] == got["all_gather_into_tensor"] == list(map(float, range(world)))
        assert got["broadcast"] == world - 1 + 10.0
        assert got["all_reduce"] == sum(range(1, world + 1))
        assert got["avg"] == sum(range(1, world + 1)) / world
        assert got["reduce_scatter_tensor"] == world * rank
        assert got["group"] == (rank, world, list(range(world))) and got["initialized"]


def test_the_engine_as_deepspeed_clients_read_it(run):
    world, _, stage = run
    got = result(run, "surface")
    assert got["steps_per_print"] is None  # Infinity: never
    assert got["config_get"] == (stage, cc.MICRO, True, "dflt")
    assert got["getters"] == ((cc.MICRO * cc.GAS * world, cc.MICRO, cc.GAS), stage > 0, False,
                              False, 0.0, False)
    assert got["passthrough"] == (True, "Linear")
    assert "no attribute 'no_such_attribute'" in got["missing"]
    if stage < 2:
        assert "already active" in got["nested"]
    assert got["flags_initial"] == (False, 1.0, 1.0)


def test_fp16_overflow_shows_on_the_optimizer(run):
    world, _, _ = run
    for rank in range(world):
        seen = result(run, "fp16_flags", rank)["seen"]
        (o1, cur1, ls1, applied1), (o2, cur2, ls2, applied2) = seen
        assert o1 is True and not applied1 and cur1 == ls1 == 8.0  # halved from 2^4
        assert o2 is False and applied2 and cur2 == ls2 == 8.0


def test_destroy_then_a_new_engine_trains_as_the_reference(run):
    world, _, _ = run
    ref = reference_params(world)
    for rank in range(world):
        # every hook the engine installed (gradient, module and load hooks, stage 3's
        # attribute classes) is gone from the model
        assert result(run, "destroy", rank)["leftover"] == {
            "module_hooks": 0, "grad_hooks": 0, "load_hooks": 0, "swapped_classes": []}
        after = result(run, "destroy", rank)["after"]
        for name, value in ref.items():
            torch.testing.assert_close(after[name], value, atol=1e-5, rtol=1e-5)


def test_empty_partition_cache_and_the_consolidated_state_dict(run):
    world, _, stage = run
    if stage != 3:
        return
    for rank in range(world):
        got = result(run, "partition_cache", rank)
        assert got["count"] > 0 and got["before"] == got["count"] and got["after"] == 0
        assert (got["state"] is None) == (rank != 0)
    assert "fc1.weight" in result(run, "partition_cache", 0)["state"]
