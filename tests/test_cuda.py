"""The engine on a CUDA device (NCCL), against the CPU reference.

Gated by the ``cuda`` marker: these run only where torch sees a GPU (``make test-cuda``);
the CPU lane runs everything else.
"""
from __future__ import annotations

import pytest
import torch

import cases_engine as ce
from _dist import run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = ["plain", "accum_engine_backward", "accum_plain_backward", "accum3_both_paths",
         "clipping", "frozen", "unused", "tied_gpt", "bf16_vs_fp32", "fp16_static",
         "counters", "client_objects", "offload", "offload_memory"]


@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=lambda s: f"stage{s}")
def results(request):
    world = min(torch.cuda.device_count(), 2)
    out = run_ranks("cases_engine:run_all", world, timeout=300,
                    env={"SHARDTRAIN_ACCELERATOR": "cuda"}, only=CASES, stage=request.param)
    return world, out, request.param


def get(results, name):
    value = results[1][0][name]
    if "error" in value:
        pytest.fail(value["error"])
    return value


def close(got, want, atol=1e-4):
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name,gas,steps,micro", [
    ("plain", 1, 4, 5), ("accum_engine_backward", 4, 3, 3), ("accum_plain_backward", 4, 3, 3)])
def test_fp32_parity_on_cuda(results, name, gas, steps, micro):
    world = results[0]
    ref = ce.reference(ce.make_model(), ce.make_data(steps, gas, world, micro), ce.adamw)
    close(get(results, name)["params"], ref["params"])


def test_clipping_on_cuda(results):
    world = results[0]
    ref = ce.reference(ce.make_model(), ce.make_data(4, 2, world, 3),
                       lambda p: torch.optim.SGD(p, lr=2.0), clip=0.05)
    close(get(results, "clipping")["params"], ref["params"])


def test_both_backward_paths_identical_on_cuda(results):
    assert get(results, "accum3_both_paths")["same"]


def test_frozen_unused_tied_on_cuda(results):
    world = results[0]
    for name, kw in (("frozen", {"frozen": True}), ("unused", {"unused": True})):
        ref = ce.reference(ce.make_model(**kw), ce.make_data(3, 1, world, 4), ce.adamw)
        close(get(results, name)["params"], ref["params"])
    assert get(results, "tied_gpt")["tied"]


def test_mixed_precision_on_cuda(results):
    got = get(results, "bf16_vs_fp32")
    assert got["param_dtypes"] == {"torch.bfloat16"}
    fp32, bf16 = got["fp32"].flatten(), got["bf16"].flatten()
    assert abs(bf16[-5:].mean() - fp32[-5:].mean()) < 0.05 * fp32[-5:].mean()
    assert get(results, "fp16_static")["applied"] == [True] * 3


def test_offload_on_cuda(results):
    world, _, stage = results
    got = get(results, "offload")
    if stage == 0:
        assert "needs ZeRO stage" in got["refused"]
        return
    ref = ce.reference(ce.make_model(), ce.make_data(3, 2, world, 3), ce.adamw, clip=1.0)
    close(got["fp32"]["params"], ref["params"])
    assert got["fp32"]["host_states"]


def test_offload_moves_optimizer_bytes_off_the_device(results):
    """fp32 AdamW: the offloaded states (8 bytes per parameter) and the fp32 copies the
    optimizer steps (4) leave the device: at least 8 bytes per parameter of this rank's
    shard come off."""
    world, _, stage = results
    got = get(results, "offload_memory")
    if got.get("skipped"):
        assert stage == 0
        return
    saved = got[False] - got[True]
    assert saved >= 0.9 * 8 * got["numel"] / world, (got, saved)
