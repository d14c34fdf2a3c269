"""Profiling and monitors on a CUDA device: the allocator-peak activation measure, FLOPs of a
backward that autograd runs on its device thread, allocator-based memory per step, and the
autotuner's profile and trials. Gated by the ``cuda`` marker (``make test-cuda``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain import profiling

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "autotune_mlp.py"


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()


def test_activation_memory_from_the_allocator_peak():
    model = mlp()
    sizes = {}
    for batch in (64, 128):
        x = torch.randn(batch, 256, device="cuda")
        out, mem = profiling.measure_activation_memory(lambda x=x: model(x), model)
        out.sum().backward()
        assert mem.method == "cuda_peak" and mem.saved_bytes == batch * (256 + 1024) * 4
        assert mem.bytes >= batch * (1024 + 256) * 4  # hidden and output, at least
        sizes[batch] = mem.bytes
    assert sizes[128] > sizes[64]


def test_flops_of_backward_on_the_device_thread():
    model = mlp()
    profiler = profiling.FlopsProfiler(model)
    with profiler:
        with profiler.forward():
            loss = model(torch.randn(32, 256, device="cuda")).sum()
        loss.backward()
    p = profiler.result()
    layers = 2 * 32 * (256 * 1024 + 1024 * 256)
    assert p.forward_flops == layers
    assert p.backward_flops == layers + 2 * 32 * 1024 * 256  # + the second layer's input gradient


def test_monitor_memory_comes_from_the_allocator(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 64, "optimizer": {"type": "AdamW"}, "wall_clock_breakdown": True,
              "jsonl_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "cuda"}}
    engine, *_ = shardtrain.initialize(model=mlp(), config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(64, 256, device="cuda")).pow(2).mean())
        engine.step()
    engine.monitor.close()
    rows = [json.loads(line) for line in (tmp_path / "cuda" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["memory_peak"][0] > r["memory_allocated"][0] > 0 for r in rows)
    assert all(r["time_ms"]["forward"] > 0 and r["time_ms"]["optimizer"] > 0 for r in rows)


def test_autotune_on_the_device(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
                                  "autotuning": {"start_profile_step": 1, "end_profile_step": 3,
                                                 "num_tuning_micro_batch_sizes": 2}}))
    status = profiling.autotune_main([str(SCRIPT), "--config", str(config), "--memory-budget", "1GiB",
                                      "--stages", "0", "--timeout", "240"])
    assert status == 0
    info = json.loads((tmp_path / "autotuning_results" / "profile_model_info" / "model_info.json").read_text())
    assert info["activation_method"] == "cuda_peak" and info["device_memory"] > 0
    best = json.loads((tmp_path / "autotuning_results" / "best_config.json").read_text())
    assert best["train_micro_batch_size_per_gpu"] >= 1
