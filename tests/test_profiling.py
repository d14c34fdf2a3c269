"""Profiling: activation memory, FLOPs, timers, the model-info profile, trials and the autotuner."""
from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
import torch

import shardtrain
from shardtrain import profiling
from shardtrain.autotune import search
from shardtrain.profiling import (FlopsProfiler, SavedTensorMeter, Timers, Trial, measure_activation_memory,
                                  parse_size, stage_fits)

IN, HIDDEN, OUT = 16, 64, 4
SCRIPT = Path(__file__).resolve().parent / "scripts" / "autotune_mlp.py"


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))


def analytic_activation_bytes(batch: int) -> int:
    # The first Linear saves its input (for its weight gradient); the ReLU saves its output,
    # which the second Linear saves as its input too (one tensor). Weights are not activations.
    return batch * (IN + HIDDEN) * 4


# ---------------------------------------------------------------------------- activation memory


def test_saved_tensor_bytes_match_the_analytic_size_and_grow_linearly():
    model = mlp()
    sizes = {}
    for batch in (1, 2, 4, 8, 16):
        with SavedTensorMeter(model) as meter:
            model(torch.randn(batch, IN)).sum().backward()
        sizes[batch] = meter.bytes
        assert meter.bytes == analytic_activation_bytes(batch)
    assert all(sizes[batch] == batch * sizes[1] for batch in sizes)  # linear, no fixed part


def test_a_sliced_batch_costs_its_slice_and_parameters_never_count():
    model = mlp()
    data = torch.randn(1000, IN)
    with SavedTensorMeter(model) as meter:
        model(data[200:208])
    assert meter.bytes == analytic_activation_bytes(8)
    frozen_input = torch.randn(8, IN, requires_grad=True)
    with SavedTensorMeter(model) as meter:
        model(frozen_input)  # the input needs a gradient: the first weight is saved too
    assert meter.bytes == analytic_activation_bytes(8)


def test_measure_activation_memory_on_cpu_returns_the_output():
    model = mlp()
    out, mem = measure_activation_memory(lambda: model(torch.randn(4, IN)), model)
    assert mem.method == "saved_tensors" and mem.bytes == mem.saved_bytes == analytic_activation_bytes(4)
    out.sum().backward()
    assert model[0].weight.grad is not None


# ---------------------------------------------------------------------------- FLOPs and timers


def test_flops_of_a_linear_layer_are_analytic():
    batch, n_in, n_out = 8, 32, 16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n_in, n_out))
    profiler = FlopsProfiler(model)
    with profiler:
        with profiler.forward():
            loss = model(torch.randn(batch, n_in)).sum()
        loss.backward()
    p = profiler.result()
    assert p.forward_flops == 2 * batch * n_in * n_out
    assert p.backward_flops == 2 * batch * n_in * n_out  # weight gradient only: x needs none
    assert p.params == n_in * n_out + n_out
    layer = next(m for m in p.modules if m.name == "0")
    assert layer.forward_flops == p.forward_flops and layer.depth == 1 and layer.forward_latency_s > 0
    table = p.table(module_depth=-1, top_modules=1)
    assert "8.19 K" in table and "depth 1: 0" in table


def test_timers_add_up_and_reset():
    timers = Timers()
    with timers.time("forward"):
        time.sleep(0.02)
    timers.start("backward")
    timers.start("backward")  # already running: ignored
    time.sleep(0.01)
    timers.stop("backward")
    timers.stop("backward")   # not running: ignored
    times = timers.read()
    assert 15 < times["forward"] < 1000 and 5 < times["backward"] < 1000
    assert timers.read() == {}


def test_peak_flops_from_the_environment(monkeypatch):
    monkeypatch.delenv(profiling.PEAK_TFLOPS_ENV, raising=False)
    assert profiling.peak_flops(torch.bfloat16) is None  # a CPU: unknown
    monkeypatch.setenv(profiling.PEAK_TFLOPS_ENV, "312")
    assert profiling.peak_flops(torch.bfloat16) == 312e12
    monkeypatch.setenv(profiling.PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="TFLOP/s"):
        profiling.peak_flops()


