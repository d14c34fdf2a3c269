"""The benchmark scripts stay runnable: a smoke run of the one-command GPU benchmark on the CPU
(tiny model, every ZeRO stage and stage 3 with leaf blocks, 2 ranks), and the rank launcher
failing fast when a rank dies.

Figures are not checked here (benchmarks/README.md has them); only that each run trains and
reports, so the script is ready for the next machine with a GPU.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_gpu_benchmark_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_gpu.py"), "--tiny", "--device", "cpu", "--nproc", "2",
         "--steps", "2", "--warmup", "1", "--micro", "2", "--no-compile", "--json", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["stage"], r["compiled"], r["leaf"]) for r in rows] == [
        (0, False, []), (1, False, []), (2, False, []), (3, False, []), (3, False, ["Block"])]
    for r in rows:
        assert r["world"] == 2 and r["tokens_s"] > 0 and math.isfinite(r["loss"])
        assert r["flops_token"] == 6 * r["params"] + 12 * 2 * 64 * 64  # 6N + 12 L T d, tiny model
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) < 0.05, losses  # same model and data at every stage (bf16)
    for name in ("stage 0", "stage 1", "stage 2", "stage 3", "stage 3 +leaf"):
        assert name in proc.stdout


def test_gpu_benchmark_says_when_there_is_no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the message is for machines without one")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_gpu.py")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA device here; `--device cpu --tiny` is a smoke run" in proc.stderr


def _dies(rank, world, port, queue):
    if rank == 1:
        raise RuntimeError("rank 1 breaks")
    time.sleep(600)  # rank 0 would wait for ever on a collective


def test_rank_launcher_fails_fast_when_a_rank_dies():
    sys.path.insert(0, str(BENCHMARKS))  # the spawned ranks import _ranks too
    try:
        from _ranks import run_ranks
        start = time.monotonic()
        with pytest.raises(SystemExit, match="rank 1 exited with code 1"):
            run_ranks(_dies, 2, timeout=300)
        assert time.monotonic() - start < 60
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_weights_benchmark_smoke_run(tmp_path):
    """bench_weights.py on the tiny model, 2 ranks: every measurement is taken and reported."""
    out = tmp_path / "weights.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_weights.py"), "--model", "tiny", "--steps", "1",
         "--dir", str(tmp_path / "files"), "--json", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank in ranks:
        for name in ("save_16bit_model", "save_checkpoint", "load_checkpoint", "load_pretrained"):
            assert rank["ours"][name]["seconds"] > 0, name
        assert rank["dcp"]["save"]["bytes"] > 0 and rank["async"]["save_blocks"] >= 0
    assert "ratios shardtrain / DCP" in proc.stdout and "asynchronous save" in proc.stdout


def test_parallel_benchmark_smoke_run(tmp_path):
    """bench_parallel.py on the tiny Llama, 2 ranks (dp2, tp2 with torch's TP beside it, sp2):
    every mesh trains the same global batches to the same loss, and the bytes each rank hands
    to the comm layer per step are the analytic volume."""
    out = tmp_path / "parallel.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_parallel.py"), "--tiny", "--world", "2",
         "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mesh"], r["engine"]) for r in rows] == [
        ("dp2", "shardtrain"), ("tp2", "shardtrain"), ("tp2", "torch TP"), ("sp2", "shardtrain")]
    final = [r["losses"][-1] for r in rows]
    assert max(final) - min(final) < 1e-4, final
    for r in rows:
        assert r["step_s"] > 0
        for kind, ratio in r.get("ratio", {}).items():
            assert abs(ratio - 1) < 0.01, (r["mesh"], kind, ratio)
    assert set(rows[1]["analytic"]) == {"tp"} and set(rows[3]["analytic"]) == {"sp", "zero"}


@pytest.mark.parametrize("model", ["layer", "mixtral"])
def test_moe_benchmark_smoke_run(tmp_path, model):
    """bench_moe.py on the tiny model (the MoE layer; transformers' Mixtral with AutoEP), 2
    ranks: dense, leaf-module ZeRO-3, ep2 and torch DDP train to the same losses, and ep2's
    all-to-all moves exactly the analytic volume."""
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_moe.py"), "--tiny", "--world", "2",
         "--model", model, "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["setup"] for r in rows] == ["dense", "leaf3", "ep2", "ddp"]
    for r in rows[1:3]:
        assert r["losses"] == pytest.approx(rows[0]["losses"], abs=1e-5)
    # torch's DDP and AdamW: the same training, reduced and clipped in another order
    assert rows[3]["losses"] == pytest.approx(rows[0]["losses"], abs=1e-4)
    assert rows[3]["vs_ddp"] == 1.0 and rows[0]["vs_ddp"] > 0
    assert rows[2]["all_to_all"] == rows[2]["analytic"] > 0
    assert rows[2]["states"] < rows[0]["states"]


def test_diagnostics_benchmark_smoke_run(tmp_path):
    """bench_diagnostics.py on the tiny GPT at stages 0 and 3: every variant is timed, the
    stage-3 step issues more collectives than stage 0's, and the costs measured alone are
    reported as shares of a step."""
    out = tmp_path / "diagnostics.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_diagnostics.py"), "--model", "tiny", "--seq",
         "16", "--micro", "2", "--blocks", "1", "--steps", "1", "--json", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["record_us"] > 0
    stages = got["stages"]
    assert set(stages) == {"0", "3"}
    assert stages["3"]["collectives_per_step"] > stages["0"]["collectives_per_step"] >= 1
    for row in stages.values():
        assert set(row["step_ms"]) == {"trail off", "trail on", "step check", "collective check"}
        assert row["ratio_to_trail_off"]["trail off"] == 1.0
        assert row["check_ms"] > 0 and 0 < row["trail_share"] < row["check_share"]
    assert "the step check alone takes" in proc.stdout


def test_tiling_benchmark_smoke_run(tmp_path):
    """bench_tiling.py on a short sequence: the tiled MLP and loss peak lower than untiled,
    with the same input gradient."""
    out = tmp_path / "tiling.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_tiling.py"), "--seq", "1024", "--tiles", "4",
         "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["what"], r["tiles"]) for r in rows] == [
        ("mlp", 1), ("mlp", 4), ("logits+loss", 1), ("logits+loss", 4)]
    for r in rows:
        if r["tiles"] > 1:
            assert r["ratio"] < 0.8 and r["max_abs_diff"] < 1e-5, r


def test_pipe_benchmark_smoke_run(tmp_path):
    """bench_pipe.py --tiny (2 ranks, 2 stages): shardtrain's engine and torch's pipelining
    both run 1F1B, GPipe, interleaved 1F1B and the zero-bubble V, start from the same loss,
    send exactly the analytic bytes, and keep as many micro-batches alive as their schedules
    imply."""
    out = tmp_path / "pipe.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_pipe.py"), "--tiny", "--json", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    p, m = got["stages"], got["micro_batches"]
    assert (p, got["world"], got["errors"]) == (2, 2, {})
    assert got["theory_bubble"] == pytest.approx((p - 1) / (m + p - 1))
    schedules = ("1f1b", "gpipe", "interleaved", "zbv")
    assert [(r["engine"], r["schedule"]) for r in got["rows"]] == [
        (engine, s) for engine in ("shardtrain", "torch") for s in schedules]
    for r in got["rows"]:
        assert r["step_s"] > 0 and len(r["idle"]) == len(r["wait"]) == p
        assert all(0 <= x <= 1 for x in r["idle"] + r["wait"])
        assert r["sent"] == r["analytic_sent"] and min(r["sent"]) > 0, r
        assert r["in_flight"] == r["schedule_in_flight"] and min(r["peak_activation_bytes"]) > 0
        assert r["peak_activation_bytes"] == r["schedule_peak_bytes"], r
        if r["schedule"] == "zbv":
            assert r["theory_bubble"] < 0.1
        else:  # interleaved: two chunks a stage halve the slots the bubble is made of
            chunks = 2 if r["schedule"] == "interleaved" else 1
            assert r["theory_bubble"] == pytest.approx((p - 1) / (chunks * m + p - 1))
    assert got["weight_diff"] == 0.0
    for schedule in schedules:
        assert got["first_step_loss"][schedule]["diff"] < 1e-4, got["first_step_loss"]
        assert got["ratios"][schedule] > 0
    for heading in ("step time", "idle share", "bytes sent per rank", "activations kept"):
        assert heading in proc.stdout
