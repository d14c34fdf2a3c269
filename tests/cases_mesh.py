"""Rank bodies for test_mesh.py: a device mesh's groups and the collectives over them."""
from __future__ import annotations

import torch

from shardtrain import comm


def groups_and_collectives(rank: int, world_size: int, tp: int, sp: int) -> dict:
    mesh = comm.init_mesh(tp=tp, sp=sp)
    out = {"sizes": mesh.sizes, "coordinate": mesh.coordinate(),
           "ranks": {d: getattr(mesh, d).ranks() for d in comm.MESH_DIMS},
           "zero_ranks": mesh.zero.ranks(),
           "local": {d: getattr(mesh, d).rank() for d in comm.MESH_DIMS},
           "device_mesh": mesh.device_mesh.mesh.tolist() if mesh.device_mesh else None}
    sums = {}
    for d in comm.MESH_DIMS + ("zero",):
        group = mesh.zero if d == "zero" else getattr(mesh, d)
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=group)
        avg = torch.tensor([float(rank)])
        comm.all_reduce(avg, "avg", group=group)
        gathered = torch.empty(group.size())
        comm.all_gather(gathered, torch.tensor([float(rank)]), group=group)
        rows = torch.arange(group.size(), dtype=torch.float32) + 10 * rank
        mine = torch.empty(1)
        comm.reduce_scatter(mine, rows, group=group)
        last = torch.tensor([float(rank)])
        comm.broadcast(last, src=group.size() - 1, group=group)  # a group-local rank
        scattered = torch.empty(1)
        rows = (torch.arange(group.size(), dtype=torch.float32) * 100 + rank).view(-1, 1)
        comm.scatter(scattered, rows if group.rank() == 0 else None, src=0, group=group)
        exchanged = torch.empty(group.size())
        comm.all_to_all_single(exchanged, torch.arange(group.size(), dtype=torch.float32)
                               + 100 * rank, group=group)
        sums[d] = {"sum": t.item(), "avg": avg.item(), "gathered": gathered.tolist(),
                   "reduce_scatter": mine.item(), "broadcast": last.item(),
                   "scatter": scattered.item(), "all_to_all": exchanged.tolist(),
                   "objects": comm.all_gather_object(rank, group=group),
                   "object": comm.broadcast_object(f"from {rank}", src=0, group=group)}
    out["collectives"] = sums
    return out


def refusals(rank: int, world_size: int) -> dict:
    seen = {}
    for kwargs in ({"tp": 3}, {"tp": 2, "sp": 3}, {"tp": 0}, {"sp": 1.5}):
        try:
            comm.init_mesh(**kwargs)
        except ValueError as err:
            seen[str(kwargs)] = str(err)
    return seen
