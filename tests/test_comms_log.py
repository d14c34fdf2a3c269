"""The communication log (``comms_logger``, ``deepspeed.comm.log_summary``) over 2 gloo
ranks: the engine's collectives and a script's, counted and sized as issued, with latencies
and nccl-tests' bandwidths; the straggler column, ``prof_ops``, ``verbose`` and ``debug``."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Dict, List

import pytest
import torch

from _dist import run_ranks

WORLD = 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def logged_run(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    import shardtrain
    from shardtrain import comm
    captured = _Lines()
    logging.getLogger("shardtrain").addHandler(captured)
    issued: Counter = Counter()

    def count(op, tensor, group):
        if comm.get_world_size(group) > 1:
            issued[(op, tensor.numel() * tensor.element_size())] += 1

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 300},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "comms_logger": {"enabled": True}}
    engine, *_ = shardtrain.initialize(model=model, config=config)
    comm.add_observer(count, with_group=True)
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    comm.remove_observer(count)
    script = torch.ones(1000)
    deepspeed.comm.all_reduce(script)  # a script's own collective, through the pass-through
    deepspeed.comm.all_reduce(script)
    out: Dict[str, Any] = {"issued": {f"{op} {size}": n for (op, size), n in issued.items()}}
    before = len(captured.lines)
    out["summary"] = deepspeed.comm.log_summary(show_straggler=True, return_dict=True)
    out["table"] = captured.lines[before:]

    deepspeed.comm.reset_log()
    deepspeed.comm.configure(enabled=True, prof_all=False, prof_ops=["all_gather_into_tensor"])
    for _ in range(2):  # one optimizer step: its all-gather of the updated slices
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    out["only_all_gather"] = sorted(deepspeed.comm.log_summary(return_dict=True))

    deepspeed.comm.reset_log()
    deepspeed.comm.configure(enabled=True, verbose=True, debug=True)
    before = len(captured.lines)
    deepspeed.comm.all_reduce(torch.ones(10))
    out["verbose"] = captured.lines[before:]
    out["debug"] = sorted(deepspeed.comm.log_summary(return_dict=True))
    deepspeed.comm.configure(enabled=False)
    deepspeed.comm.all_reduce(torch.ones(10))
    out["after_off"] = sum(r["count"] for sizes in deepspeed.comm.log_summary(return_dict=True).values()
                           for r in sizes.values())
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def run():
    return run_ranks("test_comms_log:logged_run", WORLD, timeout=120)


def test_every_collective_is_logged_with_its_size_and_count(run):
    for got in run:
        summary = got["summary"]
        logged = {f"{op} {size}": row["count"] for op, sizes in summary.items()
                  for size, row in sizes.items()}
        script = logged.pop("all_reduce 4000")
        assert script == 2 + got["issued"].get("all_reduce 4000", 0)
        assert logged == {k: v for k, v in got["issued"].items() if k != "all_reduce 4000"}
        assert "reduce_scatter" in summary and "all_gather" in summary  # ZeRO-2's traffic


def test_latencies_and_bandwidths_follow_nccl_tests(run):
    factors = {"all_reduce": 2 * (WORLD - 1) / WORLD, "reduce_scatter": (WORLD - 1) / WORLD,
               "all_gather": (WORLD - 1) / WORLD}
    for got in run:
        for op, sizes in got["summary"].items():
            for size, row in sizes.items():
                assert row["total_latency_ms"] > 0
                assert row["avg_latency_ms"] == pytest.approx(row["total_latency_ms"] / row["count"])
                data = size * WORLD if op == "all_gather" else size
                assert row["algbw_gbps"] == pytest.approx(data / (row["avg_latency_ms"] / 1e3) / 1e9)
                assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factors.get(op, 1.0))
                assert 0 <= row["straggler_ms"] <= row["total_latency_ms"]


def test_rank_0_logs_the_table(run):
    table = "\n".join(run[0]["table"])
    assert "Comm. Op" in table and "Straggler(ms)" in table and "reduce_scatter" in table
    assert run[1]["table"] == []


def test_prof_ops_verbose_and_debug(run):
    for got in run:
        assert got["only_all_gather"] == ["all_gather"]
        assert len(got["verbose"]) == 1 and got["verbose"][0].startswith("comm op: all_reduce [")
        assert "| time (ms): " in got["verbose"][0] and "busbw (GB/s)" in got["verbose"][0]
        assert got["debug"] == ["all_reduce [logged_run]"]  # the caller's name, with debug
        assert got["after_off"] == 1  # turned off: the last all-reduce is not logged