def train(engine, steps: int, batch: int, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        engine.backward(engine(torch.randn(batch, IN)).pow(2).mean())
        engine.step()


def test_engine_timers_and_flops_profile(tmp_path, records, monkeypatch):
    monkeypatch.setenv(profiling.PEAK_TFLOPS_ENV, "1")
    batch = 4
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "wall_clock_breakdown": True, "memory_breakdown": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(tmp_path / "flops.txt")},
              "jsonl_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    engine, *_ = shardtrain.initialize(model=mlp(), config=config)
    train(engine, 4, batch)
    engine.monitor.close()
    # FLOPs of one step: two micro-batches, each forward 2*B*(IN*HIDDEN + HIDDEN*OUT); backward
    # the weight gradients of both layers and the input gradient of the second.
    forward = 2 * 2 * batch * (IN * HIDDEN + HIDDEN * OUT)
    backward = 2 * 2 * batch * (IN * HIDDEN + 2 * HIDDEN * OUT)
    report = (tmp_path / "flops.txt").read_text()
    assert f"forward FLOPs       {forward:,}" in report and f"backward FLOPs      {backward:,}" in report
    assert engine.monitor.flops_per_step == forward + backward
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(row["time_ms"]) == {"forward", "backward", "reduce", "optimizer"}
        assert all(ms > 0 for ms in row["time_ms"].values())
    assert "tflops" not in rows[0] and rows[2]["tflops"] > 0 and rows[2]["mfu"] == pytest.approx(
        rows[2]["tflops"] / 1.0)
    logged = [r.getMessage() for r in records if "time (ms" in r.getMessage()]
    assert len(logged) == 2 and "step=2" in logged[0] and "step=4" in logged[1]
    numbers = [float(v) for v in re.findall(r"(?:forward|backward|optimizer): ([0-9.]+)", logged[0])]
    assert len(numbers) == 3 and all(v > 0 for v in numbers) and "memory | allocated" in logged[0]


# ---------------------------------------------------------------------------- the engine's autotuning side


def test_model_info_profile_by_config_switch(tmp_path):
    path = tmp_path / "info" / "model_info.json"
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"},
              "autotuning": {"model_info_path": str(path), "model_info": {"profile": True}}}
    engine, *_ = shardtrain.initialize(model=mlp(), config=config)
    with pytest.raises(SystemExit) as exit_info:
        train(engine, 3, 8)
    assert exit_info.value.code == 0 and engine.global_steps == 2  # exits after the second step
    info = json.loads(path.read_text())
    params = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
    assert info["num_params"] == info["trainable_num_params"] == params and info["rank"] == 0
    assert info["activation_mem_per_gpu"] == analytic_activation_bytes(8)
    assert info["activation_mem_per_sample"] == analytic_activation_bytes(1)
    assert info["bytes_per_param"]["params"] == 4 and info["bytes_per_param"]["optimizer"] == pytest.approx(8, abs=0.02)
    assert info["model_state_bytes"]["total"] == pytest.approx(16 * params, rel=0.01)


def test_a_trial_writes_metrics_and_exits(tmp_path):
    metrics = tmp_path / "metrics.json"
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
              "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                             "metric_path": str(metrics), "metric": "flops"}}
    engine, *_ = shardtrain.initialize(model=mlp(), config=config)
    with pytest.raises(SystemExit):
        train(engine, 10, 4)
    data = json.loads(metrics.read_text())
    assert engine.global_steps == 3 and data["throughput"] > 0 and data["latency"] > 0
    # FLOPs are counted on the step before the timed ones: forward and backward of 4 samples.
    flops = 2 * 4 * (IN * HIDDEN + HIDDEN * OUT) + 2 * 4 * (IN * HIDDEN + 2 * HIDDEN * OUT)
    assert data["FLOPS_per_gpu"] == pytest.approx(flops / (data["latency"] / 1000))
    assert data["peak_memory"] == engine.model_state_bytes()["total"] + analytic_activation_bytes(4)


def test_a_trial_over_its_memory_budget_is_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setenv(profiling.MEMORY_BUDGET_ENV, "20000")  # below the model states alone
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
              "autotuning": {"enabled": True, "metric_path": str(tmp_path / "m.json")}}
    engine, *_ = shardtrain.initialize(model=mlp(), config=config)
    with pytest.raises(profiling.OutOfMemoryError, match="above the memory budget"):
        train(engine, 3, 4)
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------------------- the autotuner's arithmetic


def model_info(params=1000, per_sample=100.0, k=8.0):
    return {"num_params": params, "trainable_num_params": params, "activation_mem_per_sample": per_sample,
            "bytes_per_param": {"params": 4.0, "grads": 4.0, "optimizer": k}}


