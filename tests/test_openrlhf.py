"""OpenRLHF's DeepSpeed strategy (read from OpenRLHF 0.11.2) on 2 CPU ranks, through the
``deepspeed`` alias; one process group runs every case of ``cases_openrlhf``."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install transformers (the hf extra)")

import cases_openrlhf as co  # noqa: E402
from _dist import result, run_ranks  # noqa: E402

WORLD = 2
ATOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("openrlhf")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return root, run_ranks("cases_openrlhf:all_cases", WORLD, timeout=240, env=env,
                           root=str(root))


@pytest.fixture(scope="module")
def ref():
    return co.reference(WORLD)


def test_the_version_read_is_named():
    assert co.OPENRLHF_VERSION == "0.11.2"


@pytest.mark.parametrize("stage", [3, 1, 2])
def test_openrlhf_config_trains_exactly(run, ref, stage):
    for rank in range(WORLD):
        got = result(run, f"train{stage}", rank)
        expected = [losses[rank] for losses in ref["losses"]]
        assert got["losses"] == pytest.approx(expected, abs=ATOL), (stage, rank)
        assert got["norms"] == pytest.approx(ref["norms"], abs=ATOL), (stage, rank)


@pytest.mark.parametrize("stage", [3, 1, 2])
def test_load_ckpt_resumes_exactly(run, ref, stage):
    for rank in range(WORLD):
        got = result(run, f"train{stage}", rank)
        assert got["client_state"] == 4
        assert got["resumed"]["losses"] == pytest.approx([ref["losses"][-1][rank]], abs=ATOL)
        assert got["resumed"]["losses"] == pytest.approx(got["losses"][-1:], abs=ATOL)


@pytest.mark.parametrize("stage", [3, 1, 2])
def test_save_model_writes_what_from_pretrained_loads(run, ref, stage):
    root, _ = run
    saved = [result(run, f"train{stage}", rank)["saved"] for rank in range(WORLD)]
    assert saved == ([True, False] if stage == 3 else [True, True])
    # rank 0 read state_dict() alone: local, partitioned parameters as placeholders (stage 3)
    empty = result(run, f"train{stage}", 0)["placeholders"]
    assert empty == (sorted(ref["state"]) if stage == 3 else [])
    from transformers import LlamaForCausalLM
    loaded = LlamaForCausalLM.from_pretrained(root / f"hf{stage}")
    state = loaded.state_dict()
    assert set(state) == set(ref["state"])
    for name, value in ref["state"].items():
        torch.testing.assert_close(state[name], value, atol=ATOL, rtol=0)


@pytest.mark.parametrize("stage", [3, 1, 2])
def test_offloaded_states_between_steps_train_exactly(run, ref, stage):
    """OpenRLHF's offload_deepspeed_states after each step, a forward without gradients while
    the states are away, reload_deepspeed_states before the next step: the losses and norms
    of a run without the offload; the model states left on the device are the 16-bit
    parameters alone."""
    for rank in range(WORLD):
        got = result(run, f"sleep{stage}", rank)
        assert got["losses"] == pytest.approx([s[rank] for s in ref["losses"]], abs=ATOL)
        assert got["norms"] == pytest.approx(ref["norms"], abs=ATOL)
        plain = result(run, f"train{stage}", rank)
        assert got["losses"] == pytest.approx(plain["losses"], abs=1e-7)
        # fp32: no master copies; stages 2-3 keep no flat buffer between backward passes
        kinds = ["contiguous_grad_buffer", "lp_grads", "optim_states"][(stage > 1):]
        assert got["away"] == [kinds] * 3
        params = sum(v.numel() * 4 for v in ref["state"].values()) // (WORLD if stage == 3 else 1)
        for before, after in got["bytes"]:
            assert before > after >= params  # only the parameters stay
        assert len(set(got["logprob_sums"])) == 3  # the weights changed between steps


def test_training_while_states_are_offloaded_is_named(run):
    """The first call that needs what is away says so: backward needs the gradients."""
    for stage in (3, 1, 2):
        reason = result(run, f"sleep{stage}", 0)["refused"]
        assert reason.startswith("engine.backward() needs "), reason
        assert "lp_grads" in reason and "optim_states" not in reason
        assert "engine.reload_states() first" in reason


@pytest.mark.parametrize("stage", [1, 2])
def test_consolidated_state_dict_is_refused_where_weights_are_whole(run, stage):
    reason = result(run, f"train{stage}", 0)["consolidated_refused"]
    assert f"at stage {stage}" in reason and "module.state_dict()" in reason


def test_state_dict_on_rank_0_alone_inside_gathered_parameters(run, ref):
    got = result(run, "gathered_state_dict", 0)
    assert got["to_fetch"] == got["params"]  # every parameter is partitioned
    assert got["shapes"] == {k: list(v.shape) for k, v in ref["state"].items()}
    assert result(run, "gathered_state_dict", 1)["shapes"] == {}
    for rank in range(WORLD):
        got = result(run, "gathered_state_dict", rank)
        assert got["full"] == sorted(ref["state"])
        assert set(map(tuple, got["outside"].values())) == {(0,)}  # DeepSpeed's placeholders
        assert got["gathered"] == {k: list(v.shape) for k, v in ref["state"].items()}


def test_deepcompile_says_so_once_on_rank_0_until_compile_then_trains_exactly(run, ref):
    for rank in range(WORLD):
        got = result(run, "deepcompile", rank)
        assert got["losses"] == pytest.approx([step[rank] for step in ref["losses"]], abs=ATOL)
        assert got["norms"] == pytest.approx(ref["norms"], abs=ATOL)
        assert (got["before"], got["enabled"], got["active"], got["is_compiled"]) == \
            (False, True, True, True)
        assert got["events"] == [(0, ["z3"])]  # the default schedule, before its warm-up ends
    assert result(run, "deepcompile", 0)["messages"] == 1
    assert result(run, "deepcompile", 1)["messages"] == 0


def test_every_deepcompile_key_is_accepted_and_the_eval_config_runs(run):
    for rank in range(WORLD):
        got = result(run, "compile_keys", rank)
        assert got["enabled"] is False
        assert got["eval_loss"] > 0
