"""Full weights at ZeRO stage 3 in bounded memory, and asynchronous saves, over real processes
(cases in ``cases_weights.py``)."""
from __future__ import annotations

import os

import pytest
import torch

import cases_weights as cw
from _dist import RanksFailed, result, run_ranks

WORLD = 2
FULL = cw.LAYERS * cw.LAYER_BYTES


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def saves(request):
    return WORLD, run_ranks("cases_weights:bounded_saves", WORLD, timeout=180,
                            precision=request.param), request.param


def _close(got, expected, dtype):
    for name, value in expected.items():
        torch.testing.assert_close(got[name].float(), value.to(dtype).float(), atol=0, rtol=0)


def _layer(precision: str) -> int:
    """One layer's full weight and bias, in the module's dtype."""
    return cw.LAYER_BYTES // (2 if precision == "bf16" else 1)


def test_save_16bit_model_writes_the_weights_gathering_one_layer_at_a_time(saves):
    _, _, precision = saves
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    _close(result(saves, "saved", 0), result(saves, "expected", 0), dtype)
    for rank in range(WORLD):
        got = result(saves, "save_measure", rank)
        assert got["gathered"] <= _layer(precision), (rank, got)  # never two layers at once
    # (the growth of resident memory is reported by benchmarks/bench_weights.py: it depends on
    # what the allocator kept from before, too much to assert here)


def test_the_consolidated_state_dict_is_rank_0s_gathering_one_layer_at_a_time(saves):
    _, _, precision = saves
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    _close(result(saves, "consolidated", 0), result(saves, "expected", 0), dtype)
    assert result(saves, "consolidated", 1) is None
    measured = [result(saves, "consolidated_measure", rank) for rank in range(WORLD)]
    assert all(m["gathered"] <= _layer(precision) for m in measured), measured


def test_state_dict_gives_every_rank_the_full_weights_on_the_host(saves):
    _, _, precision = saves
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for rank in range(WORLD):
        _close(result(saves, "state_dict", rank), result(saves, "expected", rank), dtype)
        _close(result(saves, "every_rank", rank), result(saves, "expected", rank), dtype)
        assert result(saves, "state_dict_devices", rank) == ["cpu"]
        assert result(saves, "state_dict_measure", rank)["gathered"] <= _layer(precision)


@pytest.fixture(scope="module", params=[0, 1, 3])
def asynchronous(request):
    return WORLD, run_ranks("cases_weights:async_saves", WORLD, timeout=180,
                            stage=request.param), request.param


def test_an_asynchronous_save_writes_what_a_synchronous_one_does(asynchronous):
    for rank in range(WORLD):
        assert result(asynchronous, "same_contents", rank)
        assert result(asynchronous, "latest", rank) == "t"


def test_training_goes_on_and_a_load_resumes_exactly(asynchronous):
    for rank in range(WORLD):
        got = result(asynchronous, "resumed", rank)
        assert result(asynchronous, "loaded_equals_state_at_save", rank)
        torch.testing.assert_close(got, result(asynchronous, "continued", rank), atol=0, rtol=0)


def test_a_rank_killed_during_an_asynchronous_write_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(RanksFailed):
        run_ranks("cases_weights:async_kill", WORLD, timeout=120, root=str(root))
    assert (root / "latest").read_text() == "good"
    assert not (root / "bad").exists()
    for tmp in [e for e in os.listdir(root) if e.startswith("bad.tmp-")]:
        assert "meta.json" not in os.listdir(root / tmp)
    got = run_ranks("cases_weights:resume_after_kill", WORLD, timeout=120, root=str(root))
    for rank in range(WORLD):
        assert got[rank]["global_steps"] == 2
        assert got[rank]["path"].endswith("good")
