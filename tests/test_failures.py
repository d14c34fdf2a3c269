"""When a rank stops responding, the others end within the collective timeout with an error
that names themselves, the collective, where training was, and the rank that did not answer
(cases in ``cases_failures.py``; real processes over gloo, a 3-second timeout)."""
from __future__ import annotations

import re

import pytest

from _dist import run_ranks

TIMEOUT_S = 3


@pytest.fixture(scope="module")
def stuck():
    return run_ranks("cases_failures:stuck_rank", 2, timeout=120,
                     env={"SHARDTRAIN_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)})


def test_a_survivor_names_the_rank_that_stopped_and_where_it_waited(stuck):
    got = stuck[0]
    assert got["error"] is not None, got
    message = got["error"]
    assert message.startswith("rank 0: all_reduce of "), message
    assert re.search(r"over the \w+ group \(ranks 0, 1\) failed at step 2, micro-step 2 of 2, "
                     r"in backward: ", message), message
    assert message.endswith("\n  Rank(s) 1 did not answer within 5 s: ended, or stuck before "
                            "this collective (in a different branch, a data loader, I/O); "
                            "their output says where."), message
    assert got["cause"] in ("RuntimeError", "DistBackendError"), got  # the backend's error


def test_the_survivor_ends_within_the_timeout_not_the_default_ten_minutes(stuck):
    # steps 1-2 take well under a second; then the timeout (3 s) and the roll call (5 s)
    assert stuck[0]["seconds"] < TIMEOUT_S + 5 + 4, stuck[0]


def test_the_stuck_rank_learns_its_peer_is_gone(stuck):
    """Rank 1 wakes after rank 0 has given up: its own collective fails too, with a message
    of its own (rank 0, which hosts the store, may be gone by then)."""
    message = stuck[1]["error"]
    assert message is not None and message.startswith("rank 1: "), stuck[1]
    assert "step 2, micro-step" in message, message
