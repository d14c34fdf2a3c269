"""Checkpoints on a CUDA device (NCCL): exact resume with the device RNG, and a CUDA
checkpoint read back on the CPU. Gated by the ``cuda`` marker (``make test-cuda``)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import cases_engine as ce
from _dist import run_ranks
from shardtrain.checkpoint import consolidate

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-checkpoints")
    world = min(torch.cuda.device_count(), 2)
    out = run_ranks("cases_checkpoint:cuda_round_trip", world, timeout=300,
                    env={"SHARDTRAIN_ACCELERATOR": "cuda"}, root=str(root))
    return root, world, out


@pytest.mark.parametrize("name", ["fp32-s1", "bf16-s1", "fp16-s2"])
def test_cuda_resume_is_bit_exact(cuda_runs, name):
    _, world, out = cuda_runs
    for rank in range(world):
        want, got = out[rank][name]["want"], out[rank][name]["got"]
        assert "error" not in got, got.get("error")
        assert torch.equal(got["losses"], want["losses"])
        for key in want["params"]:
            assert torch.equal(got["params"][key], want["params"][key]), key
        assert got["draws"] == want["draws"]  # python, numpy, torch CPU and CUDA RNGs


def test_cuda_checkpoint_consolidates_on_the_cpu(cuda_runs, tmp_path):
    root, world, _ = cuda_runs
    weights = load_file(consolidate(str(root / f"cuda-w{world}-fp32-s1"),
                                    str(tmp_path / "m.safetensors")))
    model = ce.make_model()
    model.load_state_dict(weights)
    assert all(v.device.type == "cpu" for v in weights.values())
    assert set(weights) == set(ce.make_model().state_dict())
