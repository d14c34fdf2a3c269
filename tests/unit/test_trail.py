"""The collective trail in one process: records in a ring, a file another process reads,
and the comparison that names the first differing collective."""
from __future__ import annotations

import os

import pytest

from shardtrain.comm import _trail
from shardtrain.comm._roll_call import process_gone
from shardtrain.comm._trail import Trail, first_difference


def _trail_of(calls, slots=16, path=None):
    t = Trail(slots, path)
    for group, op, numel, label in calls:
        t.record(group, "0", "0-1", op, numel, "float32", label, "step 1")
    return t


def test_the_ring_keeps_the_last_records_with_their_positions():
    t = _trail_of([("world", "all_reduce", n, "") for n in range(1, 11)], slots=4)
    entries = t.entries()
    assert [e.seq for e in entries] == [7, 8, 9, 10]
    assert [e.numel for e in entries] == [7, 8, 9, 10]
    assert entries[0].describe() == "all_reduce of 7 float32 elements (step 1)"


def test_a_file_trail_outlives_its_writer(tmp_path):
    path = str(tmp_path / "rank1.trail")
    t = _trail_of([("zero", "all_gather", 528, "blocks.1")], path=path)
    t.close(remove=False)  # as a process that ended without cleaning up leaves it
    (entry,) = _trail.read(path)
    assert (entry.group, entry.seq, entry.op, entry.numel, entry.label) == \
        ("zero", 1, "all_gather", 528, "blocks.1")
    assert entry.describe() == "all_gather of 528 float32 elements for blocks.1 (step 1)"


def test_long_fields_are_cut_not_mixed_into_the_next_slot():
    t = Trail(2)
    t.record("world", "0", "0-1", "all_reduce", 1, "float32", "x" * 400, "step 1")
    t.record("world", "0", "0-1", "all_reduce", 2, "float32", "", "step 1")
    assert [e.numel for e in t.entries()] == [2]  # the cut record is dropped, not misread


def test_encode_and_decode_round_trip():
    entries = _trail_of([("world", "broadcast", 3, ""), ("zero", "all_gather", 5, "head")]).entries()
    assert _trail.decode(_trail.encode(entries)) == entries


def test_fingerprints_agree_only_for_the_same_calls():
    a = _trail_of([("world", "all_reduce", 10, ""), ("world", "all_gather", 4, "blocks.0")])
    b = _trail_of([("world", "all_reduce", 10, ""), ("world", "all_gather", 4, "blocks.0")])
    c = _trail_of([("world", "all_reduce", 10, ""), ("world", "all_gather", 4, "blocks.1")])
    assert a.fingerprints() == b.fingerprints() != c.fingerprints()


def test_spans_round_trip():
    assert _trail.spans([6, 0, 1, 2, 3]) == "0-3, 6"
    assert _trail.parse_spans("0-3, 6") == [0, 1, 2, 3, 6]


def test_the_first_different_size_is_named_with_both_calls():
    same = [("zero", "all_reduce", 100, "")] * 3
    trails = {0: _trail_of(same + [("zero", "all_reduce", 165, "")]).entries(),
              1: _trail_of(same + [("zero", "all_reduce", 3, "")]).entries()}
    diff = first_difference(trails, order=trails[0])
    assert diff.seq == 4
    assert diff.explain() == (
        "The ranks' collectives first differ at collective #4 over the zero group (ranks 0-1):\n"
        "  rank 0: all_reduce of 165 float32 elements (step 1)\n"
        "  rank 1: all_reduce of 3 float32 elements (step 1)")


def test_a_call_one_rank_never_issued_names_its_last():
    trails = {0: _trail_of([("zero", "all_reduce", 10, "")] * 3).entries(),
              1: _trail_of([("zero", "all_reduce", 10, "")] * 2).entries()}
    text = first_difference(trails).explain(ended={1})
    assert "  rank 1: ended without issuing it (its last was #2, all_reduce of 10 float32 " \
           "elements (step 1))" in text


