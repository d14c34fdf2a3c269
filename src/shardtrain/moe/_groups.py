"""The expert-parallel groups: ``ep_size`` adjacent ranks share the experts of one layer
between them (tokens travel to their expert by all-to-all), and the ranks that hold the same
experts form an expert-data-parallel group, over which those experts' gradients are summed.

With 4 ranks and ``ep_size`` 2 (DeepSpeed's layout): expert-parallel groups ``[0, 1]`` and
``[2, 3]``, expert-data-parallel groups ``[0, 2]`` and ``[1, 3]``.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from .. import comm

__all__ = ["ExpertGroups", "expert_groups", "find_expert_groups", "layout"]


class ExpertGroups:
    """This rank's two groups for one ``ep_size``: ``ep`` (all-to-all) and ``edp`` (the
    replicas of its experts), and its index in ``ep`` (which experts it holds)."""

    def __init__(self, ep_size: int, ep: comm.Group, edp: comm.Group, ep_rank: int):
        self.ep_size, self.ep, self.edp, self.ep_rank = ep_size, ep, edp, ep_rank

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


_made: Dict[int, ExpertGroups] = {}


def expert_groups(ep_size: int) -> ExpertGroups:
    """This rank's groups for ``ep_size``, created on first use (a collective: every rank
    calls it for the same sizes in the same order)."""
    if ep_size in _made:
        return _made[ep_size]
    world, rank = comm.get_world_size(), comm.get_rank()
    ep_ranks, edp_ranks = layout(world, ep_size)
    if world == 1 or not comm.is_initialized():
        made = ExpertGroups(ep_size, comm.Group(None, "ep", solo=True),
                            comm.Group(None, "edp", solo=True), 0)
    else:
        # a group over every rank is the world's, under its own name
        ep = comm.Group(None, "ep") if ep_size == world else comm.split_groups(ep_ranks, "ep")
        edp = comm.Group(None, "edp") if ep_size == 1 else comm.split_groups(edp_ranks, "edp")
        made = ExpertGroups(ep_size, ep, edp, rank % ep_size)
    _made[ep_size] = made
    comm.before_destroy(_made.clear)
    return made


def find_expert_groups(group_name: str) -> ExpertGroups:
    """The groups made for ``group_name`` (``ep_size_<N>``, an expert parameter's
    ``group_name``); KeyError when none were made (no MoE layer of that size was wired)."""
    for made in _made.values():
        if made.name == group_name:
            return made
    raise KeyError(f"no expert-parallel group {group_name!r}: the groups are made when an engine "
                   "is built around the MoE layers (or by moe.set_deepspeed_parallelism()); made: "
                   f"{sorted(m.name for m in _made.values())}")