def test_stage_fits_follow_the_zero_formula():
    info = model_info()
    fits = stage_fits(info, budget=20_000, world_size=4, stages=[0, 1, 2, 3])
    states = [16_000, 8_000 + 2_000, 4_000 + 3_000, 4_000]
    assert [f.model_state_bytes for f in fits] == states
    assert [f.max_micro_batch for f in fits] == [(20_000 - s) // 100 for s in states]
    assert stage_fits(info, 15_000, 1, [0])[0].max_micro_batch == 0  # states alone do not fit
    assert stage_fits(info, 10**9, 1, [0], max_micro_batch=64)[0].max_micro_batch == 64
    assert stage_fits(info, 16_150, 1, [0], min_micro_batch=2)[0].max_micro_batch == 0


def test_candidates_surround_the_prediction():
    assert search._candidates(12, 3, 1, 1024) == [6, 12, 13]
    assert search._candidates(64, 3, 1, 1024) == [32, 64, 72]
    assert search._candidates(64, 3, 1, 64) == [16, 32, 64]
    assert search._candidates(1, 3, 1, 1024) == [1, 2]
    assert search._candidates(0, 3, 1, 1024) == []


def test_choose_takes_the_fastest_that_fits_and_the_larger_batch_on_a_tie():
    trials = [Trial("a", 0, 8, "ok", samples_per_s=100.0), Trial("b", 0, 16, "ok", samples_per_s=98.0),
              Trial("c", 0, 18, "oom"), Trial("d", 3, 16, "ok", samples_per_s=60.0)]
    assert search._choose(trials, "throughput").name == "b"
    trials[1].samples_per_s = 80.0
    assert search._choose(trials, "throughput").name == "a"
    assert search._choose([Trial("x", 0, 2, "oom"), Trial("y", 0, 4, "error")], "throughput") is None
    latency = [Trial("a", 0, 8, "ok", latency_ms=10.0), Trial("b", 0, 16, "ok", latency_ms=30.0)]
    assert search._choose(latency, "latency").name == "a"


def test_parse_size():
    assert parse_size("20GiB") == 20 * 2**30 and parse_size("8GB") == 8 * 10**9
    assert parse_size("1.5e6") == 1_500_000 and parse_size("512 MiB") == 512 * 2**20
    for bad in ("lots", "-3GiB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---------------------------------------------------------------------------- shardtrain autotune, end to end


def test_autotune_picks_the_largest_micro_batch_that_fits(tmp_path, monkeypatch, capsys):
    """A profile and two trials at stage 0: the predicted largest micro-batch, which fits,
    and one above it, which is over the budget and counted out of memory."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
        "autotuning": {"start_profile_step": 1, "end_profile_step": 3, "num_tuning_micro_batch_sizes": 2}}))
    params = 2 * 32 * 512 + 512 + 32          # the script's MLP
    states = 16 * params                     # fp32 weights, gradients, Adam's two moments
    per_sample = (32 + 512) * 4              # its input and the ReLU output
    budget = states + 10 * per_sample + per_sample // 2
    status = profiling.autotune_main([str(SCRIPT), "--config", str(config), "--memory-budget", str(budget),
                                      "--stages", "0", "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    info = json.loads((tmp_path / "autotuning_results" / "profile_model_info" / "model_info.json").read_text())
    assert info["activation_mem_per_sample"] == per_sample
    truth = (budget - info["model_state_bytes"]["total"]) // per_sample  # the largest that fits
    with open(tmp_path / "autotuning_results" / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    assert [(int(t["micro_batch"]), t["status"]) for t in trials] == [(truth, "ok"), (truth + 1, "oom")]
    assert int(trials[0]["peak_memory"]) <= budget
    best = json.loads((tmp_path / "autotuning_results" / "best_config.json").read_text())
    assert best["train_micro_batch_size_per_gpu"] == truth and best["zero_optimization"]["stage"] == 0
    assert "autotuning" not in best and best["train_batch_size"] == truth
    assert shardtrain.load_config(best, 1).train_micro_batch_size_per_gpu == truth
    assert f"best: stage 0, micro-batch {truth}" in out
    assert (tmp_path / "autotuning_exps" / f"z0_mbs{truth + 1}" / "output.log").is_file()


def test_autotune_through_the_shardtrain_command(capsys):
    from shardtrain.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["autotune", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "shardtrain autotune SCRIPT --config CONFIG" in out
    assert "--memory-budget SIZE" in out and "--stages LIST" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["autotune", str(SCRIPT)])
    assert exit_info.value.code == 2 and "--config" in capsys.readouterr().err


def test_autotune_reports_a_config_error(tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "autotuning": {"metricc": "latency"}}))
    assert profiling.autotune_main([str(SCRIPT), "--config", str(config), "--memory-budget", "1GiB",
                                    "--results-dir", str(tmp_path / "r")]) == 1
    assert "did you mean 'metric'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profiling.autotune_main([str(SCRIPT), "--config", str(config), "--stages", "0,5"])
