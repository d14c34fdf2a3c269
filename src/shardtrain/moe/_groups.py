"""The expert-parallel groups: ``ep_size`` adjacent ranks share the experts of one layer
between them (tokens travel to their expert by all-to-all), and the ranks that hold the same
experts form an expert-data-parallel group, over which those experts' gradients are summed.

With 4 ranks and ``ep_size`` 2 (DeepSpeed's layout): expert-parallel groups ``[0, 1]`` and
``[2, 3]``, expert-data-parallel groups ``[0, 2]`` and ``[1, 3]``.

On a mesh with tensor parallelism the experts are split over the ranks that see different
tokens: the data- (x sequence-) parallel ranks of each tensor-parallel coordinate, which is
where the groups above are laid out; the ranks of a tensor-parallel group see the same tokens
and hold the same experts (their ``replicas`` group, with the expert-data-parallel ranks).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .. import comm

__all__ = ["ExpertGroups", "expert_groups", "find_expert_groups", "layout"]


class ExpertGroups:
    """This rank's groups for one ``ep_size``: ``ep`` (all-to-all), ``edp`` (the replicas of
    its experts whose gradients it sums), ``replicas`` (every rank holding its experts: the
    ``edp`` ranks of each tensor-parallel coordinate), and its index in ``ep`` (which experts
    it holds)."""

    def __init__(self, ep_size: int, ep: comm.Group, edp: comm.Group, ep_rank: int,
                 replicas: comm.Group = None):
        self.ep_size, self.ep, self.edp, self.ep_rank = ep_size, ep, edp, ep_rank
        self.replicas = replicas if replicas is not None else edp

    @property
    def name(self) -> str:
        """DeepSpeed's name for the group (``ep_size_<N>``), the experts' ``group_name``."""
        return f"ep_size_{self.ep_size}"


def layout(world: int, ep_size: int) -> Tuple[List[List[int]], List[List[int]]]:
    """The expert-parallel and expert-data-parallel groups of ``world`` ranks, as rank lists."""
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide the {world} data-parallel ranks: "
                         f"choose an ep_size that divides {world} (e.g. "
                         f"{_divisors(world)}), or launch a multiple of {ep_size} ranks.")
    ep = [list(range(start, start + ep_size)) for start in range(0, world, ep_size)]
    edp = [list(range(first, world, ep_size)) for first in range(ep_size)]
    return ep, edp


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_layout(token_ranks: List[List[int]], ep_size: int
                ) -> Tuple[List[List[int]], List[List[int]], List[List[int]]]:
    """The expert-parallel, expert-data-parallel and replica groups (rank lists) when each
    list of ``token_ranks`` (the data- x sequence-parallel ranks of one tensor-parallel
    coordinate, in order) is laid out as :func:`layout` lays out a world."""
    ep, edp = [], []
    for ranks in token_ranks:
        local_ep, local_edp = layout(len(ranks), ep_size)
        ep += [[ranks[i] for i in g] for g in local_ep]
        edp += [[ranks[i] for i in g] for g in local_edp]
    replicas = [sorted(r for ranks in token_ranks for r in ranks[j::ep_size])
                for j in range(ep_size)]
    return ep, edp, replicas


_made: Dict[Tuple, ExpertGroups] = {}  # by ep_size and the ranks they are laid over


def expert_groups(ep_size: int, mesh: Optional[comm.Mesh] = None) -> ExpertGroups:
    """This rank's groups for ``ep_size`` (on ``mesh``: over its data- x sequence-parallel
    ranks, per tensor-parallel coordinate), created on first use (a collective: every rank
    calls it for the same sizes in the same order)."""
    world, rank = comm.get_world_size(), comm.get_rank()
    token_ranks = _token_ranks(world, mesh)
    key = (ep_size, tuple(map(tuple, token_ranks)))
    if key in _made:
        return _made[key]
    ep_ranks, edp_ranks, replica_ranks = mesh_layout(token_ranks, ep_size)
    if world == 1 or not comm.is_initialized():
        made = ExpertGroups(ep_size, comm.Group(None, "ep", solo=True),
                            comm.Group(None, "edp", solo=True), 0)
    else:
        # a group over every rank is the world's, under its own name
        ep = comm.Group(None, "ep") if ep_size == world else comm.split_groups(ep_ranks, "ep")
        edp = _over(edp_ranks, world, "edp")
        replicas = _over(replica_ranks, world, "experts")
        mine = next(g for g in ep_ranks if rank in g)
        made = ExpertGroups(ep_size, ep, edp, mine.index(rank), replicas)
    _made[key] = made
    comm.before_destroy(_made.clear)
    return made


def _token_ranks(world: int, mesh: Optional[comm.Mesh]) -> List[List[int]]:
    """The ranks that see different tokens, one list per tensor-parallel coordinate, each in
    the order of its data- x sequence-parallel coordinates."""
    if mesh is None or mesh.size("tp") == 1:
        return [list(range(world))]
    tp = mesh.size("tp")  # innermost: a coordinate's ranks are every tp-th one
    return [[r for r in range(world) if r % tp == t] for t in range(tp)]


def _over(partition: List[List[int]], world: int, name: str) -> comm.Group:
    if len(partition) == 1 and len(partition[0]) == world:
        return comm.Group(None, name)
    if all(len(g) == 1 for g in partition):
        return comm.Group(None, name, solo=True)
    return comm.split_groups(partition, name)


def find_expert_groups(group_name: str) -> ExpertGroups:
    """The groups made for ``group_name`` (``ep_size_<N>``, an expert parameter's
    ``group_name``); KeyError when none were made (no MoE layer of that size was wired)."""
    for made in reversed(list(_made.values())):  # the latest made for that size
        if made.name == group_name:
            return made
    raise KeyError(f"no expert-parallel group {group_name!r}: the groups are made when an engine "
                   "is built around the MoE layers (or by moe.set_deepspeed_parallelism()); made: "
                   f"{sorted(m.name for m in _made.values())}")