def test_identical_trails_have_no_difference():
    calls = [("zero", "all_reduce", 10, "")] * 3
    assert first_difference({0: _trail_of(calls).entries(), 1: _trail_of(calls).entries()}) is None


def test_a_trail_whose_window_starts_later_is_compared_where_both_hold_it():
    calls = [("zero", "all_reduce", n, "") for n in range(1, 9)]
    short = _trail_of(calls + [("zero", "all_reduce", 99, "")], slots=3).entries()
    long = _trail_of(calls + [("zero", "all_reduce", 98, "")], slots=16).entries()
    assert first_difference({0: long, 1: short}).seq == 9


def test_marks_are_kept_apart_and_named_as_the_forward_order():
    t0, t1 = Trail(8), Trail(8)
    for t, order in ((t0, ["blocks.0", "blocks.1"]), (t1, ["blocks.0", "blocks.2"])):
        for name in order:
            t.record("zero", "0" + _trail.ORDER, "0-1", "forward", 0, "", name, "step 2")
    text = first_difference({0: t0.entries(), 1: t1.entries()}).explain()
    assert text.startswith("The ranks first differ at module #2 of the forward order over the "
                           "zero group (ranks 0-1):")
    assert "  rank 0: forward of blocks.1 (step 2)" in text


def test_groups_of_other_names_over_one_process_group_share_the_count():
    t = Trail(8)
    t.record("zero", "0", "0-1", "all_reduce", 1, "float32", "", "")
    t.record("world", "0", "0-1", "all_reduce", 1, "float32", "", "")
    assert [e.seq for e in t.entries()] == [1, 2]


def test_a_trail_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        Trail(0)


def test_this_process_is_alive_and_an_unused_pid_is_gone():
    assert not process_gone(os.getpid())
    unused = next(pid for pid in range(4_000_000, 1, -1) if not os.path.exists(f"/proc/{pid}"))
    assert process_gone(unused)


def test_nccl_flight_recorder_is_set_up_unless_the_user_chose(monkeypatch, tmp_path):
    from shardtrain import comm
    from shardtrain.comm._process import _set_up_flight_recorder
    for name in (*comm.FLIGHT_RECORDER_ENV, "TORCH_FR_DUMP_TEMP_FILE",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's value wins
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    _set_up_flight_recorder()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    prefix = str(tmp_path / "shardtrain-nccl-trace" / "rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == prefix == comm.flight_recorder_prefix()
    assert (tmp_path / "shardtrain-nccl-trace").is_dir()


def _leave(folder, rank, pid, numels):
    t = Trail(16, str(folder / f"rank{rank}-pid{pid}.trail"))
    for n in numels:
        t.record("zero", "0", "0-1", "all_reduce", n, "float32", "", "step 2")
    t.close(remove=False)


def test_shardtrain_trails_compares_what_the_ranks_left(tmp_path, capsys):
    from shardtrain.cli import main
    dead = next(pid for pid in range(4_000_000, 1, -1) if not os.path.exists(f"/proc/{pid}"))
    _leave(tmp_path, 0, os.getpid(), [10, 10, 165])
    _leave(tmp_path, 1, dead, [10, 10, 3])
    assert main(["trails", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"rank 1 (pid {dead}, ended, written " in out
    assert "3 records; last #3 over the zero group: all_reduce of 3 float32 elements" in out
    assert ("The ranks' collectives first differ at collective #3 over the zero group "
            "(ranks 0-1):\n  rank 0: all_reduce of 165 float32 elements (step 2)\n"
            "  rank 1: all_reduce of 3 float32 elements (step 2)") in out


def test_shardtrain_trails_says_when_there_is_nothing_to_read(tmp_path, capsys):
    from shardtrain.cli import main
    assert main(["trails", str(tmp_path)]) == 1
    assert "no trail files (rank<R>-pid<P>.trail) in " in capsys.readouterr().err
