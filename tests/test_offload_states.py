"""``engine.offload_states()``/``reload_states()`` over 2 ranks (one process group runs every case
of ``cases_offload_states``): each kind frees what it names, the engine's model-state bytes
drop to what is left, training afterwards equals a run without the offload bit for bit, and
what needs the states away is refused by name."""
from __future__ import annotations

import pytest
import torch

import cases_offload_states as co
from _dist import result, run_ranks

WORLD = 2
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="module")
def run():
    return None, run_ranks("cases_offload_states:all_cases", WORLD, timeout=240)


def _get(run, stage, precision, include, rank):
    return result(run, f"s{stage}-{precision}-{include}", rank)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_training_after_a_reload_equals_training_without_the_offload(run, stage, precision):
    for rank in range(WORLD):
        plain = _get(run, stage, precision, "never", rank)
        for include in (None, *co.KINDS):
            got = _get(run, stage, precision, include, rank)
            assert got["reloaded"] == got["before"], (include, rank)
            assert got["same_objects"], (include, rank)
            assert got["losses"] == plain["losses"], (include, rank)
            for a, b in zip(got["weights"], plain["weights"]):
                assert torch.equal(a, b), (include, rank)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_offloading_everything_leaves_no_model_state_on_the_device(run, stage, precision):
    for rank in range(WORLD):
        got = _get(run, stage, precision, None, rank)
        assert got["before"]["total"] > 0
        assert got["after"]["total"] == 0, got["after"]
        kinds = set(co.KINDS) - ({"hp_params"} if precision == "fp32" else set())
        assert got["away"] == sorted(kinds - ({"contiguous_grad_buffer"} if stage > 1 else set()))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_each_kind_frees_its_own_bytes(run, stage, precision):
    """optim_states: the optimizer's; lp_grads: the gradients'; hp_params in bf16: the fp32
    masters' (in fp32 training there are none: nothing moves); lp_params: the parameters'."""
    for rank in range(WORLD):
        states = _get(run, stage, precision, "optim_states", rank)
        assert states["after"]["optimizer"] == 0 < states["before"]["optimizer"]
        assert states["after"]["params"] == states["before"]["params"]
        grads = _get(run, stage, precision, "lp_grads", rank)
        assert grads["after"]["grads"] == 0 < grads["before"]["grads"]
        assert grads["after"]["optimizer"] == grads["before"]["optimizer"]
        masters = _get(run, stage, precision, "hp_params", rank)
        assert masters["after"]["params"] == masters["before"]["params"]
        if precision == "bf16":
            assert masters["after"]["master"] == 0 < masters["before"]["master"]
            assert masters["away"] == ["hp_params"]
        else:  # no copies: the optimizer updates the parameters themselves
            assert masters["after"] == masters["before"] and masters["away"] == []
        params = _get(run, stage, precision, "lp_params", rank)
        assert params["after"]["params"] == 0 < params["before"]["params"]


def test_a_forward_without_gradients_runs_while_optimizer_states_are_away(run):
    for stage in STAGES:
        for rank in range(WORLD):
            plain = _get(run, stage, "bf16", "never", rank)["eval"]
            for include in ("optim_states", "lp_grads", "hp_params"):
                got = _get(run, stage, "bf16", include, rank)
                assert got["eval"] == plain and "forward" not in got["refused"], include


@pytest.mark.parametrize("stage", STAGES)
def test_what_needs_the_states_is_refused_while_they_are_away(run, stage):
    refused = _get(run, stage, "fp32", None, 0)["refused"]
    for call in ("forward", "step", "zero_grad", "save_checkpoint"):
        assert f"engine.{call}()" in refused[call], (call, refused[call])
        assert "engine.reload_states() first" in refused[call]
    assert "lp_params" in refused["forward"]
    step = _get(run, stage, "bf16", "optim_states", 0)["refused"]["step"]
    assert "optim_states" in step and "lp_params" not in step


def test_bad_arguments_are_named(run):
    got = result(run, "bad_arguments", 0)
    assert "'weights'" in got["kind"] and "optim_states" in got["kind"]
    assert "'nvme'" in got["nvme"] and "device='cpu'" in got["nvme"]
    assert got["none_moved"] == []
    assert got["after_destroy"] == result(run, "bad_arguments", 1)["after_destroy"] != 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_memory_falls_by_the_bytes_moved_on_cuda():
    world = min(torch.cuda.device_count(), 2)
    got = run_ranks("cases_offload_states:case_cuda_memory", world, timeout=180,
                    env={"SHARDTRAIN_ACCELERATOR": "cuda"})
    for rank in range(world):
        r = got[rank]
        # the caching allocator rounds each block up to 512 bytes
        assert r["before"] - r["away"] >= r["counted"], r
        assert r["after"] == r["before"], r
