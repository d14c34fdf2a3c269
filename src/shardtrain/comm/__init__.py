"""Process groups and collectives.

This is the only package that imports ``torch.distributed``. Everything else asks it for
ranks and calls its named collectives, so that the rules (how a process finds its rank,
what a world of one process does, how a collective is counted, what a failed one reports)
live in one place:

* :mod:`._process`: the default process group, joined and left (:func:`init_distributed`,
  :func:`destroy`), this process's place in it, the default timeout;
* :mod:`._groups`: :class:`Group` (the world, a :class:`Mesh`'s dimensions, split groups,
  the side group) and :func:`set_timeout`, which bounds their collectives;
* :mod:`._ops`: the collectives;
* :mod:`._diagnose`: the trail of collectives each rank keeps, the divergence check, and
  :class:`CollectiveError`'s report when a collective fails.

Imports go one way: ``_process`` <- ``_groups`` <- ``_diagnose`` <- ``_ops``.

Example:
    >>> import shardtrain
    >>> shardtrain.init_distributed()     # reads torchrun / SLURM / OpenMPI variables
    >>> shardtrain.comm.get_world_size()
    1
"""
from __future__ import annotations

from ._diagnose import (CHECK_MODES, CollectiveError, CollectiveTiming, DivergenceError,
                        check_agreement, check_mode, keep_trail, labelled, mark, set_check,
                        set_position, time_collectives, trail, trail_dir)
from ._groups import (MESH_DIMS, WORLD, Group, Mesh, SideGroup, init_mesh, set_timeout,
                      side_group, split_groups)
from ._ops import (ReduceOp, Work, add_observer, all_gather, all_gather_object, all_reduce,
                   all_to_all_single, barrier, broadcast, broadcast_coalesced, broadcast_object,
                   remove_observer, reduce_scatter, scatter)
from ._process import (FLIGHT_RECORDER_ENV, LaunchEnv, available_backends, before_destroy,
                       default_timeout, destroy, detect_launch_env, flight_recorder_prefix,
                       get_backend, get_local_rank, get_local_world_size, get_rank,
                       get_world_size, init_distributed, is_initialized, timeout_override)

__all__ = [
    "init_distributed", "destroy", "is_initialized", "get_rank", "get_world_size",
    "get_local_rank", "get_local_world_size", "get_backend", "available_backends", "barrier",
    "ReduceOp", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "broadcast_coalesced",
    "scatter", "all_to_all_single",
    "all_gather_object", "broadcast_object", "Work", "add_observer", "remove_observer",
    "split_groups", "CollectiveError", "DivergenceError", "set_position", "labelled", "mark",
    "set_check", "check_agreement", "set_timeout", "timeout_override", "default_timeout",
    "trail", "trail_dir", "keep_trail", "CHECK_MODES", "check_mode", "flight_recorder_prefix",
    "FLIGHT_RECORDER_ENV",
    "LaunchEnv", "detect_launch_env", "Group", "WORLD", "SideGroup", "side_group",
    "before_destroy", "MESH_DIMS", "Mesh", "init_mesh", "CollectiveTiming", "time_collectives",
]
