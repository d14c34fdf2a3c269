"""Where DeepCompile's stage-3 all-gathers go in a traced graph (shardtrain.zero._placement), in
one process on hand-built graphs: each gather at its group's first use, the views after it,
prefetch bounded by elements, and a gather's packing of gradients laid out as ShardLayout's."""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.fx

from shardtrain.comm._traced import _pack_rows
from shardtrain.zero._placement import place_gathers
from shardtrain.zero._shards import ShardLayout

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def traced_like(sizes: List[int], tied_last: bool = False
                ) -> Tuple[torch.fx.GraphModule, List[torch.fx.Node], List[torch.fx.Node]]:
    """A graph as the compiled forward is traced: every gather (and its wait and view) first,
    then one matmul per group in order; with ``tied_last`` the first group is used again at
    the end (a tied head)."""
    g = torch.fx.Graph()
    flats = [g.placeholder(f"flat{i}") for i in range(len(sizes))]
    x = g.placeholder("x")
    gathers, weights = [], []
    for flat, size in zip(flats, sizes):
        gathered = g.call_function(GATHER, (flat, 2, "0"))
        gathered.meta["val"] = torch.empty(size)
        gathers.append(gathered)
        weights.append(g.call_method("view", (g.call_function(WAIT, (gathered,)), -1, 1)))
    uses = []
    for w in weights + ([weights[0]] if tied_last else []):
        x = g.call_function(torch.mul, (x, w))
        uses.append(x)
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g), gathers, uses


def index(gm: torch.fx.GraphModule, node: torch.fx.Node) -> int:
    return list(gm.graph.nodes).index(node)


def test_each_gather_moves_to_just_before_its_first_use_with_its_views():
    gm, gathers, uses = traced_like([16, 16, 16])
    assert place_gathers(gm) == 3
    kinds = [n.name.split("_")[0] for n in gm.graph.nodes if n.op.startswith("call_")]
    assert kinds == ["all", "wait", "view", "mul"] * 3  # gather, wait, view, use: group by group
    for gathered, use in zip(gathers, uses):
        assert index(gm, use) - index(gm, gathered) == 3


def test_a_tied_group_is_gathered_once_at_its_first_use():
    gm, gathers, uses = traced_like([16, 16], tied_last=True)
    place_gathers(gm)
    assert index(gm, gathers[0]) < index(gm, uses[0]) < index(gm, gathers[1]) < index(gm, uses[1])


def test_prefetch_issues_gathers_ahead_within_the_elements_given():
    sizes = [8, 8, 8, 8, 8, 8]
    for ahead, distance in ((0, 0), (7, 0), (8, 1), (16, 2), (23, 2), (10_000, 5)):
        gm, gathers, uses = traced_like(sizes)
        place_gathers(gm, ahead)
        for k, gathered in enumerate(gathers):
            at = max(0, k - distance)  # issued in front of this group's use
            assert index(gm, gathered) < index(gm, uses[at]), (ahead, k)
            if at > 0:
                assert index(gm, gathered) > index(gm, uses[at - 1]), (ahead, k)


def test_prefetch_counts_the_sizes_of_the_groups_ahead():
    gm, gathers, uses = traced_like([4, 4, 12, 4])
    place_gathers(gm, 12)
    # group 1 (4) ahead of group 0; group 2 (12) only at group 1's use; group 3 (4) too,
    # ahead of group 2: 12 + 4 > 12, so not before group 1's use
    assert index(gm, gathers[1]) < index(gm, uses[0])
    assert index(gm, uses[0]) < index(gm, gathers[2]) < index(gm, uses[1])
    assert index(gm, uses[1]) < index(gm, gathers[3]) < index(gm, uses[2])


def test_a_graph_without_gathers_is_left_as_it_is():
    gm, _, _ = traced_like([])
    before = [n.name for n in gm.graph.nodes]
    assert place_gathers(gm, 100) == 0
    assert [n.name for n in gm.graph.nodes] == before


def test_packed_gradient_rows_are_the_shard_layout_of_stage_2():
    """The rows a bucket's in-graph reduce-scatter sends: ShardLayout.pack's, for every rank
    count (odd sizes, a tensor smaller than the ranks)."""
    torch.manual_seed(0)
    grads = [torch.randn(3, 5), torch.randn(7), torch.randn(1)]
    for world in (1, 2, 3, 4):
        layout = ShardLayout([g.numel() for g in grads], world, 0)
        expected = torch.empty(world, layout.row)
        layout.pack([g.reshape(-1) for g in grads], expected)
        assert torch.equal(_pack_rows(grads, [g.numel() for g in grads], world), expected)
