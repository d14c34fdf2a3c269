"""When ranks diverge or one is lost, every rank that can still speak ends within the bound
with an error that names itself, the collective, where training was, the first collective at
which the ranks differ and the rank that did not answer (cases in ``cases_failures.py``; real
processes over gloo, a 3-second timeout)."""
from __future__ import annotations

import re

import pytest
import torch

from _dist import run_ranks
from shardtrain.cli import main

TIMEOUT_S = 3
ROLL_CALL_S = 5
BOUND_S = TIMEOUT_S + ROLL_CALL_S + 4  # the timeout, the roll call, start-up slack


def _run(case: str, need=None):
    return run_ranks(f"cases_failures:{case}", 2, timeout=120, need=need,
                     env={"SHARDTRAIN_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)})


@pytest.fixture(scope="module")
def stuck():
    return _run("stuck_rank")


def test_a_survivor_names_the_rank_that_stopped_and_where_it_waited(stuck):
    got = stuck[0]
    assert got["error"] is not None, got
    message = got["error"]
    assert message.startswith("rank 0: all_reduce of "), message
    assert re.search(r"over the \w+ group \(ranks 0-1\) failed at step 2, micro-step 2 of 2, "
                     r"in backward: ", message), message
    assert message.endswith("\n  Rank(s) 1 did not answer within 5 s: ended, or stuck before "
                            "this collective (in a different branch, a data loader, I/O); "
                            "their output says where."), message
    assert got["cause"] in ("RuntimeError", "DistBackendError"), got  # the backend's error


def test_the_survivor_ends_within_the_timeout_not_the_default_ten_minutes(stuck):
    # steps 1-2 take well under a second; then the timeout (3 s) and the roll call (5 s)
    assert stuck[0]["seconds"] < BOUND_S, stuck[0]


def test_the_stuck_rank_learns_its_peer_is_gone(stuck):
    """Rank 1 wakes after rank 0 has given up: its own collective fails too, with a message
    of its own (rank 0, which hosts the store, may be gone by then)."""
    message = stuck[1]["error"]
    assert message is not None and message.startswith("rank 1: "), stuck[1]
    assert "step 2, micro-step" in message, message


def test_a_pipeline_stage_that_stops_sending_is_named_with_the_micro_batch():
    """Stage 1 stops in a forward; stage 0 waits for that micro-batch's gradient and ends
    within the bound, naming the receive, the rank it waited for, the stage, the micro-batch
    and the direction."""
    got = _run("stuck_stage", need=[0])[0]
    message = got["error"]
    assert message is not None and message.startswith("rank 0: recv of "), got
    assert ("from rank 1 failed at step 2, pipeline stage 0 of 2, micro-batch 2 of 2, "
            "backward: receiving its output's gradient from stage 1 (rank 1): ") in message
    assert message.endswith("Rank(s) 1 did not answer within 5 s: ended, or stuck before "
                            "this collective (in a different branch, a data loader, I/O); "
                            "their output says where."), message
    assert got["seconds"] < BOUND_S, got


def test_a_killed_rank_is_named_as_ended_with_its_last_collective(tmp_path, capsys):
    """Rank 1's process ends mid-step: the survivor reads the trail its file left and says
    which collective rank 1 never issued, without waiting out the roll call. Both trails
    stay behind, and ``shardtrain trails`` reads the same from them afterwards."""
    got = run_ranks("cases_failures:killed_rank", 2, timeout=120, need=[0],
                    env={"SHARDTRAIN_COLLECTIVE_TIMEOUT": str(TIMEOUT_S),
                         "SHARDTRAIN_TRAIL_DIR": str(tmp_path)})[0]
    message = got["error"]
    assert message.startswith("rank 0: all_reduce of 165 float32 elements over the zero group "
                              "(ranks 0-1) failed at step 2, micro-step 2 of 2, in backward"), message
    assert re.search(r"first differ at collective #\d+ over the zero group \(ranks 0-1\):\n"
                     r"    rank 0: all_reduce of 165 float32 elements \(step 2, micro-step 2 of 2, "
                     r"in backward\)\n    rank 1: ended without issuing it \(its last was #\d+, "
                     r"all_reduce of 165 float32 elements \(step 1, micro-step 2 of 2, in "
                     r"backward\)\)", message), message
    assert message.endswith("Rank(s) 1 ended (their process is gone); their output says why."), message
    assert got["seconds"] < BOUND_S, got
    assert main(["trails", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"rank 1 \(pid \d+, ended, written ", out), out
    assert "\n  rank 0: all_reduce of 165 float32 elements (step 2, micro-step 2 of 2, in " \
           "backward)\n  rank 1: ended without issuing it" in out, out


def test_one_extra_all_reduce_is_named_with_its_size_and_step():
    """Rank 1 all-reduces a metric the others do not: gloo ends rank 1 (the sizes differ);
    the survivor names both calls of the first differing position."""
    got = _run("extra_all_reduce", need=[0])[0]
    message = got["error"]
    assert "    rank 0: all_reduce of 165 float32 elements (step 2, micro-step 2 of 2, in backward)\n" \
           "    rank 1: all_reduce of 3 float32 elements (step 2, micro-step 2 of 2, " in message, message
    assert "Rank(s) 1 ended" in message, message
    assert got["seconds"] < BOUND_S, got


def test_a_rank_that_skips_a_module_at_stage_3_is_named_with_the_module():
    """Rank 1 skips ``blocks.1``: the gathers still pair (prefetching fetched it), the
    backward's do not, and both ranks time out; both name the forward order that differs."""
    got = _run("skipped_module")
    for rank in (0, 1):
        message = got[rank]["error"]
        assert message.startswith(f"rank {rank}: "), message
        assert "The ranks first differ at module #" in message, message
        assert "    rank 0: forward of blocks.1 (step 2, micro-step 1 of 1, in forward)\n" \
               "    rank 1: forward of blocks.2 (step 2, micro-step 1 of 1, in forward)" in message, message
        assert "Every rank of the group answered: the difference above is the cause." in message
        assert got[rank]["seconds"] < BOUND_S, got[rank]


def test_different_bucket_sizes_are_named_with_both_sizes():
    got = _run("bucket_sizes", need=[0])[0]
    message = got["error"]
    assert re.search(r"first differ at collective #\d+ over the zero group \(ranks 0-1\):\n"
                     r"    rank 0: reduce_scatter of 170 float32 elements \(step 1, micro-step 1 "
                     r"of 2, in backward\)\n    rank 1: reduce_scatter of 40 float32 elements",
                     message), message
    assert got["seconds"] < BOUND_S, got


def test_the_per_collective_check_stops_a_swap_before_anything_pairs():
    """Two modules in another order on rank 1 at stage 3 (no prefetching): the gathers would
    pair silently (same sizes, wrong shards); the per-collective check stops both ranks at
    the first gather after, naming the modules."""
    got = _run("swapped_modules")
    for rank in (0, 1):
        assert got[rank]["kind"] == "DivergenceError", got[rank]
        message = got[rank]["error"]
        assert "found by the check before all_gather over the zero group" in message, message
        assert "    rank 0: forward of blocks.1 (step 2, " in message, message
        assert "    rank 1: forward of blocks.2 (step 2, " in message, message
        assert got[rank]["seconds"] < TIMEOUT_S, got[rank]  # no timeout waited for


def test_the_step_check_finds_a_divergence_that_does_not_hang():
    """An all-reduce of int32 on one rank and float32 on the other pairs without an error;
    the per-step check raises on both ranks at step 2 before the update, naming it."""
    got = _run("metric_dtype")
    for rank in (0, 1):
        assert got[rank]["kind"] == "DivergenceError", got[rank]
        message = got[rank]["error"]
        assert "issued different collectives, found by the check at step 2:" in message, message
        assert "    rank 0: all_reduce of 4 float32 elements (step 2, micro-step 1 of 2, " in message
        assert "    rank 1: all_reduce of 4 int32 elements (step 2, micro-step 1 of 2, " in message


def test_the_check_changes_nothing_bit_for_bit():
    got = run_ranks("cases_failures:check_on_off", 2, timeout=120)
    for rank in (0, 1):
        runs = got[rank]
        for stage in (0, 3):
            off = runs[("off", stage)]
            assert off["error"] is None, off
            for mode in ("step", "collective"):
                on = runs[(mode, stage)]
                assert on["error"] is None, on
                for a, b in zip(off["params"], on["params"]):
                    assert torch.equal(a, b), (mode, stage)


def test_the_short_bound_holds_inside_steps_after_the_first_and_the_long_one_elsewhere():
    """Late by 2.5 s in the first step and outside a step: within the long bound (30 s);
    late by 3 s inside step 4: the short bound (1.5 s) ends it there."""
    got = run_ranks("cases_failures:bounds", 2, timeout=120)
    message = got[0]["error"]
    assert message is not None, got[0]
    assert re.search(r"^rank 0: all_reduce of 165 float32 elements over the zero group \(ranks "
                     r"0-1\) failed at step 4, micro-step 2 of 2, in backward: .*Timed out "
                     r"waiting 1500ms", message), message
    assert got[0]["seconds"] < 2.5 + 2.5 + 1.5 + ROLL_CALL_S + 4, got[0]
