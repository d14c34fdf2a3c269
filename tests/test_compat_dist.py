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
            if stage < 2:  # this rank's gradient so far: its first micro-batch's, over GAS
                want = result(run, "no_sync", rank)["refs"][0]["fc1.weight"]
                torch.testing.assert_close(g["mid"], want, atol=tol, rtol=tol)
                lo = 0 if stage == 0 else rank * want.numel() // world
                assert torch.equal(g["mid_local"], g["mid"].reshape(-1)[lo: lo + g["mid_local"].numel()])
                assert g["mid_local"].numel() == want.numel() // (1 if stage == 0 else world)
            else:
                name, runtime, message = g["mid_error"]
                assert name == "GradientsUnavailableError" and runtime
                assert f"not kept at ZeRO stage {stage}" in message
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


def test_safe_get_full_grad_inside_several_no_sync_blocks(run):
    """DeepSpeed's test_multiple_ctxts: each backward inside no_sync() is followed by
    safe_get_full_grad, which gives this rank's gradient accumulated so far (no average:
    the ranks differ); zero_grad() and the same batches again give the same values."""
    world, _, stage = run
    for rank in range(world):
        got = result(run, "no_sync", rank)
        if stage >= 2:
            name, runtime, message = got["refused"]
            assert name == "StepOrderError" and runtime
            assert f"no_sync() is not available at ZeRO stage {stage}" in message
            continue
        first, second = got["rounds"]
        for k, ref in enumerate(got["refs"]):
            for n, grad in ref.items():
                torch.testing.assert_close(first[k][n], grad, atol=1e-6, rtol=1e-6)
                assert torch.equal(first[k][n], second[k][n])
        for what, text in (("step", "step() was called inside engine.no_sync()"),
                           ("nested", "no_sync() is already active")):
            name, runtime, message = got[what]
            assert name == "StepOrderError" and runtime and text in message
    if stage < 2:  # each rank's own gradient: they differ
        grads = [result(run, "no_sync", r)["rounds"][0][0]["fc1.weight"] for r in range(world)]
        assert not torch.equal(grads[0], grads[1])


def test_unused_parameters_raise_when_not_ignored(run):
    world, _, stage = run
    for rank in range(world):
        got = result(run, "unused", rank)
        for case in ("strict", "one_rank")[:1 if stage == 3 else 2]:  # `spare` is never
            # used; `mid` on one rank only (not at stage 3: every rank runs every module)
            name, runtime, message = got[case]["error"]
            assert name == "UnusedParametersError" and runtime, got[case]
            assert "['spare.weight', 'spare.bias'] got no gradient on any rank" in message
            assert "ignore_unused_parameters" in message and got[case]["steps"] == 0
        assert got["default"] == {"steps": 1, "error": None}


def test_one_cycle_momentum_as_deepspeed_reads_it(run):
    """get_mom() follows the cycle (cycle_max_mom before the first step, as DeepSpeed's),
    the optimizer's beta1 starts at cycle_min_mom and agrees from the first step on; the
    values are DeepSpeed 0.19.8's for the same schedule."""
    world, _, stage = run
    if stage != 0:
        return
    want_mom = [0.09, 0.0875, 0.085, 0.0825, 0.08, 0.0825, 0.085, 0.0875, 0.09, 0.0900225,
                0.090045, 0.0900675]
    for rank in range(world):
        rows = result(run, "one_cycle", rank)["rows"]
        assert [m[0][0] for m, _ in rows] == pytest.approx(want_mom, rel=1e-12)
        assert [b[0][0] for _, b in rows] == pytest.approx([0.08] + want_mom[1:], rel=1e-12)
        assert all(m[0][1] == b[0][1] == 0.99 for m, b in rows)


def test_checkpoint_tag_validation(run):
    world, _, stage = run
    if stage != 0:
        return
    for rank in range(world):
        got = result(run, "tag_validation", rank)
        name, is_value_error, message = got["Fail"]["error"]
        assert name == "CheckpointTagError" and is_value_error
        assert "ranks passed different tags ['tag-of-rank-0', 'tag-of-rank-1']" in message
        assert got["Fail"]["written"] == []
        assert got["Warn"]["error"] is None and "tag-of-rank-0" in got["Warn"]["written"]
