"""`shardtrain doctor` on 2 and 3 real processes (it starts them through torchrun), and its
verdict on reports with a slow rank, a slow pair or mixed versions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.cli._doctor import _rounds, problems, report_text

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--sizes", "64KiB,256KiB", "--iters", "2", "--slow-factor", "1000"]


def doctor(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "shardtrain.cli", "doctor", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module", params=[2, 3])
def report(request):
    proc = doctor("--nproc", str(request.param), "--json", *QUICK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return request.param, json.loads(proc.stdout)


def test_every_rank_reports_its_versions_device_and_launcher_variables(report):
    world, r = report
    assert r["world_size"] == world and r["backend"] == "gloo" and r["nodes"] == 1
    assert [x["rank"] for x in r["ranks"]] == list(range(world))
    for x in r["ranks"]:
        assert x["local_rank"] == x["rank"] and x["device"] == "cpu"
        assert x["torch"] and x["shardtrain"] and x["host_memory_available"] > 0
        assert x["variables"]["RANK"] == str(x["rank"])
        assert x["variables"]["WORLD_SIZE"] == str(world)
        assert "transformers" in x["packages"] and "deepspeed" in x["packages"]
    assert len({x["pid"] for x in r["ranks"]}) == world  # one process each
    assert len(r["compute"]["seconds"]) == world and min(r["compute"]["seconds"]) > 0


def test_bandwidths_follow_nccl_tests_definitions(report):
    world, r = report
    assert [(c["op"], c["bytes"]) for c in r["collectives"]] == [
        ("all_reduce", 64 * 1024 // (4 * world) * 4 * world),
        ("all_gather", 64 * 1024 // (4 * world) * 4 * world),
        ("all_reduce", 256 * 1024 // (4 * world) * 4 * world),
        ("all_gather", 256 * 1024 // (4 * world) * 4 * world)]
    for c in r["collectives"]:
        assert c["seconds"] > 0
        assert c["algbw"] == pytest.approx(c["bytes"] / c["seconds"])
        factor = 2 * (world - 1) / world if c["op"] == "all_reduce" else (world - 1) / world
        assert c["busbw"] == pytest.approx(c["algbw"] * factor)


def test_every_pair_of_ranks_is_measured(report):
    world, r = report
    pairs = r["pairs"]
    assert pairs["between"] == "ranks" and pairs["bytes"] == 256 * 1024
    assert sorted(tuple(p["ranks"]) for p in pairs["results"]) == [
        (a, b) for a in range(world) for b in range(a + 1, world)]
    assert all(p["busbw"] > 0 for p in pairs["results"])
    assert r["problems"] == []


def test_the_table_names_ranks_collectives_and_pairs():
    proc = doctor("--nproc", "2", *QUICK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("shardtrain doctor: 2 ranks on 1 node, backend gloo, device cpu")
    for text in ("matmul ms", "all_reduce", "all_gather", "busbw GB/s",
                 "all-reduce between pairs of ranks (256.0 KiB)", "0 - 1", "no problem found"):
        assert text in out, text
    assert "TORCHELASTIC_ERROR_FILE" not in out  # torchrun's own variables: only in --json


# -- the verdict, on reports made up here ---------------------------------------------------------

def _report(world=4, compute=None, pairs=None, **versions):
    ranks = [{"rank": i, "hostname": f"node{i // 2}", "device": f"cuda:{i % 2}",
              "shardtrain": "0.1.0", "torch": versions.get("torch", {}).get(i, "2.13.0"),
              "cuda": "13.0", "nccl": "2.27.7", "python": "3.11.7", "local_rank": i % 2,
              "device_memory": None, "host_memory_available": 1 << 30, "variables": {},
              "deepspeed": "none", "packages": {}} for i in range(world)]
    pairs = pairs or {p: 10e9 for p in [(a, b) for a in range(world) for b in range(a + 1, world)]}
    return {"world_size": world, "nodes": 2, "backend": "nccl", "device": "cuda", "ranks": ranks,
            "compute": {"matmul_side": 4096, "seconds": compute or [0.01] * world},
            "collectives": [], "slow_factor": 2.0,
            "pairs": {"between": "ranks", "bytes": 1 << 24, "results": [
                {"ranks": list(p), "hosts": [ranks[p[0]]["hostname"], ranks[p[1]]["hostname"]],
                 "busbw": bw, "algbw": bw, "seconds": 1.0, "bytes": 1 << 24, "op": "all_reduce"}
                for p, bw in pairs.items()]}}


def test_a_healthy_job_has_no_problem():
    assert problems(_report()) == []


def test_a_rank_in_every_slow_pair_is_named():
    bw = {(a, b): (1e9 if 2 in (a, b) else 10e9) for a in range(4) for b in range(a + 1, 4)}
    found = problems(_report(pairs=bw))
    assert "ranks 0 and 2 reach 1.00 GB/s between them, 10.0x below the typical pair " \
           "(10.00 GB/s, the upper quartile): check the link between node0 and node1." in found
    assert len(found) == 4  # the 3 pairs with rank 2, then rank 2 itself
    assert found[-1] == "every slow pair includes rank 2 (node1): it is the slow one."


def test_a_slow_device_and_mixed_versions_are_named():
    found = problems(_report(compute=[0.01, 0.01, 0.05, 0.01], torch={3: "2.12.0"}))
    assert found[0] == ("the ranks run different torch versions: 2.13.0 on ranks 0, 1, 2; "
                        "2.12.0 on rank 3: install the same torch everywhere.")
    assert found[1].startswith("rank 2 (node1, cuda:0) computes 5.0x slower than the median rank")
    assert "PROBLEMS:" in report_text({**_report(compute=[0.01, 0.01, 0.05, 0.01]),
                                       "problems": found})


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rounds_meet_every_pair_once_in_disjoint_rounds(n):
    rounds = _rounds(list(range(n)))
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
