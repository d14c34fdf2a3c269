"""A device mesh over real processes: its groups are the ranks DeepSpeed's layout puts
together (tensor-parallel innermost), and every collective runs over the group it is given
(cases in ``cases_mesh.py``)."""
from __future__ import annotations

import pytest

from _dist import run_ranks

LAYOUTS = {(2, 1): "dp2 x tp2", (1, 2): "dp2 x sp2", (4, 1): "tp4", (1, 1): "dp4"}


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS.values()))
def mesh(request):
    tp, sp = request.param
    return tp, sp, run_ranks("cases_mesh:groups_and_collectives", 4, timeout=120, tp=tp, sp=sp)


def _expected_groups(tp: int, sp: int) -> dict:
    """Each rank's group members, by the layout rank = (dp * sp + s) * tp + t."""
    dp = 4 // (tp * sp)
    at = {(d, s, t): (d * sp + s) * tp + t for d in range(dp) for s in range(sp) for t in range(tp)}
    groups = {}
    for (d, s, t), r in at.items():
        groups[r] = {"dp": [at[(i, s, t)] for i in range(dp)],
                     "sp": [at[(d, i, t)] for i in range(sp)],
                     "tp": [at[(d, s, i)] for i in range(tp)],
                     "zero": sorted(at[(i, j, t)] for i in range(dp) for j in range(sp))}
    return groups


def test_groups_follow_the_layout_with_tensor_parallel_ranks_adjacent(mesh):
    tp, sp, results = mesh
    expected = _expected_groups(tp, sp)
    for rank, got in enumerate(results):
        # one pipeline stage: the pipeline dimension is there, of size 1
        assert got["sizes"] == {"pp": 1, "dp": 4 // (tp * sp), "sp": sp, "tp": tp}
        assert got["ranks"] == {d: expected[rank][d] for d in ("dp", "sp", "tp")}, rank
        assert got["zero_ranks"] == expected[rank]["zero"], rank
        assert got["local"] == {d: expected[rank][d].index(rank) for d in ("dp", "sp", "tp")}
        assert got["coordinate"] == {"pp": 0, "dp": rank // (sp * tp), "sp": rank // tp % sp,
                                     "tp": rank % tp}
        layout = [[[(d * sp + s) * tp + t for t in range(tp)] for s in range(sp)]
                  for d in range(4 // (tp * sp))]
        assert got["device_mesh"] == (layout if tp * sp > 1 else None)  # dp alone: no sub-groups
    if tp == 2:
        assert results[0]["ranks"]["tp"] == [0, 1]  # DeepSpeed's first tensor-parallel group


def test_every_collective_runs_over_the_group_it_is_given(mesh):
    tp, sp, results = mesh
    expected = _expected_groups(tp, sp)
    for rank, got in enumerate(results):
        for dim, seen in got["collectives"].items():
            members = expected[rank][dim]
            me = members.index(rank)
            assert seen["sum"] == sum(members), (rank, dim)
            assert seen["avg"] == sum(members) / len(members), (rank, dim)
            assert seen["gathered"] == [float(r) for r in members], (rank, dim)
            assert seen["reduce_scatter"] == sum(me + 10 * r for r in members), (rank, dim)
            assert seen["broadcast"] == float(members[-1]), (rank, dim)
            assert seen["scatter"] == me * 100 + members[0], (rank, dim)
            assert seen["all_to_all"] == [me + 100 * r for r in members], (rank, dim)
            assert seen["objects"] == members, (rank, dim)
            assert seen["object"] == f"from {members[0]}", (rank, dim)


def test_a_mesh_that_does_not_divide_the_world_is_refused_with_the_numbers():
    seen = run_ranks("cases_mesh:refusals", 4, timeout=60)[0]
    assert seen["{'tp': 3}"] == (
        "world size 4 is not divisible by tensor-parallel size 3 x sequence-parallel size 1 = "
        "3: launch a multiple of 3 ranks, or choose sizes whose product divides 4.")
    assert "tensor-parallel size 2 x sequence-parallel size 3 = 6" in seen["{'tp': 2, 'sp': 3}"]
    assert seen["{'tp': 0}"] == "the tensor-parallel size must be a positive integer, got 0."
    assert seen["{'sp': 1.5}"] == ("the sequence-parallel size must be a positive integer, "
                                   "got 1.5.")
